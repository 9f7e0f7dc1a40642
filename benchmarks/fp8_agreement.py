"""How closely fp8 KV follows full-precision KV: at every greedy step, given the same history,
how often the fp8 run picks the token the full-precision run picks.

Two models in one run: the trained demo model (Llama, K and V in fp8) and a random-init
DeepSeek-V3 of the same width (MLA: the latent in fp8). A random-init model's next-token
scores are nearly flat, so its figure says little about trained models; it is reported, not
judged. Prints both agreements and the KV bytes per token of each dtype.

    .venv/bin/python benchmarks/fp8_agreement.py [--steps 24] [--dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from tierserve import LLM
from tierserve.args import DEMO_MODEL_DIR
from tierserve.bench.agreement import PROMPTS, greedy_agreement


def random_deepseek_v3(out: Path, seed: int) -> Path:
    """A random-init DeepSeek-V3 (MLA, grouped routing, a dense first layer, yarn) with the
    demo model's tokenizer; every parameter and buffer drawn at transformers' init scale,
    e_score_correction_bias included (transformers starts it at zero)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            torch.nn.init.normal_(layer.mlp.gate.e_score_correction_bias, std=0.02)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, out / name)
    return out


def agreement(model: str, steps: int, dtype: str) -> tuple[float, int, int]:
    """(greedy agreement of fp8 KV with full precision, full-precision KV bytes/token, fp8 KV
    bytes/token)."""
    full = LLM(model, max_total_tokens=8192)
    fp8 = LLM(model, max_total_tokens=8192, kv_cache_dtype=dtype)
    share = greedy_agreement(full, fp8, PROMPTS, steps)
    widths = (full.engine.kv_plan.spec.bytes_per_token, fp8.engine.kv_plan.spec.bytes_per_token)
    return share, *widths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--dtype", default="fp8_e4m3", choices=["fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "demo (Llama, trained)": str(DEMO_MODEL_DIR),
            "DeepSeek-V3 (random init)": str(random_deepseek_v3(Path(tmp), ns.seed)),
        }
        print(f"{len(PROMPTS)} prompts × {ns.steps} greedy steps, KV {ns.dtype} vs float32")
        print(f"{'model':<28} {'agreement':>9} {'KV B/token':>11} {'fp8 B/token':>12}")
        for name, path in models.items():
            share, full_bytes, fp8_bytes = agreement(path, ns.steps, ns.dtype)
            print(f"{name:<28} {share:9.1%} {full_bytes:11,d} {fp8_bytes:12,d}")


if __name__ == "__main__":
    main()
