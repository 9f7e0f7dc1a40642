"""Multi-head latent attention against transformers' DeepSeek-V3 attention on the same random
weights (with and without q_lora_rank, with yarn's softmax scale), and the absorbed form (decode
in the latent space) equal to the expanded one without ever up-projecting the cached latents."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from tests.conftest import randomise_all
from tierserve.layers.mla import MLA, MLAConfig, softmax_scale

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def hf_attention(q_lora_rank: int | None, rope: dict | None, seed: int):
    config = transformers.DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=256,
        rope_parameters=rope,
        attn_implementation="eager",
    )
    attn = v3.DeepseekV3Attention(config, 0).eval()
    randomise_all(attn, seed)
    return config, attn


def ours_like(config, attn) -> MLA:
    cfg = MLAConfig(
        hidden_size=64,
        num_heads=4,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        scaling=softmax_scale(16 + 8, config.rope_parameters),
        rms_norm_eps=config.rms_norm_eps,
        interleave=config.rope_interleave,
    )
    mla = MLA(cfg).eval()
    mla.load_state_dict(attn.state_dict(), strict=True)
    return mla


@pytest.mark.parametrize(("q_lora_rank", "rope"), [(None, None), (24, None), (24, YARN)])
def test_prefill_matches_transformers(q_lora_rank, rope):
    config, attn = hf_attention(q_lora_rank, rope, seed=3)
    mla = ours_like(config, attn)
    n = 37
    x = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(4))
    cos, sin = v3.DeepseekV3RotaryEmbedding(config)(x, torch.arange(n)[None])
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = attn(x, (cos, sin), causal)
        ours = mla(x[0], cos[0], sin[0])
    torch.testing.assert_close(ours, ref[0], atol=1e-5, rtol=1e-5)
    if rope:  # yarn scales the softmax by mscale²: the test would not see a missing factor
        assert attn.scaling != (16 + 8) ** -0.5


def test_absorbed_decode_equals_expanded_and_never_up_projects_the_cache():
    config, attn = hf_attention(24, YARN, seed=5)
    mla = ours_like(config, attn)
    n = 50
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(6))
    cos, sin = v3.DeepseekV3RotaryEmbedding(config)(x[None], torch.arange(n)[None])
    cos, sin = cos[0], sin[0]
    with torch.no_grad():
        latent = mla.project(x, cos, sin)[2]  # what the pool holds: [tokens, rank + rope]
        q_nope, q_rope, _ = mla.project(x[-3:], cos[-3:], sin[-3:])  # three decode-like queries
        calls = []
        hook = mla.kv_b_proj.register_forward_hook(lambda *a: calls.append(a[1][0].shape))
        expanded = mla.attend_expanded(q_nope, q_rope, latent, None)
        assert calls == [(n, 32)]  # the expanded form up-projects every cached latent
        absorbed = mla.attend_absorbed(q_nope, q_rope, latent, None)
        hook.remove()
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
    assert calls == [(n, 32)]  # the absorbed one never applies kv_b_proj to them
    assert latent.shape == (n, 32 + 8)


@pytest.mark.parametrize("rope", [None, YARN, {**YARN, "mscale": 0.7, "beta_fast": 16}])
def test_rotary_tables_match_transformers_including_yarn(rope):
    """cos/sin as transformers' DeepSeek-V3 rotary makes them: YaRN's ramp over dimensions and
    its magnitude correction (mscale / mscale_all_dim)."""
    from tierserve.layers.rotary import RotaryEmbedding

    config, _ = hf_attention(24, rope, seed=1)
    n = 200
    ref_cos, ref_sin = v3.DeepseekV3RotaryEmbedding(config)(
        torch.zeros(1, dtype=torch.float32), torch.arange(n)[None]
    )
    ours = RotaryEmbedding(8, 256, 10000.0, rope)
    half = 4
    torch.testing.assert_close(ours.cos[:n], ref_cos[0, :, :half], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ours.sin[:n], ref_sin[0, :, :half], atol=2e-6, rtol=1e-5)
