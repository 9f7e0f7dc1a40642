"""int4 weights against dense on this CPU: decode throughput, and the memory a load takes.

    .venv/bin/python benchmarks/quantized.py [--rounds 3] [--hidden 1024] [--layers 15]
        [--vocab 4096]

A random-init Llama-shaped model of ~236 M parameters (weight-bound at one request) is written
in bf16 (its vocabulary the bundled tokenizer's 4,096 ids, as Kimi-K2.5's 164 K-row head is
0.1% of its weights; `--vocab 32000` makes the dense head 13% of them), and again as
compressed-tensors int4 g32 (symmetric; every linear but the LM head, by compressed-tensors'
own compressor). In alternating rounds, each in a fresh process, the
offline `LLM` generates 128 greedy tokens (EOS ignored) for 1, 8 and 64 requests of 32-token
prompts after a warm-up: int4 (bf16 activations into torch's int4 CPU kernel), bf16 dense and
float32 dense. Output tokens/s, medians of the rounds; the ratios are medians of the rounds'
ratios.

Memory: the int4 model loaded alone in a fresh process that samples its anonymous resident
memory (RssAnon: the checkpoint's mmapped pages are page cache) every 2 ms; the peak's growth
against what the backend reports holding (the loaded modules' buffers and parameters) and
against the start-up plan's `weights per rank` (what the table and `--dry-run` print).

Writes benchmarks/results/quantized/report.md and run.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omp_wait import cpu_model  # beside this script: on sys.path
from safetensors.torch import load_file

from tierserve.args import default_model

OUT = Path(__file__).parent / "results" / "quantized"
BATCHES = (1, 8, 64)

DECODE = """
import json, sys, time
from tierserve import LLM, SamplingParams
path, dtype = sys.argv[1], sys.argv[2]
llm = LLM(path, dtype=dtype, max_total_tokens=16384)
params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
out = {}
for n in (1, 8, 64):
    prompts = [[(7 * i + 13 * j) % 4000 + 3 for j in range(32)] for i in range(n)]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0))  # warm-up at this size
    llm.engine.flush_cache()
    start = time.perf_counter()
    done = llm.generate(prompts, params)
    out[n] = sum(len(o.token_ids) for o in done) / (time.perf_counter() - start)
print(json.dumps(out))
"""

MEMORY = """
import json, sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from peak_rss import PeakRss, rss_anon
from tierserve.engine import Startup
from tierserve.args import EngineArgs
from tierserve.model_config import ModelConfig
from tierserve.models.loader import load_model
from tierserve.layers import QuantizedWeight
path = Path(sys.argv[1])
cfg = ModelConfig.from_dir(path)
planned = Startup.from_args(EngineArgs(model=str(path), dtype="bfloat16")).plan
before, watch = rss_anon(), PeakRss()
model = load_model(path, cfg, torch.bfloat16, torch.device("cpu"))
peak, after = watch.stop(), rss_anon()
held = sum(p.numel() * p.element_size() for p in model.parameters())
held += sum(m.held_bytes() for m in model.modules() if isinstance(m, QuantizedWeight))
print(json.dumps({"before": before, "peak": peak, "after": after, "held": held,
                  "planned": planned.weight_bytes_per_rank}))
"""


def make_models(root: Path, hidden: int, layers: int, vocab: int) -> dict[str, Path]:
    import torch
    import transformers

    from tierserve.bench.compress import compress

    dense = root / "bf16"
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
        max_position_embeddings=4096, torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(dense)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # its ids fit the embedding
        shutil.copy(Path(default_model()) / name, dense / name)
    return {"bf16": dense, "int4": compress(dense, root / "int4", 4, 32, True)}


def run(code: str, *argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=4096)
    ns = ap.parse_args()
    configs = {"int4 g32": ("int4", "bfloat16"), "bf16 dense": ("bf16", "bfloat16"),
               "float32 dense": ("bf16", "float32")}  # fmt: skip
    rows: dict[str, dict[int, list[float]]] = {c: {n: [] for n in BATCHES} for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        models = make_models(Path(tmp), ns.hidden, ns.layers, ns.vocab)
        weights = load_file(str(models["bf16"] / "model.safetensors"))
        params = sum(t.numel() for t in weights.values())
        del weights
        memory = run(MEMORY, str(models["int4"]), str(Path(__file__).parent))
        for r in range(ns.rounds):
            order = list(configs) if r % 2 == 0 else list(configs)[::-1]
            for name in order:
                model, dtype = configs[name]
                got = run(DECODE, str(models[model]), dtype)
                for n in BATCHES:
                    rows[name][n].append(got[str(n)])
                print(f"round {r + 1} {name}: " + ", ".join(
                    f"{n}: {got[str(n)]:.1f}" for n in BATCHES), flush=True)  # fmt: skip
    write_report(ns, rows, memory, params)


def write_report(ns, rows, memory, params) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    kept = {"args": vars(ns), "rows": rows, "memory": memory, "params": params}
    (OUT / "run.json").write_text(json.dumps(kept, indent=1))
    med = statistics.median
    base = rows["bf16 dense"]
    lines = [
        "# int4 weights against dense on this CPU",
        "",
        f"`.venv/bin/python benchmarks/quantized.py --rounds {ns.rounds} --hidden {ns.hidden} "
        f"--layers {ns.layers} --vocab {ns.vocab}` on {cpu_model()}, {os.cpu_count()} cores; "
        "a random-init Llama of "
        f"{params / 1e6:.0f} M parameters; output tokens/s of the offline `LLM`, 128 greedy "
        "tokens a request, medians of alternating rounds (fresh process each).",
        "",
        "| weights | "
        + " | ".join(f"{n} request{'s' * (n > 1)}, tok/s (vs bf16)" for n in BATCHES)
        + " |",
        "|---|" + "---|" * len(BATCHES),
    ]
    for name, by_n in rows.items():
        cells = []
        for n in BATCHES:
            ratio = med([a / b for a, b in zip(by_n[n], base[n], strict=True)])
            cells.append(f"{med(by_n[n]):.1f} ({ratio:.2f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    peak, settled = memory["peak"] - memory["before"], memory["after"] - memory["before"]
    held = memory["held"]
    lines += [
        "",
        f"Load of the int4 model (bf16): RssAnon grew {settled / 1e6:.1f} MB = "
        f"{settled / held:.3f}x the {held / 1e6:.1f} MB the loaded model holds (its peak during "
        f"the load {peak / 1e6:.1f} MB = {peak / held:.3f}x); the plan's `weights per rank` "
        f"{memory['planned'] / 1e6:.1f} MB = {memory['planned'] / held:.3f}x it.",
    ]
    (OUT / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
