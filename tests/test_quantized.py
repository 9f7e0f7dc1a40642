"""Quantized checkpoints served quantized (layers/quantized.py, models/quantization.py):
compressed-tensors' pack-quantized int4 / int8 made here by the format's own compressor,
greedy tokens against transformers' dequantized model in float32, the kernels against the
dequantize oracle, and what is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import make_checkpoint, random_prompts
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.bench.compress import compress
from tierserve.layers import ParallelLMHead
from tierserve.layers.quantized import (
    QuantizedWeight,
    QuantScheme,
    backend_for,
    pack_int32,
    unpack_int32,
)

# Big enough that every group divides at TP 2 (the sizes).
DENSE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip


def oracle_tokens(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens on the checkpoint dequantized, in float32."""
    import transformers
    from transformers import CompressedTensorsConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), quantization_config=CompressedTensorsConfig(run_compressed=False),
        dtype=torch.float32,
    ).eval()  # fmt: skip
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            got = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                 attention_mask=torch.ones_like(ids))  # fmt: skip
            outs.append(got[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant-dense")
    return {f: make_checkpoint(root / f, f, seed=3, **DENSE) for f in ("llama", "qwen3")}


CASES = [  # (family, bits, group, symmetric)
    ("llama", 4, 32, True), ("llama", 4, 128, True), ("llama", 4, 32, False),
    ("llama", 8, None, True), ("qwen3", 4, 32, True), ("qwen3", 4, 128, False),
    ("qwen3", 8, None, True),
]  # fmt: skip


@pytest.mark.parametrize(("family", "bits", "group", "symmetric"), CASES)
def test_greedy_tokens_equal_transformers_dequantized(dense_dirs, tmp_path, family, bits,
                                                      group, symmetric):  # fmt: skip
    path = compress(dense_dirs[family], tmp_path / "q", bits, group, symmetric)
    prompts = random_prompts(3, [5, 17, 40], seed=1)
    want = oracle_tokens(path, prompts, 12)
    llm = LLM(str(path), dtype="float32", quantized_activations="model", max_total_tokens=1024)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    weights = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedWeight)]
    assert len(weights) == 2 * 4  # qkv, o, gate_up, down: quantized, kept so
    kernel = backend_for(QuantScheme(bits, group, symmetric), 512, torch.device("cpu"))[0]
    assert {w.backend for w in weights} == {kernel}
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    dense = [m for m in linears if isinstance(m.weight, torch.Tensor)]
    dense = [m for m in dense if not isinstance(m, ParallelLMHead)]
    assert not dense  # only the LM head (ignored) stays dense


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_is_compressed_tensors_own(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    g = torch.Generator().manual_seed(0)
    low = -(1 << (bits - 1))
    q = torch.randint(low, -low, (6, 40), generator=g, dtype=torch.int8)
    packed = pack_to_int32(q, bits)
    assert torch.equal(unpack_int32(packed, bits, 40) - (1 << (bits - 1)), q.to(torch.int32))
    assert torch.equal(pack_int32(q.to(torch.int32) - low, bits), packed)
    assert torch.equal(unpack_from_int32(packed, bits, q.shape), q)


def test_the_int4_kernel_equals_the_dequantize_oracle_in_float32():
    """The same weight on torch's int4 CPU kernel with float32 activations and dequantized:
    equal to float32 rounding; in bf16, within bf16's."""
    g = torch.Generator().manual_seed(0)
    for symmetric in (True, False):
        w = QuantizedWeight(64, 256, QuantScheme(4, 32, symmetric))
        w.packed.copy_(pack_int32(torch.randint(0, 16, (64, 256), generator=g), 4))
        w.scale.copy_(torch.rand(64, 8, generator=g) * 0.1 + 0.01)
        if not symmetric:
            w.zero_point.copy_(torch.randint(0, 16, (64, 8), generator=g))
        x = torch.randn(5, 256, generator=g)
        want = w(x)  # the dequantize oracle
        w.finalize("int4_cpu", torch.float32)
        torch.testing.assert_close(w(x), want, rtol=1e-5, atol=1e-4)
        assert w.held_bytes() < 64 * 256  # 4 bits a value, plus the scales


def test_unserved_schemes_are_refused_by_name(dense_dirs, tmp_path):
    from tierserve.models import QuantConfig

    path = compress(dense_dirs["llama"], tmp_path / "q", 4, 32, True)
    config = json.loads((path / "config.json").read_text())
    quant = config["quantization_config"]
    bad = [
        ({"input_activations": {"num_bits": 8, "type": "int"}}, "input_activations"),
        ({"format": "nvfp4-pack-quantized"}, "nvfp4-pack-quantized"),
        ({"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}},
         "float"),
        ({"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}, "tensor"),
        ({"format": "sparse-24-bitmask"}, "sparse-24-bitmask"),
    ]  # fmt: skip
    for change, says in bad:
        group = {**quant["config_groups"]["group_0"], **change}
        q = {**quant, "config_groups": {"group_0": group}}
        with pytest.raises(TierserveError, match=says):
            QuantConfig.read({"quantization_config": q})


@pytest.fixture(scope="module")
def int4_llama(dense_dirs, tmp_path_factory) -> Path:
    return compress(dense_dirs["llama"], tmp_path_factory.mktemp("int4") / "q", 4, 32, True)


def test_int4_at_tp2_under_dp_attention_and_through_the_host_tier(int4_llama):
    """int4 g32 split over two ranks (row-parallel cuts on whole groups), under DP attention,
    and with the host tier loading evicted pages back: one process's greedy tokens."""
    prompts = random_prompts(4, [30, 200, 60, 150], seed=2)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    common = dict(dtype="float32", quantized_activations="model", device="cpu")
    want = [o.token_ids for o in LLM(str(int4_llama), max_total_tokens=2048, **common)
            .generate(prompts, greedy)]  # fmt: skip
    for layout in ({"tp_size": 2}, {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}):
        with LLM(str(int4_llama), max_total_tokens=2048, **common, **layout) as llm:
            assert [o.token_ids for o in llm.generate(prompts, greedy)] == want, layout
    # A pool of 320 tokens: the second pass finds its prompts on the host tier.
    llm = LLM(str(int4_llama), max_total_tokens=320, enable_hierarchical_cache=True,
              hicache_ratio=8, page_size=16, chunked_prefill_size=128, **common)  # fmt: skip
    first = [o.token_ids for o in llm.generate(prompts, greedy)]
    again = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert first == again == want
    assert llm.engine.kv.host.stats.host_hit_tokens > 0


def test_a_dry_run_checks_a_quantized_checkpoint_and_its_cut_under_tp(
    int4_llama, tmp_path, capsys, dense_dirs
):
    from tierserve import cli

    assert cli.main(["serve", "--model", str(int4_llama), "--dry-run", "--device", "cpu"]) == 0
    # Groups of 256 over o_proj's 256 input features at TP 2: 128 a rank, half a group.
    coarse = compress(dense_dirs["llama"], tmp_path / "g256", 4, 256, True)
    argv = ["serve", "--model", str(coarse), "--dry-run", "--device", "cpu", "--tp-size", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "o_proj" in err and "groups of 256" in err and len(err.strip().splitlines()) == 1


# Kimi-K2-Thinking's ignore list: routed experts quantized, everything else dense.
KIMI_IGNORE = ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*")  # fmt: skip
MOE = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
       "num_attention_heads": 4}  # fmt: skip


def as_kimi_k25(source: Path, out: Path) -> Path:
    """`source` laid out as Kimi-K2.5 ships: the text model (and its quantization_config)
    under text_config, its tensors under language_model., a vision tower beside them."""
    shutil.copytree(source, out)
    state = {
        f"language_model.{k}": v for k, v in load_file(str(source / "model.safetensors")).items()
    }
    state["vision_tower.patch_embed.weight"] = torch.randn(8, 3)
    save_file(state, str(out / "model.safetensors"))
    text = json.loads((source / "config.json").read_text())
    del text["architectures"]
    text["model_type"] = "kimi_k2"
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


def dequantized_copy(path: Path, out: Path) -> Path:
    """`path` with every quantized linear decompressed by compressed-tensors itself: the dense
    checkpoint transformers' DeepseekV3 runs as the oracle."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    quant = config.pop("quantization_config")
    scheme = QuantizationScheme.model_validate(quant["config_groups"]["group_0"])
    state = load_file(str(path / "model.safetensors"))
    modules = {k.removesuffix(".weight_packed") for k in state if k.endswith(".weight_packed")}
    for m in modules:
        parts = {
            k.removeprefix(m + "."): state.pop(k) for k in list(state) if k.startswith(m + ".w")
        }
        state[m + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_kimi_k25_layout_moe_with_int4_experts_equals_transformers(tmp_path):
    """DeepSeek-V3's shape (MLA, grouped routing, a shared expert) as Kimi-K2.5 ships it:
    routed experts int4 g32, the rest dense by its ignore list. Greedy tokens equal
    transformers on the weights compressed-tensors dequantizes; the experts stay int4; and
    zeroing them changes the tokens (they are used)."""
    import transformers

    dense = make_checkpoint(tmp_path / "dense", "deepseek-v3", seed=5, **MOE)
    quantized = compress(dense, tmp_path / "int4", 4, 32, True, ignore=KIMI_IGNORE)
    kimi = as_kimi_k25(quantized, tmp_path / "kimi-k2.5")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        str(dequantized_copy(quantized, tmp_path / "deq")), dtype=torch.float32).eval()  # fmt: skip
    prompts = random_prompts(3, [6, 30, 70], seed=4)
    with torch.no_grad():
        runs = [oracle.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                                min_new_tokens=10)[0] for p in prompts]  # fmt: skip
    want = [run[len(p) :].tolist() for run, p in zip(runs, prompts, strict=True)]
    llm = LLM(str(kimi), dtype="float32", quantized_activations="model", max_total_tokens=1024)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if m.__class__.__name__ == "Experts"]
    assert experts and all(isinstance(e.gate_up_proj, QuantizedWeight)
                           and e.down_proj.backend == "int4_cpu" for e in experts)  # fmt: skip
    assert isinstance(model.model.layers[1].mlp.shared_experts.down_proj.weight, torch.Tensor)
    for e in experts:  # the control: routed experts that add nothing
        e.gate_up_proj.scales_zeros.zero_()
        e.down_proj.scales_zeros.zero_()
    llm.engine.flush_cache()
    assert [o.token_ids for o in llm.generate(prompts, greedy)] != want


def test_the_start_up_table_counts_what_the_backends_hold(int4_llama, capsys):
    """`weights per rank` in the dry run's table and the start's plan is what the loaded
    model holds, its int4 weights as the kernel keeps them (bf16 scales), within 5%."""
    from tierserve import cli
    from tierserve.utils import format_gb

    llm = LLM(str(int4_llama), dtype="float32", max_total_tokens=1024)
    model = llm.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(w.held_bytes() for w in quantized)
    planned = llm.engine.kv_plan.weight_bytes_per_rank
    assert planned == pytest.approx(held, rel=0.05)
    as_float32 = sum(p.numel() for p in model.parameters()) * 4
    as_float32 += sum(w.out_features * w.in_features * 4 for w in quantized)
    assert held < 0.35 * as_float32  # the linears at ~4.5 bits, not 32
    assert cli.main(["serve", "--model", str(int4_llama), "--dry-run", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if "weights per rank" in line]
    assert row.split()[-2:] == format_gb(planned, 3).split()
    assert "int4 g32 sym on int4_cpu (bf16 activations)" in out


def test_the_plan_reads_the_ignore_list_as_the_loader_does():
    """Kimi-K2.5's preset: routed experts int4 g32, the rest bf16. The preset's old list
    (`re:.*mlp\\..*`) ignores the routed experts too when matched as the loader matches it,
    and a list without self_attn quantizes attention: the plan says so in both."""
    import copy

    from tierserve.plan.presets import model_preset
    from tierserve.plan.weights import checkpoint_dtypes

    config = model_preset("kimi-k2.5").config
    assert checkpoint_dtypes(config) == {"experts": "int4/g32", "other": "bf16",
                                         "embeddings": "bf16"}  # fmt: skip
    for ignore, experts, other in (
        (["lm_head", "re:.*self_attn.*", "re:.*mlp\\..*"], "bf16", "bf16"),
        (["lm_head"], "int4/g32", "int4/g32"),
    ):
        changed = copy.deepcopy(config)
        changed["text_config"]["quantization_config"]["ignore"] = ignore
        got = checkpoint_dtypes(changed)
        assert (got["experts"], got["other"]) == (experts, other), ignore


def test_every_linear_of_an_mla_model_quantized_equals_transformers(tmp_path):
    """llm-compressor's plain W4A16 recipe leaves only lm_head dense: MLA's latent projections
    and kv_b_proj are quantized too. kv_b_proj, read as a tensor (folded into the queries and
    outputs), is made dense once at load; the rest stay int4; tokens equal transformers'."""
    import transformers

    dense = make_checkpoint(tmp_path / "dense", "deepseek-v3", seed=6, q_lora_rank=32, **MOE)
    quantized = compress(dense, tmp_path / "int4", 4, 32, True)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        str(dequantized_copy(quantized, tmp_path / "deq")), dtype=torch.float32).eval()  # fmt: skip
    prompts = random_prompts(2, [9, 40], seed=5)
    with torch.no_grad():
        runs = [oracle.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8)[0] for p in prompts]  # fmt: skip
    want = [run[len(p) :].tolist() for run, p in zip(runs, prompts, strict=True)]
    llm = LLM(str(quantized), dtype="float32", quantized_activations="model",
              max_total_tokens=1024)  # fmt: skip
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    attention = llm.engine.runner.model.model.layers[0].self_attn
    assert isinstance(attention.kv_b_proj.weight, torch.Tensor)
    assert any(isinstance(m, QuantizedWeight) for m in attention.modules())


def test_nextn_over_a_quantized_checkpoint_is_refused_by_name(int4_llama, capsys):
    from tierserve import cli

    argv = ["serve", "--model", str(int4_llama), "--dry-run", "--speculative-algorithm", "NEXTN"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "NEXTN over a compressed-tensors checkpoint" in err and len(err.splitlines()) == 1
