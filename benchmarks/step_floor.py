"""A decode step against its floor, at batch 1, 8 and 64 (offline engine, demo model, float32).

    .venv/bin/python benchmarks/step_floor.py [--rounds 3] [--attention-backend torch,cpu]

The floor of a decode step is what its arithmetic and its KV reads need on this machine, with
the threads the engine uses (offline: torch's threads, every core; a served engine core gets the
same threads here, so one floor serves both modes until CPU placement gives the core cores of its
own):
- GEMMs: every linear of the model at the step's batch (the LM head at the rows that sample),
  each timed alone on this machine with the model's own weights (fused where the model fuses);
- KV: the batch's context bytes (every layer, K and V or the latent, as stored) ÷ the measured
  memcpy bandwidth (bytes copied per second by one large `copy_`), measured before and after
  each step's timing, since it moves within a run.

The step is the engine's own `Engine.step()` over B requests whose prompts (64–512 token ids,
those of benchmarks/vllm_peer.py) are prefilled, each step timed alone; then a torch profile of
more steps splits it into linears, attention (the backend's calls, its Python included), other
model ops (norms, rotary, activations, embedding; the CPU backend's fused ones too), Python in
the forward outside ops, sampling (LM head and sampler), and scheduling with bookkeeping
(schedule, batch building, attention planning, output collection). Profiled shares are scaled
to the unprofiled median.

Rounds alternate the backends (one engine each in this process) and the batch sizes; each
figure is the median of the rounds. Writes benchmarks/results/step-floor/report.md
(report-BACKENDS.md for another list).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from tierserve import LLM, SamplingParams
from tierserve.args import default_model
from tierserve.engine import Engine
from tierserve.layers.cpu_linear import linear, onednn_dtypes

OUT = Path(__file__).parent / "results" / "step-floor"
BATCHES = (1, 8, 64)
TIMED_STEPS, PROFILED_STEPS = 24, 8
# torch's linear, and oneDNN's on weights the loader reordered (layers/cpu_linear.py).
LINEAR_OPS = ("aten::linear", "mkldnn::_linear_pointwise")
# Ops the forward calls: aten's, oneDNN's linears, and the CPU backend's fused layer ops
# (RMSNorm, rotary, SiLU x up), which are other model ops, not the forward's Python.
MODEL_OPS = ("aten::", "mkldnn::", "tierserve::")
CATEGORIES = ("linears", "attention", "other ops", "forward Python", "sampling", "scheduling")


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 513, (64,), generator=g).tolist()
    return [torch.randint(3, 4000, (k,), generator=g).tolist() for k in lengths][:n]


# --- the floor -------------------------------------------------------------------------------


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memcpy_bandwidth() -> float:
    """Bytes per second one large copy moves (read once, written once)."""
    src = torch.rand(64 * 2**20)  # 256 MiB: far past the caches
    dst = torch.empty_like(src)
    return src.numel() * 4 / median_seconds(lambda: dst.copy_(src), 7)


# Linears of one input that the floor counts as one GEMM (the engine packs them so).
PACKED = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)


def linears_of(model: nn.Module) -> list[torch.Tensor]:
    """The [out, in] weight of every GEMM a decode step needs at least, the LM head last:
    the model's linears, packed where they share their input (also for code that does not)."""
    by_parent: dict[str, dict[str, torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name != "lm_head":
            parent, _, leaf = name.rpartition(".")
            w = m.weight  # dense again where the loader reordered it for oneDNN
            by_parent.setdefault(parent, {})[leaf] = w.to_dense() if w.is_mkldnn else w
    weights = []
    for linears in by_parent.values():
        for group in PACKED:
            if all(g in linears for g in group):
                weights.append(torch.cat([linears.pop(g) for g in group]))
        weights += linears.values()
    head = model.lm_head.weight
    return [*weights, head.to_dense() if head.is_mkldnn else head]


def gemm_floor(model: nn.Module, batch: int) -> float:
    """Each GEMM by the faster of torch's F.linear and oneDNN on a reordered weight (what the
    engine runs on CPU): the floor is this machine's best, not the engine's choice."""
    total = 0.0
    with torch.inference_mode():
        for w in linears_of(model):
            x = torch.randn(batch, w.shape[1], dtype=w.dtype)
            ways = [w]
            if w.dtype in onednn_dtypes():
                ways.append(torch.ops.mkldnn._reorder_linear_weight(w, None))
            total += min(median_seconds(lambda x=x, w=v: linear(x, w), 15) for v in ways)
    return total


def kv_bytes(llm: LLM) -> int:
    """The running batch's context, as the pool stores it."""
    spec = llm.engine.kv.pool.spec
    per_token = spec.bytes_per_page // spec.page_size
    return sum(r.num_computed * per_token for r in llm.engine.scheduler.running)


# --- the step ---------------------------------------------------------------------------------


@contextmanager
def labelled(llm: LLM) -> Iterator[None]:
    """The engine's phases as profiler ranges, for the breakdown only (wrapped here, not in
    the engine, so the measured steps run the code as it ships)."""
    engine = llm.engine
    runner, attn = engine.runner, engine.runner.attn
    import tierserve.engine.runner as runner_module

    patches: list[tuple[Any, str, Any]] = [
        (engine.scheduler, "schedule", "scheduling"),
        (runner, "_build_batch", "scheduling"),
        (attn, "prepare", "scheduling"),
        (engine, "_advance", "scheduling"),
        (attn, "forward", "attention"),
        (attn, "forward_latent", "attention"),
        (runner.model, "logits", "sampling"),
        (runner_module, "sample", "sampling"),
        (runner.model, "forward", "forward"),
    ]
    saved = []
    for owner, name, label in patches:
        original = getattr(owner, name)
        saved.append((owner, name, original))

        def wrapped(*a: Any, _f: Any = original, _label: str = label, **k: Any) -> Any:
            with record_function(f"step::{_label}"):
                return _f(*a, **k)

        setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, original in saved:
            if owner is runner_module:
                setattr(owner, name, original)
            else:
                delattr(owner, name) if name in vars(owner) else setattr(owner, name, original)


def _intervals(events: list[Any], name: str) -> list[tuple[float, float]]:
    return [(e.time_range.start, e.time_range.end) for e in events if e.name == name]


def _inside(e: Any, spans: list[tuple[float, float]]) -> bool:
    return any(a <= e.time_range.start and e.time_range.end <= b for a, b in spans)


def breakdown(llm: LLM, steps: int) -> dict[str, float]:
    """Seconds per step by category (profiled, so slower than unprofiled)."""
    with labelled(llm), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        wall = time.perf_counter() - start
    events = list(prof.events())
    label = {c: _intervals(events, f"step::{c}") for c in ("attention", "sampling", "forward")}
    sched = _intervals(events, "step::scheduling")
    span = lambda xs: sum(b - a for a, b in xs)  # noqa: E731
    forward_ops = [
        e
        for e in events
        if e.name.startswith(MODEL_OPS)
        and _inside(e, label["forward"])
        and not _inside(e, label["attention"])
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]
    linear = sum(e.cpu_time_total for e in forward_ops if e.name in LINEAR_OPS)
    other = sum(e.cpu_time_total for e in forward_ops if e.name not in LINEAR_OPS)
    attention, forward = span(label["attention"]), span(label["forward"])
    us = {
        "linears": linear,
        "attention": attention,
        "other ops": other,
        "forward Python": forward - attention - linear - other,
        "sampling": span(label["sampling"]),
        "scheduling": span(sched),
    }
    known = sum(us.values())
    us["scheduling"] += wall * 1e6 - known  # the step loop's own Python
    return {k: v / 1e6 / steps for k, v in us.items()}


def prefilled(llm: LLM, batch: int, max_tokens: int) -> Engine:
    """`llm`'s engine with `batch` requests of prompts(batch) prefilled, each decoding (up to
    `max_tokens` greedy tokens, EOS ignored), from an empty prefix cache."""
    engine = llm.engine
    engine.flush_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for ids in prompts(batch):
        llm._submit(ids, params)
    while any(not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill until every request decodes
    return engine


def measure(llm: LLM, batch: int) -> dict[str, float]:
    engine = prefilled(llm, batch, TIMED_STEPS + PROFILED_STEPS + 4)
    times, kv = [], []
    for _ in range(TIMED_STEPS):
        kv.append(kv_bytes(llm))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    parts = breakdown(llm, PROFILED_STEPS)
    while engine.has_unfinished():
        engine.step()
    step = statistics.median(times)
    scale = step / sum(parts.values())
    return {
        "step": step,
        "kv_bytes": statistics.median(kv),
        **{k: v * scale for k, v in parts.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--attention-backend",
        default="torch,cpu",
        help="backends to compare, comma-separated; each round runs them in turn",
    )
    ns = ap.parse_args()
    backends = ns.attention_backend.split(",")
    llms = {
        b: LLM(
            default_model(), max_running_requests=64, max_total_tokens=65536, attention_backend=b
        )
        for b in backends
    }
    rounds: dict[tuple[str, int], list[dict[str, float]]] = {}
    for r in range(ns.rounds):
        order = backends if r % 2 == 0 else backends[::-1]
        for backend in order:
            llm = llms[backend]
            for b in BATCHES if r % 2 == 0 else reversed(BATCHES):
                # Measured beside each step: this machine's memory bandwidth moves within a run
                # (23 to 41 GB/s here, as its neighbours' load does), and the step's KV reads
                # move with it.
                bandwidth = memcpy_bandwidth()
                m = measure(llm, b)
                m["bandwidth"] = (bandwidth + memcpy_bandwidth()) / 2
                m["gemm_floor"] = gemm_floor(llm.engine.runner.model, b)
                m["kv_floor"] = m["kv_bytes"] / m["bandwidth"]
                m["ratio"] = m["step"] / (m["gemm_floor"] + m["kv_floor"])
                rounds.setdefault((backend, b), []).append(m)
                print(f"round {r} {backend} batch {b}: step {m['step'] * 1e3:.2f} ms", flush=True)
    for llm in llms.values():
        llm.close()
    write_report(ns, backends, rounds)


def write_report(
    ns: argparse.Namespace,
    backends: list[str],
    rounds: dict[tuple[str, int], list[dict[str, float]]],
) -> None:
    med = {
        key: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for key, ms in rounds.items()
    }
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    lines = [
        "# A decode step against its floor",
        "",
        f"`.venv/bin/python benchmarks/step_floor.py --rounds {ns.rounds} --attention-backend "
        f"{ns.attention_backend}` (demo model, float32, offline engine, "
        f"{torch.get_num_threads()} torch threads; medians of "
        f"{ns.rounds} rounds, backends and batch sizes alternating). Times in ms per decode "
        "step; the breakdown is a torch profile's shares of the step. The KV floor divides by "
        "the memcpy bandwidth measured beside each step (before and after it); step / floor "
        "is the median of the rounds' ratios.",
        "",
        "| backend | batch | step | floor | step / floor | GEMM floor | KV floor (MB, GB/s) | "
        + " | ".join(CATEGORIES)
        + " |",
        "| --- " + "| ---: " * (6 + len(CATEGORIES)) + "|",
    ]
    for backend in backends:
        for b in BATCHES:
            m = med[(backend, b)]
            floor = m["gemm_floor"] + m["kv_floor"]
            cells = [
                backend,
                str(b),
                ms(m["step"]),
                ms(floor),
                f"{m['ratio']:.2f}×",
                ms(m["gemm_floor"]),
                f"{ms(m['kv_floor'])} ({m['kv_bytes'] / 1e6:.1f}, {m['bandwidth'] / 1e9:.0f})",
                *(ms(m[c]) for c in CATEGORIES),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Every round (step / floor):",
        "",
        "| backend | batch | " + " | ".join(f"round {i}" for i in range(ns.rounds)) + " |",
        "| --- " + "| ---: " * (ns.rounds + 1) + "|",
    ]
    for backend in backends:
        for b in BATCHES:
            ratios = [m["ratio"] for m in rounds[(backend, b)]]
            cells = " | ".join(f"{x:.2f}×" for x in ratios)
            lines.append(f"| {backend} | {b} | {cells} |")
    OUT.mkdir(parents=True, exist_ok=True)
    name = (
        "report.md" if ns.attention_backend == "torch,cpu" else f"report-{ns.attention_backend}.md"
    )
    (OUT / name.replace(",", "-")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
