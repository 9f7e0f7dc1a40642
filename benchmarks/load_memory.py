"""Peak memory while loading weights, ÷ the checkpoint's bytes: tierserve's tensor-by-tensor
loader beside loading whole shards into a state dict first (what it did before), one run.

A random-init Llama checkpoint of about 0.5 GB (float32) is written to a temporary directory,
then again with fp8 block-scaled linear weights as DeepSeek-V3 stores them (the old way has to
dequantize the whole state dict before loading it);
each method loads it in a fresh subprocess that samples its anonymous resident memory every 2 ms
(RssAnon: the checkpoint's mmapped pages are page cache and not counted) and reports the peak's
growth over the start. 1.0× is the model itself; the old way held the model and a full copy.

    .venv/bin/python benchmarks/load_memory.py [--hidden 768] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = """
import json, sys, threading, time, torch
from pathlib import Path
from tierserve.config import ModelConfig
from tierserve.models.loader import load_model, weight_files
path, how = Path(sys.argv[1]), sys.argv[2]
cfg = ModelConfig.from_dir(path)
def rss():  # anonymous memory only: mmapped checkpoint pages are page cache, not the process's
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
top, done = [0], threading.Event()
def watch():
    while not done.is_set():
        top[0] = max(top[0], rss())
        time.sleep(0.002)
threading.Thread(target=watch, daemon=True).start()
if how == "state_dict":  # every shard in one dict (fp8: dequantized first), then copied in
    from safetensors.torch import load_file
    from tierserve.models.loader import dequantize
    from tierserve.models.registry import model_class
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    before = rss()
    model = model.to_empty(device="cpu")
    state = {}
    for f in weight_files(path):
        state.update(load_file(str(f)))
    for key in [k for k in state if k + "_scale_inv" in state]:
        state[key] = dequantize(state[key], state.pop(key + "_scale_inv"), (128, 128))
    model.load_state_dict(state, strict=False)
    del state
else:
    before = rss()
    model = load_model(path, cfg, torch.float32, torch.device("cpu"))
done.set()
print(json.dumps({"before": before, "peak": max(top[0], rss())}))
"""


def to_fp8(path: Path) -> None:
    """Rewrite the checkpoint with fp8 block-scaled linear weights, as DeepSeek-V3 ships."""
    import json

    from safetensors.torch import load_file, save_file

    from tierserve.models.loader import quantize_fp8_blocks

    file = path / "model.safetensors"
    state, out = load_file(str(file)), {}
    for name, w in state.items():
        if w.dim() == 2 and "proj" in name:
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(w, (128, 128))
        else:
            out[name] = w
    save_file(out, str(file))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))


def make_checkpoint(path: Path, hidden: int, layers: int) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def measure(path: Path, how: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), how], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    for fp8 in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            size = make_checkpoint(Path(tmp), args.hidden, args.layers)
            if fp8:
                to_fp8(Path(tmp))
            model_bytes = size  # the model is float32 either way
            rows = {how: measure(Path(tmp), how) for how in ("tierserve", "state_dict")}
        kind = "fp8 block-scaled checkpoint" if fp8 else "float32 checkpoint"
        print(f"{kind}; model {model_bytes / 1e9:.3f} GB in float32")
        grown = {how: r["peak"] - r["before"] for how, r in rows.items()}
        for how, g in grown.items():
            print(f"  {how:<11} peak growth {g / 1e9:6.3f} GB = {g / model_bytes:4.2f}× the model")
        print(f"  tierserve / state dict first: {grown['tierserve'] / grown['state_dict']:.2f}×")


if __name__ == "__main__":
    main()
