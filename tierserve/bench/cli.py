"""`tierserve bench run | compare`: the field's serving workloads against any OpenAI-compatible
server, or side by side against tierserve under named cache configurations.

    tierserve bench run --url http://127.0.0.1:8000 --workload multiturn [--out DIR]
    tierserve bench compare --workload multiturn --out DIR [--configs device-only,write_back,limit]

Workloads are built in token space from a seed (docs/bench.md has their exact semantics).
One thing at some length: the command line of a benchmark, whose flags mirror SGLang's
bench_multiturn and vLLM's bench serve one for one.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

from tierserve.errors import TierserveError
from tierserve.utils import check_url

WORKLOADS = ("multiturn", "shared-prefix", "random", "trace")


def _scale(text: str) -> float:
    """A scale factor: 0.25, 1/32."""
    try:
        return float(Fraction(text))
    except (ValueError, ZeroDivisionError) as err:
        raise argparse.ArgumentTypeError(f"not a number or fraction: {text!r}") from err


def _rate(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity") else float(text)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="multiturn")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and the schedule")
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt token ids are drawn from [--token-low, vocab size) (default: from the "
        "model's config.json: --model, else --tokenizer, else the bundled demo model)",
    )
    g.add_argument("--token-low", type=int, default=16, help="smallest prompt token id")
    m = p.add_argument_group("multiturn (SGLang bench_multiturn)")
    m.add_argument("--num-clients", type=int, default=16)
    m.add_argument("--num-rounds", type=int, default=6)
    m.add_argument("--request-length", type=int, default=640, help="round-0 prompt tokens")
    m.add_argument(
        "--sub-question-length",
        type=int,
        default=32,
        help="tokens of the question added each later round (0 = --request-length, as SGLang)",
    )
    m.add_argument(
        "--output-length",
        type=int,
        default=16,
        help="output tokens per request (multiturn, shared-prefix)",
    )
    m.add_argument(
        "--round-barrier",
        action="store_true",
        help="no client starts round r+1 before every client finished round r",
    )
    m.add_argument(
        "--ready-queue-policy",
        choices=["random", "fifo"],
        default="random",
        help="which ready round is sent next (SGLang's --ready-queue-policy)",
    )
    s = p.add_argument_group("shared-prefix (SGLang generated-shared-prefix)")
    s.add_argument("--num-groups", type=int, default=8)
    s.add_argument("--prompts-per-group", type=int, default=8)
    s.add_argument("--system-prompt-len", type=int, default=512)
    s.add_argument("--question-len", type=int, default=64)
    r = p.add_argument_group("random")
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--random-input-len", type=int, default=512)
    r.add_argument("--random-output-len", type=int, default=64)
    r.add_argument(
        "--random-range-ratio",
        type=float,
        default=None,
        help="sglang: lengths in [max(floor(L·ratio),1), L], default 1 (fixed); vllm: "
        "[max(floor(L·(1−ratio)),1), ceil(L·(1+ratio))], default 0 (fixed)",
    )
    r.add_argument("--random-range-semantics", choices=["sglang", "vllm"], default="sglang")
    t = p.add_argument_group("trace (Mooncake)")
    t.add_argument(
        "--trace-file",
        default="conversation",
        help="a .jsonl path, or a name in shared/data/mooncake-traces: conversation, synthetic",
    )
    t.add_argument("--trace-start", type=int, default=0, help="first line replayed")
    t.add_argument("--trace-num-requests", type=int, default=100)
    t.add_argument(
        "--trace-block-scale",
        type=_scale,
        default=1 / 32,
        help="tokens per hash id = round(512 × this) (default 1/32: 16 tokens)",
    )
    t.add_argument(
        "--trace-length-scale",
        type=_scale,
        default=1 / 32,
        help="input and output lengths × this (default 1/32)",
    )
    t.add_argument(
        "--trace-time-scale", type=_scale, default=1.0, help="arrival times × this (default 1)"
    )
    t.add_argument(
        "--trace-context-length",
        type=int,
        default=None,
        help="clip prompts (or skip requests) that prompt + output would push past this many "
        "tokens; default: the model's max_position_embeddings when --model is given",
    )
    load = p.add_argument_group("load")
    load.add_argument(
        "--backend",
        choices=["generate", "openai"],
        default="generate",
        help="generate: native /generate with token ids (tierserve, SGLang; exact multi-turn "
        "histories); openai: /v1/completions (any server; multi-turn re-encodes the output text "
        "with --tokenizer)",
    )
    load.add_argument(
        "--max-in-flight",
        "--max-parallel",
        "--max-concurrency",
        dest="max_in_flight",
        type=int,
        default=0,
        help="most requests in flight (0: no bound)",
    )
    load.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="requests/s with Poisson (exponential) gaps; inf: no gaps (ignored by trace)",
    )
    load.add_argument("--tokenizer", default=None, help="tokenizer dir (openai backend)")
    load.add_argument("--served-model-name", default=None, help="`model` field (openai backend)")
    load.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, s")
    load.add_argument(
        "--no-flush", action="store_true", help="do not POST /flush_cache before the run"
    )
    load.add_argument(
        "--warmup-requests",
        type=int,
        default=2,
        help="short requests sent (then the cache flushed) before measuring",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    run_p = sub.add_parser("run", help="run one workload against a server at --url")
    run_p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    run_p.add_argument("--model", default=None, help="model dir (for --vocab-size only)")
    run_p.add_argument("--name", default="run", help="name of the run in the report")
    run_p.add_argument("--out", type=Path, default=None, help="write JSON, report and plots here")
    _add_workload_args(run_p)
    cmp_p = sub.add_parser(
        "compare", help="start tierserve under named configurations and run one workload on each"
    )
    cmp_p.add_argument("--out", type=Path, required=True, help="results folder")
    cmp_p.add_argument("--model", default=None, help="model dir (default: the bundled demo model)")
    cmp_p.add_argument(
        "--configs",
        default="device-only,write_through,write_through_selective,write_back,limit",
        help="comma-separated configurations, run in this order",
    )
    cmp_p.add_argument("--page-size", type=int, default=16)
    cmp_p.add_argument(
        "--device-tokens",
        type=int,
        default=None,
        help="device pool of the small configurations (default: --device-fraction of the KV)",
    )
    cmp_p.add_argument("--device-fraction", type=float, default=0.25)
    cmp_p.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        help="host tier = this × device pool (default: room for the whole workload twice)",
    )
    cmp_p.add_argument(
        "--server-args", default="", help="more `tierserve serve` flags for every configuration"
    )
    cmp_p.add_argument(
        "--store-extra-config",
        default=None,
        help="JSON of storage tier keys (docs/kv-cache.md) for replicas-...-store configurations, "
        "beside the store's address, e.g. '{\"prefetch_threshold\": 16}'",
    )
    cmp_p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measured runs per configuration (same server, cache flushed before each); the "
        "report shows the median-throughput one and the spread",
    )
    cmp_p.add_argument("--title", default=None, help="title of the report")
    cmp_p.add_argument("--note", default=None, help="a paragraph at the top of the report")
    _add_workload_args(cmp_p)


# --- building things from the flags -------------------------------------------------------


def _store_extra(text: str | None) -> dict[str, Any]:
    try:
        extra = json.loads(text) if text else {}
    except ValueError as err:
        message = f"--store-extra-config is not JSON: {err}"
        raise TierserveError(message, "store_extra_config") from None
    if not isinstance(extra, dict):
        raise TierserveError("--store-extra-config must be a JSON object", "store_extra_config")
    return extra


def _vocab_size(ns: argparse.Namespace) -> int:
    if ns.vocab_size:
        return ns.vocab_size
    from tierserve.args import default_model

    for d in (getattr(ns, "model", None), ns.tokenizer, default_model()):
        if d and (Path(d) / "config.json").is_file():
            try:
                return int(json.loads((Path(d) / "config.json").read_text())["vocab_size"])
            except (ValueError, KeyError, TypeError):
                message = f"{d}/config.json gives no vocab_size: give --vocab-size"
                raise TierserveError(message, "vocab_size") from None
    raise TierserveError(
        "cannot tell the vocabulary size: give --vocab-size or --model DIR", "vocab_size"
    )


def build_workload(ns: argparse.Namespace) -> tuple[Any, Any]:
    from tierserve.bench import workloads as w

    if ns.seed < 0:  # numpy's generators take no negative seed
        raise TierserveError(f"--seed must be >= 0, got {ns.seed}", "seed")
    space = w.TokenSpace(_vocab_size(ns), ns.token_low)
    if ns.workload == "multiturn":
        wl = w.multiturn(
            space,
            clients=ns.num_clients,
            rounds=ns.num_rounds,
            request_length=ns.request_length,
            output_length=ns.output_length,
            sub_question_length=ns.sub_question_length,
            seed=ns.seed,
        )
    elif ns.workload == "shared-prefix":
        wl = w.shared_prefix(
            space,
            groups=ns.num_groups,
            prompts_per_group=ns.prompts_per_group,
            system_prompt_len=ns.system_prompt_len,
            question_len=ns.question_len,
            output_len=ns.output_length,
            seed=ns.seed,
        )
    elif ns.workload == "random":
        ratio = ns.random_range_ratio
        if ratio is None:
            ratio = 1.0 if ns.random_range_semantics == "sglang" else 0.0
        wl = w.random_requests(
            space,
            num_prompts=ns.num_prompts,
            input_len=ns.random_input_len,
            output_len=ns.random_output_len,
            range_ratio=ratio,
            semantics=ns.random_range_semantics,
            seed=ns.seed,
        )
    else:
        wl = w.trace(
            space,
            path=ns.trace_file,
            num_requests=ns.trace_num_requests,
            start=ns.trace_start,
            block_scale=ns.trace_block_scale,
            length_scale=ns.trace_length_scale,
            time_scale=ns.trace_time_scale,
            seed=ns.seed,
            context_length=ns.trace_context_length or _context_length(ns),
        )
    return space, wl


def _context_length(ns: argparse.Namespace) -> int | None:
    """The served model's context, when the bench knows the model."""
    from tierserve.args import default_model
    from tierserve.model_config import ModelConfig

    model = getattr(ns, "model", None) or (
        default_model() if getattr(ns, "bench_command", "") == "compare" else None
    )
    return ModelConfig.from_dir(model).max_position_embeddings if model else None


def load_options(ns: argparse.Namespace) -> Any:
    from tierserve.bench.client import LoadOptions

    return LoadOptions(
        backend=ns.backend,
        max_in_flight=ns.max_in_flight,
        request_rate=ns.request_rate,
        round_barrier=ns.round_barrier,
        queue_policy=ns.ready_queue_policy,
        seed=ns.seed,
        model=ns.served_model_name,
        tokenizer=ns.tokenizer,
        timeout_s=ns.timeout,
        flush_before=not ns.no_flush,
    )


def _command() -> str:
    return "tierserve " + shlex.join(sys.argv[1:]) if sys.argv else "tierserve bench"


def _print_summary(name: str, s: dict[str, Any]) -> None:
    t, e, tp, itl = s["ttft_s"], s["e2e_s"], s["tpot_s"], s["itl_s"]

    def ms(x: float | None) -> str:
        return "–" if x is None else f"{x * 1e3:.1f}"

    print(f"== {name}: {s['completed']} completed, {s['failed']} failed, {s['duration_s']:.2f} s")
    print(
        f"throughput: {s['request_throughput']:.2f} req/s, {s['input_throughput']:.0f} input "
        f"tok/s, {s['output_throughput']:.1f} output tok/s"
    )
    for label, d in (("TTFT", t), ("TPOT", tp), ("ITL", itl), ("E2E", e)):
        print(
            f"{label:<5} ms  mean {ms(d['mean'])}  median {ms(d['median'])}  "
            f"p90 {ms(d['p90'])}  p99 {ms(d['p99'])}"
        )
    hit = s["hit_rate"]
    print("cache hit rate: " + ("–" if hit is None else f"{hit:.1%}"))
    if len(s["per_round"]) > 1:
        for r in s["per_round"]:
            rh = r["hit_rate"]
            print(
                f"  round {r['round']}: {r['requests']} req, prompt {r['prompt_len_mean']:.0f} "
                f"tok, TTFT mean {ms(r['ttft_s']['mean'])} ms, hit "
                + ("–" if rh is None else f"{rh:.1%}")
            )
    if s["per_tier"]:
        tiers = ", ".join(
            f"{k} {v:.1%}" for k, v in s["per_tier"]["hit_rate"].items() if v is not None
        )
        print(f"per tier: {tiers}")
    if s["errors"]:
        print(f"errors: {s['errors']}")


def _check_out(out: Path | None) -> None:
    """--out made and writable before any request: the results of a whole run were lost
    when it could not be written after it."""
    if out is None:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise TierserveError(f"cannot write --out {out}: {err.strerror}", "out") from None


def run(ns: argparse.Namespace) -> int:
    from tierserve.bench import compare as cmp
    from tierserve.bench import report
    from tierserve.bench.client import run_load, warmup

    if ns.warmup_requests < 0:
        message = f"--warmup-requests must be >= 0, got {ns.warmup_requests}"
        raise TierserveError(message, "warmup_requests")
    if ns.bench_command == "run":
        check_url(ns.url)
    _check_out(ns.out)
    space, workload = build_workload(ns)
    opts = load_options(ns)
    workload_meta = {"kind": workload.kind, **workload.params, **_load_meta(opts)}
    if ns.bench_command == "run":
        from tierserve.bench.metrics import summarize

        if ns.warmup_requests:
            warmup(ns.url, opts, cmp.warmup_prompts(space, ns.warmup_requests))
        result = run_load(ns.url, workload, opts)
        summary = summarize(result)
        _print_summary(ns.name, summary)
        if ns.out is not None:
            run_entry = {"name": ns.name, "description": ns.url, "summary": summary}
            report.write_run_json(ns.out / "runs" / f"{ns.name}.json", run_entry, result)
            meta = {
                "title": f"{workload.kind} against {ns.url}",
                "command": _command(),
                "workload": workload_meta,
                "machine": report.machine_info(),
            }
            path = report.write_report(ns.out, [run_entry], json.loads(json.dumps(meta)))
            print(f"report: {path}")
        return 0 if summary["completed"] else 1

    from tierserve.args import default_model

    model = ns.model or default_model()
    if model is None:
        raise TierserveError("no --model given and no bundled demo model", "model")
    names = [n.strip() for n in ns.configs.split(",") if n.strip()]
    if not names:
        raise TierserveError("--configs names no configuration", "configs")
    sizing = cmp.size_pools(
        workload, ns.page_size, ns.device_tokens, ns.device_fraction, ns.hicache_ratio
    )
    configs = cmp.configurations(sizing, names, store_extra=_store_extra(ns.store_extra_config))
    meta = {
        "title": ns.title or f"{workload.kind}, {', '.join(names)}",
        "note": ns.note,
        "command": _command(),
        "workload": workload_meta,
        "sizing": sizing.describe(),
    }
    path = cmp.compare(
        model,
        workload,
        opts,
        configs,
        ns.out,
        space,
        server_args=_split_server_args(ns.server_args),
        meta=meta,
        repeats=ns.repeats,
        warmup_requests=ns.warmup_requests,
    )
    print(f"report: {path}")
    return 0


def _split_server_args(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as err:  # an unclosed quote
        raise TierserveError(f"--server-args {text!r}: {err}", "server_args") from None


def _load_meta(opts: Any) -> dict[str, Any]:
    return {
        "backend": opts.backend,
        "max_in_flight": opts.max_in_flight or "unbounded",
        "request_rate": "inf" if math.isinf(opts.request_rate) else opts.request_rate,
        "round_barrier": opts.round_barrier,
        "ready_queue_policy": opts.queue_policy,
    }
