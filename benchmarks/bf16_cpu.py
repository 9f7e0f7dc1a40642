"""`--dtype bfloat16` against float32 on this CPU, offline: throughput in alternating rounds,
where each dtype's time goes, and greedy agreement with transformers in the same dtype.

    .venv/bin/python benchmarks/bf16_cpu.py [--rounds 3]

- throughput: `LLM.generate` of vllm_peer.py's 64 prompts (64–512 token ids × 128 greedy
  tokens, EOS ignored) after a warm-up batch, each round a fresh process per dtype, float32
  first in even rounds; the ratio is the median of the rounds' ratios;
- where the time goes: torch's profiler over one batch of the 64 prompts × 16 tokens (their
  prefill and 15 decode steps) per dtype, by op: the linears (oneDNN), the paged attention
  kernel (decode, and prompts up to 1,024 tokens: all of these), SDPA (longer prompts), the
  rest; oneDNN's own account of which kernel ran a bf16 linear;
- agreement: 16 of the prompts, one at a time, 32 greedy tokens, against transformers'
  `generate` on the same checkpoint in the same dtype: prompts whose tokens are all equal, and
  the mean length of the common prefix.

Writes benchmarks/results/bf16-cpu/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from vllm_peer import PROMPTS, _json_of  # beside this script: on sys.path

from tierserve.args import default_model
from tierserve.bench.report import machine_info
from tierserve.utils import cpu_flags

OUT = Path(__file__).parent / "results" / "bf16-cpu"
DTYPES = ("float32", "bfloat16")
GROUPS = {
    "linears (oneDNN)": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear"),
    # The kernel takes decode and prefill spans up to CPUPagedAttention.MAX_KERNEL_QUERIES
    # tokens (every prompt here); SDPA the longer spans.
    "attention (paged kernel)": ("tierserve::paged_attention",),
    "attention (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
}
RUN = (
    PROMPTS
    + """
import json, sys, time, torch
from tierserve import LLM, SamplingParams
from torch.profiler import ProfilerActivity, profile
dtype, what = sys.argv[4], sys.argv[5]
llm = LLM(sys.argv[1], max_total_tokens=65536, dtype=dtype)
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
if what == "speed":
    llm.generate(WARM, greedy(128))
    start = time.perf_counter()
    llm.generate(PROMPTS, greedy(128))
    print("RESULT", json.dumps({"tok_s": 64 * 128 / (time.perf_counter() - start)}))
elif what == "profile":
    llm.generate(WARM[:8], greedy(16))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(PROMPTS, greedy(16))
    ops = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    print("RESULT", json.dumps(ops))
else:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=getattr(torch, dtype))
    same, common = 0, []
    for p in PROMPTS[:16]:
        ours = llm.generate([p], greedy(32))[0].token_ids
        ids = torch.tensor([p])
        theirs = hf.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
        theirs = theirs[0, len(p):].tolist()
        same += ours == theirs
        common.append(next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), 32))
    print("RESULT", json.dumps({"same": same, "common": sum(common) / len(common)}))
"""
)


def run(model: str, dtype: str, what: str) -> dict:
    return _json_of([sys.executable, "-c", RUN, model, "full", "0", dtype, what])


def onednn_kernel() -> str:
    """Which oneDNN kernel runs a bf16 linear of the demo model's shape here."""
    code = (
        "import torch; a = torch.randn(64, 256, dtype=torch.bfloat16); "
        "w = torch.randn(768, 256, dtype=torch.bfloat16); torch.nn.functional.linear(a, w)"
    )
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if ",primitive,exec," in line:
            return line.split(",")[5] + " " + line.split(",")[6]
    return "(oneDNN printed no kernel)"


def cpu_line() -> str:
    """The CPU and the bf16 units it reports: this environment has run on more than one."""
    units = [u for u in ("amx_bf16", "avx512_bf16") if u in cpu_flags()] or ["no bf16 units"]
    return f"{machine_info().get('cpu_model', 'an unnamed CPU')} ({', '.join(units)})"


def grouped(ops: dict[str, float]) -> dict[str, float]:
    out = {name: sum(ops.get(op, 0.0) for op in members) for name, members in GROUPS.items()}
    out["the rest"] = sum(ops.values()) - sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    model = default_model()
    speed: dict[str, list[float]] = {d: [] for d in DTYPES}
    for r in range(ns.rounds):
        for dtype in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            speed[dtype].append(run(model, dtype, "speed")["tok_s"])
        print(json.dumps({d: v[-1] for d, v in speed.items()}), flush=True)
    times = {d: grouped(run(model, d, "profile")) for d in DTYPES}
    agree = {d: run(model, d, "agree") for d in DTYPES}
    write_report(ns.rounds, speed, times, agree, onednn_kernel())


def write_report(
    rounds: int,
    speed: dict[str, list[float]],
    times: dict[str, dict[str, float]],
    agree: dict[str, dict],
    kernel: str,
) -> None:
    ratios = [b / f for f, b in zip(speed["float32"], speed["bfloat16"], strict=True)]
    lines = [
        "# bf16 against float32 on this CPU (offline)",
        "",
        f"`.venv/bin/python benchmarks/bf16_cpu.py --rounds {rounds}` (demo model, 2-core CPU, "
        "the KV pool in the model's dtype).",
        "",
        "| | float32 | bfloat16 | bfloat16 / float32 |",
        "| --- | ---: | ---: | ---: |",
        f"| 64 × 128 offline, tok/s (median; ratio: median of the rounds') | "
        f"{statistics.median(speed['float32']):,.0f} | {statistics.median(speed['bfloat16']):,.0f}"
        f" | {statistics.median(ratios):.2f}× |",
    ]
    for group in times["float32"]:
        f, b = times["float32"][group], times["bfloat16"][group]
        ratio = f"{f / b:.2f}× the speed" if f and b else "not run"
        lines.append(f"| {group}, ms (64 × 16, one run) | {f:,.0f} | {b:,.0f} | {ratio} |")
    lines += [
        "",
        f"oneDNN's kernel for a bf16 linear here: `{kernel}`, on {cpu_line()}.",
        "",
        "Greedy agreement with transformers' `generate` in the same dtype (16 prompts, 32 "
        "tokens each, one at a time):",
        "",
    ]
    for dtype, got in agree.items():
        lines.append(
            f"- {dtype}: {got['same']}/16 prompts with every token equal; common prefix "
            f"{got['common']:.1f} tokens on average"
        )
    lines += ["", "Every round (tok/s):", ""]
    for i, (f, b) in enumerate(zip(speed["float32"], speed["bfloat16"], strict=True)):
        lines.append(f"- round {i}: float32 {f:,.0f}, bfloat16 {b:,.0f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print((OUT / "report.md").read_text())


if __name__ == "__main__":
    main()
