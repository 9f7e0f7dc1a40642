"""Peak memory while loading weights, ÷ the checkpoint's bytes: tierserve's tensor-by-tensor
loader beside loading whole shards into a state dict first (what it did before), one run.

A random-init Llama checkpoint of about 0.5 GB (float32) is written to a temporary directory,
then again with fp8 block-scaled linear weights as DeepSeek-V3 stores them (the old way has to
dequantize the whole state dict before loading it);
each method loads it in a fresh subprocess that samples its anonymous resident memory every 2 ms
(RssAnon: the checkpoint's mmapped pages are page cache and not counted) and reports the peak's
growth over the start. 1.0× is the model itself; the old way held the model and a full copy.

    .venv/bin/python benchmarks/load_memory.py [--hidden 768] [--layers 8] [--arch deepseek-v3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = """
import json, sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from peak_rss import PeakRss, rss_anon as rss
from tierserve.model_config import ModelConfig
from tierserve.models.loader import load_model, weight_files
path, how = Path(sys.argv[1]), sys.argv[2]
cfg = ModelConfig.from_dir(path)
watch = PeakRss()
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
print(json.dumps({"before": before, "peak": watch.stop()}))
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


def make_checkpoint(path: Path, hidden: int, layers: int, arch: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=32000,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 256,
        )
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
        return
    # DeepSeek-V3's shape at small width: MLA, a dense first layer, then 32 experts a layer,
    # saved one tensor per expert (the loader stacks them).
    cfg = transformers.DeepseekV3Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 4,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
    )
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)


def model_bytes(path: Path) -> int:
    """The float32 model's bytes: what the loader's parameters take."""
    from tierserve.model_config import ModelConfig
    from tierserve.models import checkpoint_numel

    return 4 * checkpoint_numel(path, ModelConfig.from_dir(path).num_layers)


def measure(path: Path, how: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path), how, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--arch", choices=["llama", "deepseek-v3"], default="llama")
    args = parser.parse_args()
    # The old way loaded names as they are: it never loaded per-expert DeepSeek checkpoints.
    ways = ("tierserve", "state_dict") if args.arch == "llama" else ("tierserve",)
    for fp8 in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            make_checkpoint(Path(tmp), args.hidden, args.layers, args.arch)
            if fp8:
                to_fp8(Path(tmp))
            size = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
            model = model_bytes(Path(tmp))
            rows = {how: measure(Path(tmp), how) for how in ways}
        kind = "fp8 block-scaled checkpoint" if fp8 else "float32 checkpoint"
        print(f"{args.arch}, {kind} of {size / 1e9:.3f} GB; model {model / 1e9:.3f} GB in float32")
        grown = {how: r["peak"] - r["before"] for how, r in rows.items()}
        for how, g in grown.items():
            print(
                f"  {how:<11} peak growth {g / 1e9:6.3f} GB = {g / model:4.2f}× the model "
                f"= {g / size:4.2f}× the checkpoint"
            )
        if len(grown) == 2:
            ratio = grown["tierserve"] / grown["state_dict"]
            print(f"  tierserve / state dict first: {ratio:.2f}×")


if __name__ == "__main__":
    main()
