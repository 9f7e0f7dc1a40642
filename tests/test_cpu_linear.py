"""Linear weights reordered for oneDNN on CPU (layers/cpu_linear.py): each kind of parallel
linear computes what F.linear computes on its dense weight, the dense copy is gone, a head tied
to the embedding gets its own copy that the plan counts, MLA's kv_b_proj stays dense,
float32 stays dense on an Intel CPU, where F.linear's MKL sgemm is the faster one, and bf16 stays
dense where oneDNN has no bf16 GEMM (AVX2-only CPUs)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierserve import LLM
from tierserve.engine.startup import resolve_dtype
from tierserve.layers import (
    ColumnParallelLinear,
    PackedColumnLinear,
    ParallelLMHead,
    RowParallelLinear,
    cpu_linear,
    pack_for_cpu,
)
from tierserve.layers.cpu_linear import (
    PRIMITIVE_CACHE_VARS,
    cpu_vendor,
    onednn_dtypes,
    packed_dtypes,
    packs_linears,
)
from tierserve.model_config import ModelConfig

DEMO = Path(__file__).resolve().parent.parent / "tierserve" / "demo_model"

pytestmark = pytest.mark.skipif(not onednn_dtypes(), reason="torch built without oneDNN")
BOTH = (torch.float32, torch.bfloat16)
NO_BF16 = "this CPU's oneDNN has no bf16 GEMM (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"


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
    if dtype not in onednn_dtypes():
        pytest.skip(NO_BF16)
    mods = _linears().to(dtype)
    x = torch.randn(rows, 48).to(dtype)
    want = {
        name: F.linear(x, m.weight, m.bias).split(m.sizes, -1)
        if isinstance(m, PackedColumnLinear)
        else F.linear(x, m.weight, m.bias)
        for name, m in mods.items()
    }
    with torch.no_grad():
        pack_for_cpu(mods, onednn_dtypes())  # whatever this CPU's loader picks
        got = {name: m(x) for name, m in mods.items()}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, m in mods.items():
        assert m.weight.is_mkldnn, name  # reordered, the dense copy released
        torch.testing.assert_close(got[name], want[name], atol=tol * 48, rtol=tol)
    pack_for_cpu(mods, onednn_dtypes())  # a second call leaves reordered weights as they are
    assert all(m.weight.is_mkldnn for m in mods.values())


@pytest.mark.parametrize(
    ("vendor", "mkl", "bf16", "want"),
    [
        ("GenuineIntel", True, True, (torch.bfloat16,)),  # float32: Intel's own sgemm
        ("GenuineIntel", False, True, BOTH),  # no MKL: F.linear's float32 is no faster
        ("AuthenticAMD", True, True, BOTH),
        ("", True, True, BOTH),  # a vendor /proc/cpuinfo does not name
        ("AuthenticAMD", True, False, (torch.float32,)),  # AVX2 only: oneDNN refuses bf16
        ("GenuineIntel", True, False, ()),
    ],
)
def test_float32_stays_dense_where_mkl_is_intels_own_and_bf16_where_onednn_has_none(
    monkeypatch, vendor, mkl, bf16, want
):
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    monkeypatch.setattr(cpu_linear, "onednn_has_bf16", lambda: bf16)
    assert packed_dtypes(vendor) == want


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_asked_for_on_a_cpu_without_onednns_bf16_gemm_is_served_with_a_warning(
    monkeypatch, caplog, bf16
):
    monkeypatch.setattr(cpu_linear, "onednn_has_bf16", lambda: bf16)
    cfg = ModelConfig.from_dir(DEMO)
    with caplog.at_level(logging.WARNING, logger="tierserve"):
        assert resolve_dtype("bfloat16", cfg, torch.device("cpu")) == torch.bfloat16
        assert resolve_dtype("float32", cfg, torch.device("cpu")) == torch.float32
    said = [r.getMessage() for r in caplog.records if "bf16 GEMM" in r.getMessage()]
    assert len(said) == (0 if bf16 else 1)
    assert not said or "--dtype float32" in said[0]


def _flag(dtype: torch.dtype) -> str:
    """`dtype` as --dtype names it."""
    return str(dtype).removeprefix("torch.")


def _a_packed_dtype() -> torch.dtype:
    """A dtype whose linears this CPU reorders (bf16 where it can)."""
    picked = packed_dtypes(cpu_vendor())
    if not picked:
        pytest.skip("this CPU reorders no linear (float32 is MKL's, and oneDNN has no bf16)")
    return picked[-1]


@pytest.mark.parametrize("dtype", BOTH)
def test_the_loader_reorders_the_dtypes_this_cpu_picks_and_the_plan_counts_the_head(dtype):
    # bf16 loads on every CPU: where oneDNN has no bf16 GEMM its linears stay dense
    llm = LLM(str(DEMO), max_total_tokens=256, dtype=_flag(dtype))
    model = llm.engine.runner.model
    packed = packs_linears(torch.device("cpu"), dtype)
    linears = [m for m in model.modules() if isinstance(m, RowParallelLinear | ParallelLMHead)]
    assert linears and all(m.weight.is_mkldnn == packed for m in linears)
    embed = model.model.embed_tokens.weight
    checkpoint = sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight")
    head_copy = embed.numel() if packed else 0  # a dense head is the embedding itself
    assert llm.engine.startup.weight_bytes == (checkpoint + head_copy) * dtype.itemsize


def test_a_tied_head_gets_its_own_copy_and_the_plan_counts_it():
    dtype = _a_packed_dtype()
    llm = LLM(str(DEMO), max_total_tokens=256, dtype=_flag(dtype))
    model = llm.engine.runner.model
    assert model.lm_head.weight.is_mkldnn
    embed = model.model.embed_tokens.weight
    assert not embed.is_mkldnn  # lookups read its rows
    torch.testing.assert_close(model.lm_head.weight.to_dense(), embed, rtol=0, atol=0)
    checkpoint = sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight")
    assert llm.engine.startup.weight_bytes == (checkpoint + embed.numel()) * dtype.itemsize


def test_mla_keeps_kv_b_proj_dense_for_its_absorbed_decode(checkpoints):
    llm = LLM(str(checkpoints["deepseek-v3"]), max_total_tokens=256, dtype=_flag(_a_packed_dtype()))
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert not attn.kv_b_proj.weight.is_mkldnn  # folded into queries and outputs as a tensor
    assert attn.o_proj.weight.is_mkldnn and attn.fused_qkv_a_proj_with_mqa.weight.is_mkldnn


BOUNDS = """
import os
from tierserve import LLM
LLM(max_total_tokens=512)
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"])
"""


def test_an_engine_bounds_onednns_primitive_caches_and_a_users_bound_wins():
    """Unbounded (1,024 primitives each, one per row count and shape) they grew an engine by
    1.9 GB on the demo model (benchmarks/primitive_cache.py); each reads its variable at its
    first primitive, which the loader's reorders make, after the bound is set."""
    env = {k: v for k, v in os.environ.items() if k not in PRIMITIVE_CACHE_VARS}
    for given, want in (({}, "256 256"), ({"LRU_CACHE_CAPACITY": "64"}, "256 64")):
        done = subprocess.run([sys.executable, "-c", BOUNDS], env={**env, **given},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split("\n")[-2] == want
