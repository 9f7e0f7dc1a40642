"""The MoE layer against transformers' DeepSeek-V3 and V2 modules on the same random weights:
every parameter and buffer randomised (transformers starts e_score_correction_bias at zero,
which would hide a router that ignores it), grouped routing, shared experts, scaling."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from tests.conftest import randomise_all
from tierserve.layers.moe import MoE, MoEConfig

COMMON = dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16)


@pytest.mark.parametrize(
    ("n_group", "topk_group", "norm", "scale", "shared"),
    [(4, 2, True, 2.5, 1), (1, 1, False, 1.0, 2), (8, 3, True, 1.0, 0)],
)
def test_v3_routing_matches_transformers(n_group, topk_group, norm, scale, shared):
    config = transformers.DeepseekV3Config(
        **COMMON,
        num_experts_per_tok=4,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
        n_shared_experts=max(shared, 1),
    )
    ref = v3.DeepseekV3MoE(config).eval()
    randomise_all(ref, seed=n_group, scale=0.3)
    ours = MoE(
        MoEConfig(
            32, 16, 16, 4, max(shared, 1), "sigmoid", "noaux_tc", n_group, topk_group, norm, scale
        )
    )
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert ours.gate.e_score_correction_bias.abs().sum() > 0  # the bias takes part
    x = torch.randn(1, 57, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), ref(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_matches_transformers(method):
    config = transformers.DeepseekV2Config(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=1.5,
        n_shared_experts=2,
    )
    ref = v2.DeepseekV2Moe(config).eval()
    randomise_all(ref, seed=7, scale=0.3)
    ours = MoE(MoEConfig(32, 16, 16, 3, 2, "softmax", method, 4, 2, False, 1.5))
    ours.load_state_dict(ref.state_dict(), strict=True)  # V2 has no correction bias
    x = torch.randn(1, 41, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), ref(x)[0], atol=1e-5, rtol=1e-5)
