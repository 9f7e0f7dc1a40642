"""Built-in models and GPUs for `tierserve plan`, so a plan needs no hub access.

Model presets embed the config.json values that sizing needs, copied from the published
checkpoints (architecture numbers are facts, not code), plus the published parameter count and the
checkpoint's weight dtype for the weight size. GPU sizes are what `nvidia-smi` reports as total
memory (MiB), because SGLang's and vLLM's memory fractions apply to that figure, not to the
marketing capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierserve.errors import TierserveError
from tierserve.utils import MiB


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hf_id: str
    config: dict[str, Any]  # the config.json keys that sizing reads, HF spelling
    num_parameters: int  # published total; MoE counts every expert (all are resident)


@dataclass(frozen=True)
class GpuPreset:
    name: str
    memory_bytes: int
    description: str


def _dense(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, **extra: Any):
    return {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **extra,
    }


# DeepSeek-V3 architecture (MLA + MoE); Kimi-K2 reuses it with 64 heads and 384 experts.
_DEEPSEEK_V3 = {
    **_dense(61, 7168, 18432, 128, 128, 129280, max_position_embeddings=163840),
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "num_nextn_predict_layers": 1,  # MTP layer: loaded only for speculative decoding
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}
_KIMI_K2 = {
    **_DEEPSEEK_V3,
    "model_type": "kimi_k2",
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "vocab_size": 163840,
    "max_position_embeddings": 131072,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "rope_theta": 50000.0,
    "rope_scaling": {**_DEEPSEEK_V3["rope_scaling"], "factor": 32.0, "beta_fast": 1.0},
    "num_nextn_predict_layers": 0,
}
# Kimi-K2.5 is multimodal: its language model nests under text_config (the vision tower's
# ~0.4B parameters are left out) and its routed experts are int4 in groups of 32.
_KIMI_K2_5 = {
    "model_type": "kimi_k25",
    "text_config": {
        **_KIMI_K2,
        "max_position_embeddings": 262144,
        "rope_scaling": {**_KIMI_K2["rope_scaling"], "factor": 64.0},
        # As Kimi-K2-Thinking's config.json writes it (K2.5 adds its vision tower and
        # projector to `ignore`): routed experts int4 g32, everything else dense.
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "format": "pack-quantized",
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": 32,
                    },
                }
            },
            "ignore": [
                "lm_head",
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            ],
        },
    },
}
_QWEN3 = {"model_type": "qwen3", "head_dim": 128, "max_position_embeddings": 40960}

MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "llama-3-8b",
            "meta-llama/Meta-Llama-3-8B",
            _dense(
                32, 4096, 14336, 32, 8, 128256, model_type="llama", max_position_embeddings=8192
            ),
            8_030_261_248,
        ),
        ModelPreset(
            "llama-3-70b",
            "meta-llama/Meta-Llama-3-70B",
            _dense(
                80, 8192, 28672, 64, 8, 128256, model_type="llama", max_position_embeddings=8192
            ),
            70_553_706_496,
        ),
        ModelPreset(
            "qwen2.5-7b",
            "Qwen/Qwen2.5-7B-Instruct",
            _dense(
                28, 3584, 18944, 28, 4, 152064, model_type="qwen2", max_position_embeddings=32768
            ),
            7_615_616_512,
        ),
        ModelPreset(
            "qwen2.5-72b",
            "Qwen/Qwen2.5-72B-Instruct",
            _dense(
                80, 8192, 29568, 64, 8, 152064, model_type="qwen2", max_position_embeddings=32768
            ),
            72_706_203_648,
        ),
        ModelPreset(
            "qwen3-8b",
            "Qwen/Qwen3-8B",
            _dense(36, 4096, 12288, 32, 8, 151936, **_QWEN3),
            8_190_735_360,
        ),
        ModelPreset(
            "qwen3-32b",
            "Qwen/Qwen3-32B",
            _dense(64, 5120, 25600, 64, 8, 151936, **_QWEN3),
            32_762_123_264,
        ),
        ModelPreset(
            "qwen3-235b-a22b",
            "Qwen/Qwen3-235B-A22B",
            _dense(
                94,
                4096,
                12288,
                64,
                4,
                151936,
                **{**_QWEN3, "model_type": "qwen3_moe"},
                moe_intermediate_size=1536,
                num_experts=128,
                num_experts_per_tok=8,
            ),
            235_093_634_560,
        ),
        # 671B without the 14B MTP module that the HF checkpoint also ships.
        ModelPreset("deepseek-v3", "deepseek-ai/DeepSeek-V3", _DEEPSEEK_V3, 671 * 10**9),
        ModelPreset("deepseek-r1", "deepseek-ai/DeepSeek-R1", _DEEPSEEK_V3, 671 * 10**9),
        # Announced as "1T total, 32B active"; the checkpoint holds ~1.03T.
        ModelPreset("kimi-k2", "moonshotai/Kimi-K2-Instruct", _KIMI_K2, 1_026 * 10**9),
        # The seed's model: Kimi-K2's language model, experts in int4 (QAT), the rest bf16.
        ModelPreset("kimi-k2.5", "moonshotai/Kimi-K2.5", _KIMI_K2_5, 1_026 * 10**9),
        ModelPreset(
            "mistral-7b",
            "mistralai/Mistral-7B-Instruct-v0.3",
            _dense(
                32, 4096, 14336, 32, 8, 32768, model_type="mistral", max_position_embeddings=32768
            ),
            7_248_023_552,
        ),
    )
}

GPU_PRESETS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("h100-80gb", 81_559 * MiB, "NVIDIA H100 80GB (SXM or PCIe)"),
        GpuPreset("h200", 143_771 * MiB, "NVIDIA H200 141GB"),
        GpuPreset("b200", 183_359 * MiB, "NVIDIA B200 180GB"),
        GpuPreset("a100-80gb", 81_920 * MiB, "NVIDIA A100 80GB"),
        GpuPreset("a100-40gb", 40_960 * MiB, "NVIDIA A100 40GB"),
        GpuPreset("l40s", 46_068 * MiB, "NVIDIA L40S 48GB"),
        GpuPreset("rtx-pro-6000", 97_887 * MiB, "NVIDIA RTX PRO 6000 Blackwell 96GB"),
        GpuPreset("rtx-4090", 24_564 * MiB, "NVIDIA GeForce RTX 4090 24GB"),
    )
}
_GPU_ALIASES = {"h100": "h100-80gb", "a100": "a100-80gb", "rtx-pro-6000-blackwell": "rtx-pro-6000"}


def find_model_preset(name: str) -> ModelPreset | None:
    """The preset a name means: its own name, its Hugging Face id (`moonshotai/Kimi-K2-Instruct`,
    as the planner's launch lines print it), or that id's last part (a download directory's
    usual name); any case."""
    key = name.strip().rstrip("/").lower()
    for preset in MODEL_PRESETS.values():
        hf = preset.hf_id.lower()
        if key in (preset.name, hf, hf.rsplit("/", 1)[-1]) or key.endswith("/" + hf):
            return preset
    return None


def model_preset(name: str) -> ModelPreset:
    preset = find_model_preset(name)
    if preset is None:
        known = ", ".join(MODEL_PRESETS)
        raise TierserveError(f"unknown model preset {name!r}; known: {known}", field="model")
    return preset


def gpu_preset(name: str) -> GpuPreset | None:
    """The preset called `name` (or an alias), None when it is not a preset name."""
    key = name.strip().lower()
    return GPU_PRESETS.get(_GPU_ALIASES.get(key, key))
