"""DeepSeek-V3 / V2 (MLA + MoE) through the engine: the pool holds one latent per token and
layer, decode attends in the latent space, and every cache path (prefix hits, the host tier,
chunked prefill, offload preemption) gives the outputs of a run without it.

Greedy equality with transformers and prefill logits are in test_models.py (the DeepSeek
families run beside the Llama ones); fp8 block-scaled checkpoints in test_models.py too, and
fp8 KV through every cache path in test_kv_dtype.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts
from tests.test_hicache import mixed_workload
from tests.test_models import hf_greedy
from tierserve import LLM, SamplingParams

V3 = "deepseek-v3"
COMMON = dict(page_size=16, max_total_tokens=480, chunked_prefill_size=64)


@pytest.mark.parametrize(("dtype", "width"), [("fp32", 4), ("bf16", 2), ("fp8_e4m3", 1)])
def test_every_tier_stores_one_latent_per_token_and_layer(checkpoints, dtype, width):
    llm = LLM(
        str(checkpoints[V3]),
        kv_cache_dtype=dtype,
        max_total_tokens=512,
        enable_hierarchical_cache=True,
        hicache_ratio=2,
    )
    cfg, spec, kv = llm.engine.model_config, llm.engine.kv_plan.spec, llm.engine.kv
    per_token = cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * width
    assert (spec.kind, spec.bytes_per_token) == ("latent", per_token)
    assert kv.pool.nbytes == kv.pool.num_slots * per_token
    assert kv.host.host_pool.nbytes == kv.host.host_pool.num_slots * per_token


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_decode_never_up_projects_cached_latents(checkpoints, backend):
    """kv_b_proj (the latent → per-head K/V up-projection) runs only on extend (prefill) rows'
    contexts (the CPU kernel's: spans past its query limit); a step of decode rows alone never
    calls it, and outputs equal transformers'."""
    path = checkpoints[V3]
    prompts = random_prompts(4, [5, 70, 140], seed=11)
    llm = LLM(str(path), max_total_tokens=2048, chunked_prefill_size=64, attention_backend=backend)
    engine, attn = llm.engine, llm.engine.runner.attn
    up_projected: list[int] = []
    for layer in engine.runner.model.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(
            lambda _m, args, _out: up_projected.append(len(args[0]))
        )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    outs: dict[str, list[int]] = {}
    decode_only_steps = 0
    while engine.has_unfinished():
        up_projected.clear()
        for step in engine.step():
            outs.setdefault(step.request_id, []).append(step.token_id)
        contexts = sum(s.kv_len for s in attn.extend)  # what the expanded form may up-project
        assert sum(up_projected) == contexts * engine.model_config.num_layers
        decoding = attn.num_decode if backend == "torch" else len(attn.short)
        decode_only_steps += not attn.extend and decoding > 0
    assert decode_only_steps > 0
    got = [outs[f"req-{i}"] for i in range(len(prompts))]
    assert got == hf_greedy(path, prompts, 12)


@pytest.mark.parametrize("family", [V3, "deepseek-v2"])
def test_radix_host_tier_and_chunked_prefill_give_the_uncached_outputs(checkpoints, family):
    path = str(checkpoints[family])
    reference = mixed_workload(LLM(path, disable_radix_cache=True, **COMMON))
    llm = LLM(path, enable_hierarchical_cache=True, hicache_ratio=8, **COMMON)
    assert mixed_workload(llm) == reference
    stats = llm.engine.kv.host.stats
    assert stats.host_hit_tokens > 0 and stats.load_backs > 0
    assert llm.engine.scheduler.stats.num_cached_tokens > 0
    llm.engine.check_accounting()


def test_offload_preemption_resumes_with_the_same_outputs(checkpoints):
    path = str(checkpoints[V3])
    prompts = random_prompts(10, [60, 140, 90, 200, 30], seed=60)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = LLM(path, **{**COMMON, "max_total_tokens": 8192})
    tight = dict(COMMON, max_total_tokens=640)
    offload = LLM(path, enable_hierarchical_cache=True, hicache_ratio=4, **tight)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in offload.generate(prompts, params)] == expected
    assert offload.engine.scheduler.stats.num_offload_preemptions > 0
    offload.engine.check_accounting()


def test_the_router_stays_in_float32_in_a_bf16_model(checkpoints):
    """As transformers keeps it: the biased scores choose the experts."""
    llm = LLM(str(checkpoints[V3]), dtype="bfloat16", max_total_tokens=256)
    gate = llm.engine.runner.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert llm.engine.runner.model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_a_kimi_k25_style_checkpoint_serves_its_text_model(checkpoints, tmp_path):
    """config.json nests the text model under text_config (no architecture of its own, only
    model_type kimi_k2), tensors carry a language_model. prefix, and a vision tower sits
    beside them: the text model loads and generates what the plain checkpoint does."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source, nested = checkpoints[V3], tmp_path / "kimi-k2.5"
    shutil.copytree(source, nested)
    state = load_file(str(source / "model.safetensors"))
    state = {f"language_model.{k}": v for k, v in state.items()}
    state["vision_tower.patch_embed.weight"] = torch.randn(8, 3)
    save_file(state, str(nested / "model.safetensors"))
    text = json.loads((source / "config.json").read_text())
    del text["architectures"]
    text["model_type"] = "kimi_k2"
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": text}
    (nested / "config.json").write_text(json.dumps(config))

    prompts = random_prompts(3, [7, 90], seed=12)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain, kimi = LLM(str(source)), LLM(str(nested))
    assert kimi.engine.model_config.architecture == "DeepseekV3ForCausalLM"
    assert [o.token_ids for o in kimi.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]
    assert kimi.engine.startup.weight_bytes == plain.engine.startup.weight_bytes


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"v_head_dim": None}, "v_head_dim"),
        ({"scoring_func": "softmax"}, "topk_method"),  # V3's noaux_tc needs sigmoid scores
        ({"topk_method": "aux_free"}, "topk_method"),
        ({"n_group": 7}, "n_group"),  # 256 experts do not split into 7 groups
        ({"num_experts_per_tok": 200, "topk_group": 1}, "n_group"),  # more than one group holds
    ],
)
def test_a_config_the_model_cannot_run_is_refused_naming_the_field(change, field):
    from tierserve import TierserveError
    from tierserve.model_config import ModelConfig
    from tierserve.plan.presets import model_preset

    config = {**model_preset("deepseek-v3").config, **change}
    with pytest.raises(TierserveError) as err:
        ModelConfig.from_dict({k: v for k, v in config.items() if v is not None})
    assert err.value.field == field
