"""Linear weights reordered for oneDNN on CPU (layers/cpu_linear.py): each kind of parallel
linear computes what F.linear computes on its dense weight, the dense copy is gone, a head tied
to the embedding gets its own copy that the plan counts, MLA's kv_b_proj stays dense, and
float32 stays dense on an Intel CPU, where F.linear's MKL sgemm is the faster one."""

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
from tierserve.layers.cpu_linear import onednn_dtypes, packed_dtypes, packs_linears

DEMO = Path(__file__).resolve().parent.parent / "tierserve" / "demo_model"

pytestmark = pytest.mark.skipif(not onednn_dtypes(), reason="torch built without oneDNN")
BOTH = (torch.float32, torch.bfloat16)


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
        pack_for_cpu(mods, BOTH)  # both, whatever this CPU's loader picks
        got = {name: m(x) for name, m in mods.items()}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, m in mods.items():
        assert m.weight.is_mkldnn, name  # reordered, the dense copy released
        torch.testing.assert_close(got[name], want[name], atol=tol * 48, rtol=tol)
    pack_for_cpu(mods, BOTH)  # a second call leaves reordered weights as they are
    assert all(m.weight.is_mkldnn for m in mods.values())


@pytest.mark.parametrize(
    ("vendor", "mkl", "want"),
    [
        ("GenuineIntel", True, (torch.bfloat16,)),  # F.linear's float32 is Intel's own sgemm
        ("GenuineIntel", False, BOTH),  # no MKL: F.linear's float32 is no faster
        ("AuthenticAMD", True, BOTH),
        ("", True, BOTH),  # a vendor /proc/cpuinfo does not name
    ],
)
def test_float32_stays_dense_only_where_mkl_is_intels_own(monkeypatch, vendor, mkl, want):
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert packed_dtypes(vendor) == want


def test_the_loader_reorders_the_dtypes_this_cpu_picks_and_the_plan_counts_the_head():
    llm = LLM(str(DEMO), max_total_tokens=256)  # float32
    model = llm.engine.runner.model
    packed = packs_linears(torch.device("cpu"), torch.float32)
    linears = [m for m in model.modules() if isinstance(m, RowParallelLinear | ParallelLMHead)]
    assert linears and all(m.weight.is_mkldnn == packed for m in linears)
    embed = model.model.embed_tokens.weight
    checkpoint = sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight")
    head_copy = embed.numel() if packed else 0  # a dense head is the embedding itself
    assert llm.engine.startup.weight_bytes == (checkpoint + head_copy) * 4


def test_a_tied_head_gets_its_own_copy_and_the_plan_counts_it():
    llm = LLM(str(DEMO), max_total_tokens=256, dtype="bfloat16")  # reordered on every CPU
    model = llm.engine.runner.model
    assert model.lm_head.weight.is_mkldnn
    embed = model.model.embed_tokens.weight
    assert not embed.is_mkldnn  # lookups read its rows
    torch.testing.assert_close(model.lm_head.weight.to_dense(), embed, rtol=0, atol=0)
    checkpoint = sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight")
    assert llm.engine.startup.weight_bytes == (checkpoint + embed.numel()) * 2


def test_mla_keeps_kv_b_proj_dense_for_its_absorbed_decode(checkpoints):
    llm = LLM(str(checkpoints["deepseek-v3"]), max_total_tokens=256, dtype="bfloat16")
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert not attn.kv_b_proj.weight.is_mkldnn  # folded into queries and outputs as a tensor
    assert attn.o_proj.weight.is_mkldnn and attn.fused_qkv_a_proj_with_mqa.weight.is_mkldnn
