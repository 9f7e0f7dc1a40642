"""Linear weights reordered for oneDNN on CPU (layers/cpu_linear.py): each kind of parallel
linear computes what F.linear computes on its dense weight, the dense copy is gone, a head tied
to the embedding gets its own copy that the plan counts, and MLA's kv_b_proj stays dense."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierserve import LLM
from tierserve.layers import (
    ColumnParallelLinear,
    PackedColumnLinear,
    ParallelLMHead,
    RowParallelLinear,
    pack_for_cpu,
)
from tierserve.layers.cpu_linear import packs_linears

DEMO = Path(__file__).resolve().parent.parent / "tierserve" / "demo_model"

pytestmark = pytest.mark.skipif(
    not packs_linears(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)


def _linears() -> nn.ModuleDict:
    torch.manual_seed(0)
    mods = nn.ModuleDict(
        {
            "column": ColumnParallelLinear(48, 80, bias=True),
            "packed": PackedColumnLinear(48, [("a", 32, 1), ("b", 16, 1)], bias=True),
            "row": RowParallelLinear(48, 40, bias=True),
            "head": ParallelLMHead(48, 96),
        }
    )
    for p in mods.parameters():
        nn.init.normal_(p)
    return mods


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_each_parallel_linear_equals_f_linear_on_its_dense_weight(dtype, rows):
    mods = _linears().to(dtype)
    x = torch.randn(rows, 48).to(dtype)
    want = {
        name: F.linear(x, m.weight, m.bias).split(m.sizes, -1)
        if isinstance(m, PackedColumnLinear)
        else F.linear(x, m.weight, m.bias)
        for name, m in mods.items()
    }
    with torch.no_grad():
        pack_for_cpu(mods)
        got = {name: m(x) for name, m in mods.items()}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, m in mods.items():
        assert m.weight.is_mkldnn, name  # reordered, the dense copy released
        torch.testing.assert_close(got[name], want[name], atol=tol * 48, rtol=tol)
    pack_for_cpu(mods)  # a second call leaves reordered weights as they are
    assert all(m.weight.is_mkldnn for m in mods.values())


def test_a_tied_head_gets_its_own_copy_and_the_plan_counts_it():
    llm = LLM(str(DEMO), max_total_tokens=256)
    model = llm.engine.runner.model
    assert model.lm_head.weight.is_mkldnn
    embed = model.model.embed_tokens.weight
    assert not embed.is_mkldnn  # lookups read its rows
    torch.testing.assert_close(model.lm_head.weight.to_dense(), embed, rtol=0, atol=0)
    checkpoint = sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight")
    assert llm.engine.startup.weight_bytes == (checkpoint + embed.numel()) * 4


def test_mla_keeps_kv_b_proj_dense_for_its_absorbed_decode(checkpoints):
    llm = LLM(str(checkpoints["deepseek-v3"]), max_total_tokens=256)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert not attn.kv_b_proj.weight.is_mkldnn  # folded into queries and outputs as a tensor
    assert attn.o_proj.weight.is_mkldnn and attn.fused_qkv_a_proj_with_mqa.weight.is_mkldnn
