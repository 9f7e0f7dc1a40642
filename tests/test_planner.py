"""`tierserve plan`: KV bytes per token, device pool, host sizing, SGLang flag checks, the CLI."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from tierserve import cli
from tierserve.errors import TierserveError
from tierserve.model_config import ModelConfig
from tierserve.plan import sglang as sglang_check
from tierserve.plan.launch import LaunchFlags, launch_flags
from tierserve.plan.plan import Machine, Plan, PlanInputs, Workload, make_plan
from tierserve.plan.presets import GPU_PRESETS, MODEL_PRESETS, gpu_preset, model_preset
from tierserve.plan.render import plan_json
from tierserve.plan.sglang import check_sglang
from tierserve.plan.verdict import judge
from tierserve.plan.vllm import check_vllm
from tierserve.plan.weights import checkpoint_dtypes, estimate_parameters, model_spec
from tierserve.sizing import kv as kv_sizing
from tierserve.sizing import pools
from tierserve.sizing.kv import kv_bytes, kv_spec
from tierserve.sizing.pools import HostBudget, HostRequest, size_host_cache
from tierserve.utils import GB, JSON_SCHEMA_VERSION, GiB, format_gb, parse_size

# The seed's server: Kimi-K2.5 on 8 GPUs, as SGLang reported it and as the user measured RAM.
SEED_BYTES_PER_TOKEN = 136_793
SEED_DEVICE_TOKENS = 127_000
SEED_BUDGET = HostBudget(available=445 * GB, overhead=40 * GB, margin=10 * GB, local_ranks=8)
SEED_FLAGS = [
    "--model",
    "kimi-k2.5",
    "--mem-fraction-static",
    "0.93",
    "--tp",
    "8",
    "--gpu",
    "rtx-pro-6000",
    "--kv-bytes-per-token",
    str(SEED_BYTES_PER_TOKEN),
    "--max-total-tokens",
    str(SEED_DEVICE_TOKENS),
    "--host-mem",
    "445GB",
    "--overhead",
    "40GB",
    "--margin",
    "10GB",
]


def shape(name: str) -> ModelConfig:
    return ModelConfig.from_dict(model_preset(name).config)


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str, tp: int = 1) -> kv_sizing.KVBytes:
    return kv_bytes(kv_spec(model, kv_dtype, tp))


def seed_inputs() -> PlanInputs:
    spec = model_spec("kimi-k2", model_preset("kimi-k2").config, weights=0)
    machine = Machine("rtx-pro-6000", GPU_PRESETS["rtx-pro-6000"].memory_bytes, 445 * GB)
    machine = Machine(**{**machine.__dict__, "host_overhead": 40 * GB, "host_margin": 10 * GB})
    return PlanInputs(
        model=spec,
        machine=machine,
        tp=8,
        kv_bytes_per_token_per_rank=SEED_BYTES_PER_TOKEN,
        device_tokens_per_rank=SEED_DEVICE_TOKENS,
    )


# --- KV bytes per token ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "total", "per_rank_tp8", "replicated_tp8"),
    [
        ("llama-3-8b", 131_072, 16_384, False),  # 8 KV heads: one per rank
        ("llama-3-70b", 327_680, 40_960, False),
        ("qwen2.5-7b", 57_344, 14_336, True),  # 4 KV heads < 8 ranks: each head on 2 ranks
        ("qwen3-8b", 147_456, 18_432, False),
        ("deepseek-v3", 70_272, 70_272, True),  # MLA: the latent is whole on every rank
        ("deepseek-r1", 70_272, 70_272, True),
        ("kimi-k2", 70_272, 70_272, True),
    ],
)
def test_kv_bytes_per_token_against_hand_computed(
    name: str, total: int, per_rank_tp8: int, replicated_tp8: bool
) -> None:
    assert kv_bytes_per_token(shape(name), "bf16", tp=1) == (total, total, False)
    assert kv_bytes_per_token(shape(name), "bf16", tp=8) == (total, per_rank_tp8, replicated_tp8)


def test_mla_fp8_halves_the_latent() -> None:
    assert kv_bytes_per_token(shape("deepseek-v3"), "fp8", tp=1).total == 35_136
    assert kv_bytes_per_token(shape("deepseek-v3"), "fp8", tp=8) == (35_136, 35_136, True)
    assert 61 * (512 + 64) * 2 == 70_272  # the formula, written out


def test_copies_of_replicated_kv() -> None:
    assert kv_spec(shape("deepseek-v3"), "bf16", 8).copies == 8
    assert kv_spec(shape("qwen2.5-7b"), "bf16", 8).copies == 2
    assert kv_spec(shape("llama-3-8b"), "bf16", 8).copies == 1
    assert kv_spec(shape("llama-3-8b"), "bf16", 1).copies == 1


def test_attention_kinds_and_mla_detection() -> None:
    assert shape("kimi-k2").attention == "MLA"
    assert shape("llama-3-70b").attention == "GQA"
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert ModelConfig.from_dict(mha).attention == "MHA"
    assert ModelConfig.from_dict(mha).head_dim == 16
    # A Kimi-K2.5-style config nests the language model: the one reader unwraps it.
    nested = {"architectures": ["KimiK25"], "text_config": model_preset("kimi-k2").config}
    assert ModelConfig.from_dict(nested).attention == "MLA"


def test_measured_override_keeps_the_split() -> None:
    kv = kv_bytes_per_token(shape("llama-3-8b"), "bf16", tp=8)
    assert kv_sizing.override_per_rank(kv, 20_000) == (160_000, 20_000, False)
    with pytest.raises(TierserveError):
        kv_sizing.override_per_rank(kv, 0)


def test_unknown_kv_dtype_is_a_user_error() -> None:
    with pytest.raises(TierserveError, match="KV dtype"):
        kv_bytes_per_token(shape("llama-3-8b"), "int3")


# --- weights and presets ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_preset_configs_reproduce_their_published_parameter_counts(name: str) -> None:
    preset = MODEL_PRESETS[name]
    estimate = estimate_parameters(preset.config)
    assert estimate == pytest.approx(preset.num_parameters, rel=0.001)


def test_checkpoint_dtypes_per_component() -> None:
    deepseek = checkpoint_dtypes(model_preset("deepseek-v3").config)
    assert deepseek == {"experts": "fp8", "other": "fp8", "embeddings": "bf16"}
    assert set(checkpoint_dtypes(model_preset("qwen3-8b").config).values()) == {"bf16"}
    int4 = {"quantization_config": {"quant_method": "compressed-tensors"}}
    int4["quantization_config"]["config_groups"] = {"group_0": {"weights": {"num_bits": 4}}}
    assert checkpoint_dtypes({"text_config": int4})["experts"] == "int4"
    # Kimi-K2.5: only the routed experts are int4 (groups of 32 with a bf16 scale each).
    kimi = checkpoint_dtypes(model_preset("kimi-k2.5").config)
    assert kimi == {"experts": "int4/g32", "other": "bf16", "embeddings": "bf16"}


def test_quantized_weights_count_each_component_in_its_dtype() -> None:
    """Kimi-K2.5 as published is ~595 GB: int4 experts with scales plus bf16 for the rest.
    int4 for everything (the old estimate) came out near 513 GB, too small by the bf16 parts."""
    preset = model_preset("kimi-k2.5")
    spec = model_spec(preset.name, preset.config, preset.num_parameters)
    assert 570 * GB < spec.weight_bytes < 620 * GB
    assert "experts × int4/g32" in spec.weight_note and "other × bf16" in spec.weight_note
    everything_int4 = model_spec(preset.name, preset.config, preset.num_parameters, "int4")
    assert everything_int4.weight_bytes < 520 * GB


def test_gpu_presets() -> None:
    assert gpu_preset("rtx-pro-6000").memory_bytes == 97_887 * 2**20  # 96 GB Blackwell
    assert gpu_preset("H100") is GPU_PRESETS["h100-80gb"]
    assert gpu_preset("h200").memory_bytes > 140 * GiB
    assert gpu_preset("80GB") is None


def test_unknown_model_preset_lists_the_known_ones() -> None:
    with pytest.raises(TierserveError, match="llama-3-8b"):
        model_preset("llama-9")


# --- device pool -----------------------------------------------------------------------------


def test_device_pool_is_static_fraction_minus_weights() -> None:
    assert pools.device_pool_bytes(80 * GB, 80 * GB, 16 * GB, 0.9) == 56 * GB
    assert pools.device_pool_bytes(80 * GB, 80 * GB, 60 * GB, 0.5) == 0  # weights do not fit
    assert pools.weights_per_rank(16 * GB, 8) == 2 * GB
    assert pools.tokens_in(999_900, 100, page_size=16) == 9_984


def test_local_ranks() -> None:
    assert pools.local_ranks(8, 8) == 8
    assert pools.local_ranks(16, 8) == 8  # TP across two nodes
    assert pools.local_ranks(4, 8) == 4  # replicas are counted when asked for (--dp), only
    assert pools.local_ranks(1, 1) == 1


# --- host sizing: the seed's numbers ---------------------------------------------------------


def test_seed_device_pool_bytes() -> None:
    pool_bytes = SEED_DEVICE_TOKENS * SEED_BYTES_PER_TOKEN
    assert pool_bytes / GB == pytest.approx(17.4, abs=0.05)


@pytest.mark.parametrize(("ratio", "gb", "fits"), [(2.5, 43.4, True), (3.0, 52.1, False)])
def test_seed_hicache_ratio(ratio: float, gb: float, fits: bool) -> None:
    request = HostRequest.of_ratio(ratio)
    host = size_host_cache(SEED_BYTES_PER_TOKEN, SEED_DEVICE_TOKENS, request, SEED_BUDGET)
    assert host.tokens_per_rank == int(SEED_DEVICE_TOKENS * ratio)
    assert host.bytes_per_rank / GB == pytest.approx(gb, abs=0.05)
    assert host.bytes_per_node == 8 * host.bytes_per_rank
    assert host.fits is fits


def test_seed_auto_host_size_is_the_per_rank_share() -> None:
    auto = size_host_cache(
        SEED_BYTES_PER_TOKEN, SEED_DEVICE_TOKENS, HostRequest.auto(), SEED_BUDGET
    )
    assert SEED_BUDGET.usable == 395 * GB
    assert auto.max_bytes_per_rank == 49_375_000_000  # (445 − 40 − 10) GB / 8, rounded down
    assert auto.bytes_per_rank / GB == pytest.approx(49.4, abs=0.05)
    assert auto.bytes_per_node / GB == pytest.approx(395, abs=0.01)
    assert auto.fits
    assert "/ 8 local ranks" in auto.formula and "rounded down" in auto.formula


def test_host_request_modes() -> None:
    args = (SEED_BYTES_PER_TOKEN, SEED_DEVICE_TOKENS)
    per_node = size_host_cache(*args, HostRequest.per_node(384 * GB), SEED_BUDGET)
    per_rank = size_host_cache(*args, HostRequest.per_rank(48 * GB), SEED_BUDGET)
    assert per_node.tokens_per_rank == per_rank.tokens_per_rank == 48 * GB // SEED_BYTES_PER_TOKEN
    assert size_host_cache(*args, HostRequest("off"), SEED_BUDGET).bytes_per_node == 0
    too_big = size_host_cache(*args, HostRequest.per_rank(300 * GB), SEED_BUDGET)
    assert not too_big.fits and too_big.bytes_per_node / GB == pytest.approx(2400, abs=0.01)


def test_host_budget_rejects_negative_sizes() -> None:
    with pytest.raises(TierserveError):
        HostBudget(available=-1, overhead=0, margin=0, local_ranks=1)
    with pytest.raises(TierserveError):
        HostRequest.per_rank(-5)


# --- the plan --------------------------------------------------------------------------------


def flags_of(plan: Plan) -> LaunchFlags:
    return launch_flags(judge(plan))


def test_plan_dict_has_the_documented_keys() -> None:
    data = plan_json(judge(make_plan(seed_inputs())))
    for key in (
        "kv_bytes_per_token_per_rank",
        "kv_replicated",
        "device_tokens_per_rank",
        "host_bytes_per_rank",
        "host_bytes_per_node",
        "host_tokens_per_rank",
        "fits",
    ):
        assert key in data
    assert data["kv_bytes_per_token_per_rank"] == SEED_BYTES_PER_TOKEN
    assert data["kv_replicated"] is True
    assert data["device_tokens_per_rank"] == SEED_DEVICE_TOKENS
    assert data["host_bytes_per_node"] / GB == pytest.approx(395, abs=0.01)
    assert data["fits"] is True
    json.dumps(data)  # serialisable as is


def test_plan_warns_about_the_per_rank_trap_and_replicated_copies() -> None:
    warnings = "\n".join(judge(make_plan(seed_inputs())).warnings)
    assert "PER RANK" in warnings and "8 × 394 GB" in warnings
    assert "identical on every rank" in warnings and "7 other" in warnings


def test_plan_counts_tierserves_shared_host_copy_once() -> None:
    """The seed deployment: 8 ranks hold the same latent; one copy per node holds 8× the
    tokens at the same bytes, as the start-up table and /metrics count it."""
    plan = make_plan(seed_inputs())
    shared, apart = plan.shared, plan.recommended
    assert shared.sharing == 8
    assert shared.bytes_per_node == pytest.approx(apart.bytes_per_node, rel=1e-4)  # pages round
    assert shared.tokens_per_rank // 8 == pytest.approx(apart.tokens_per_rank, abs=1)
    assert shared.bytes_per_node <= plan.budget.usable
    note = next(w for w in judge(plan).warnings if w.startswith("tierserve keeps"))
    assert f"{shared.tokens_per_rank:,} tokens" in note and f"{apart.tokens_per_rank:,}" in note
    gqa = make_plan(PlanInputs(**{**seed_inputs().__dict__, "tp": 1}))
    assert gqa.shared.sharing == 1
    assert not any("tierserve keeps" in w for w in judge(gqa).warnings)


def test_plan_launch_flags() -> None:
    plan = make_plan(seed_inputs())
    flags = flags_of(plan)
    assert "--enable-hierarchical-cache --hicache-size 49" in flags.sglang
    # vLLM takes GiB for the whole instance: 8 ranks × ~49.4 GB.
    assert f"--kv-offloading-size {plan.recommended.bytes_per_rank * 8 // GiB}" in flags.vllm
    assert "--hicache-node-size 394GB" in flags.tierserve
    assert "--enable-hierarchical-cache" in flags.tierserve
    ratio = make_plan(PlanInputs(**{**seed_inputs().__dict__, "host": HostRequest.of_ratio(2.5)}))
    assert flags_of(ratio).sglang.endswith("--hicache-ratio 2.5")
    sized = make_plan(PlanInputs(**{**seed_inputs().__dict__, "host": HostRequest.per_rank(48e9)}))
    assert flags_of(sized).sglang.endswith("--hicache-size 48")


def test_plan_concurrency_at_the_average_length() -> None:
    inputs = PlanInputs(**{**seed_inputs().__dict__, "workload": Workload(4000, 150)})
    plan = make_plan(inputs)
    assert plan.device_concurrency == SEED_DEVICE_TOKENS // 4000 == 31
    assert plan.cached_concurrency == plan.total_tokens_per_rank // 4000
    # Concurrency asked for is a constraint: 150 × 4,000 tokens do not run at once on 127,000.
    verdict = judge(plan)
    assert [c.name for c in verdict.failed] == ["concurrency"] and not verdict.fits
    assert (
        "150 requests × 4,000 tokens = 600,000 > device pool 127,000"
        in verdict.failed[0].arithmetic
    )


def test_plan_inputs_are_validated() -> None:
    with pytest.raises(TierserveError, match="mem_fraction_static"):
        PlanInputs(**{**seed_inputs().__dict__, "mem_fraction_static": 1.5})
    with pytest.raises(TierserveError, match="tp"):
        PlanInputs(**{**seed_inputs().__dict__, "tp": 0})


# --- SGLang command lines --------------------------------------------------------------------


def test_seed_hicache_size_300_does_not_fit() -> None:
    flags = "--tp-size 8 --enable-hierarchical-cache --hicache-size 300"
    check = check_sglang(flags, seed_inputs(), "0.5.18")  # the seed's SGLang: before #35540
    text = "\n".join(check.lines)
    assert not check.fits
    assert check.host_tokens_per_rank == 300 * GB // SEED_BYTES_PER_TOKEN + 1  # + SGLang's page
    assert "8 ranks × 300.0 GB = 2,400.0 GB requested" in text
    assert "395.0 GB usable" in text and "does NOT fit" in text
    assert "its own check passes" in text and "hangs" in text  # each rank alone has enough
    assert check.suggestion.startswith("--hicache-size 49 ")
    assert "--hicache-ratio 2.8" in check.suggestion


def test_seed_hicache_size_48_fits() -> None:
    check = check_sglang("--tp-size 8 --enable-hierarchical-cache --hicache-size 48", seed_inputs())
    assert check.fits and check.suggestion == ""
    assert check.host_bytes_per_node / GB == pytest.approx(384, abs=0.01)


def test_sglang_ratio_and_defaults() -> None:
    # No size: SGLang multiplies the device pool by --hicache-ratio, default 2.0.
    check = check_sglang("--tp 8 --enable-hierarchical-cache", seed_inputs())
    assert check.host_tokens_per_rank == 2 * SEED_DEVICE_TOKENS + 1
    assert check.fits
    three = check_sglang("--tp 8 --enable-hierarchical-cache --hicache-ratio 3.0", seed_inputs())
    assert not three.fits


def test_sglang_without_hierarchical_cache_uses_no_host_ram() -> None:
    check = check_sglang("--tp-size 8 --hicache-size 300", seed_inputs())
    assert check.fits and check.host_bytes_per_node == 0
    assert "not set" in check.lines[-1]


def test_sglang_reads_a_whole_command_line() -> None:
    command = (
        "NCCL_PROTO=LL python -m sglang.launch_server --model-path /models/kimi \\\n"
        "  --tp-size 8 --mem-fraction-static=0.93 --enable-hierarchical-cache "
        "--hicache-write-policy write_through --hicache-size 48 --kv-cache-dtype fp8_e4m3"
    )
    flags = sglang_check.parse_sglang_flags(command)
    assert (flags.tp, flags.hicache_size_gb, flags.mem_fraction_static) == (8, 48, 0.93)
    assert flags.model_path == "/models/kimi" and flags.local_ranks == 8
    assert sglang_check.sglang_kv_dtype(flags.kv_cache_dtype, "bf16") == "fp8"


def test_sglang_size_takes_whole_gb_like_sglang() -> None:
    with pytest.raises(TierserveError, match="SGLang flags"):
        sglang_check.parse_sglang_flags("--hicache-size 300GB")


# --- units -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48GB", 48 * 10**9),
        ("48GiB", 48 * 2**30),
        ("0.5TB", 5 * 10**11),
        ("48", 48 * 10**9),  # bare number: decimal GB, as SGLang
        ("300 MB", 300 * 10**6),
        ("1.5 gib", 3 * 2**29),
        ("0.1TB", 10**11),
        ("512B", 512),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [("-5GB", "negative"), ("abc", "cannot read"), ("1e999999", "over 1 EB")],  # Decimal's Overflow
)
def test_parse_size_rejects(text: str, message: str) -> None:
    with pytest.raises(TierserveError, match=message):
        parse_size(text, field="host_mem")


def test_parse_size_names_unknown_units() -> None:
    with pytest.raises(TierserveError, match="unknown unit 'XB'") as err:
        parse_size("48XB", field="margin")
    assert err.value.field == "margin"


def test_format_gb() -> None:
    assert format_gb(17_374_000_000) == "17.4 GB"
    assert format_gb(2_400 * GB) == "2,400.0 GB"


# --- CLI -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def only_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # cli.main imports every subcommand's module; `serve` pulls in torch and the engine, which
    # these tests neither need nor should wait for.
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"plan": cli.SUBCOMMANDS["plan"]})


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_table_for_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(capsys, *SEED_FLAGS)
    assert code == 0
    assert "136,793 B" in out and "identical on all 8 ranks" in out
    assert "127,000" in out and "49.4 GB" in out and "395.0 GB" in out
    assert "--hicache-size 49" in out and "fits: yes" in out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(capsys, *SEED_FLAGS, "--host-ratio", "2.5", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] is True
    assert data["host_mode"] == "ratio"
    assert data["host_tokens_per_rank"] == 317_500
    assert data["host_bytes_per_rank"] / GB == pytest.approx(43.4, abs=0.05)


def test_cli_check_sglang_seed(capsys: pytest.CaptureFixture[str]) -> None:
    bad = "--tp-size 8 --enable-hierarchical-cache --hicache-size 300"
    code, out, _ = run_plan(capsys, *SEED_FLAGS, "--check-sglang", bad)
    assert code == 1
    assert "DOES NOT FIT" in out and "8 ranks × 300.0 GB = 2,400.0 GB" in out
    assert "what fits: --hicache-size 49" in out
    good = "--tp-size 8 --enable-hierarchical-cache --hicache-size 48"
    code, out, _ = run_plan(capsys, *SEED_FLAGS, "--check-sglang", good, "--json")
    assert code == 0 and json.loads(out)["fits"] is True


def test_cli_model_that_does_not_fit_the_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    # Kimi-K2 as published is FP8, ~1 TB: 128 GB per rank cannot fit a 96 GB GPU.
    base = ["--model", "kimi-k2", "--tp", "8", "--gpu", "rtx-pro-6000", "--host-mem", "445GB"]
    code, out, _ = run_plan(capsys, *base)
    assert code == 1 and "no room for a KV pool" in out and "fits: NO (device memory)" in out
    assert "weights per rank 128.5 GB ≥ GPU 102.6 GB" in out  # the cause, not host RAM
    assert "about --tp 16" in out and "none: a server would not start" in out
    code, out, _ = run_plan(capsys, *base, "--weights", "594GB", "--json")
    data = json.loads(out)
    assert code == 0 and data["device_tokens_per_rank"] > 100_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-9"], "unknown model preset"),
        (["--model", "llama-3-8b", "--host-mem=-4GB"], "host_mem must not be negative"),
        (["--model", "llama-3-8b", "--overhead=-1", "--host-mem", "1TB"], "must not be negative"),
        (["--model", "llama-3-8b", "--host-mem", "four GB"], "cannot read host_mem"),
        (["--model", "llama-3-8b", "--host-mem", "4QB"], "unknown unit"),
        (["--model", "llama-3-8b", "--gpu", "h900"], "cannot read gpu"),
        (["--model", "llama-3-8b", "--host-mem", "64GB", "--tp", "0"], "tp must be > 0"),
        (["--host-mem", "64GB"], "give --model"),
        # What serve refuses, plan refuses (0 GPUs read as "unset"; a ratio of 0 planned none).
        (["--model", "llama-3-8b", "--host-mem", "64GB", "--gpus", "0"], "gpus must be > 0"),
        (["--model", "llama-3-8b", "--host-mem", "64GB", "--host-ratio", "0"],
         "host_ratio must be a number in (0, 1e6)"),
        (["--model", "llama-3-8b", "--host-mem", "64GB", "--speculative-num-steps", "0"],
         "--speculative-num-steps must be >= 1, got 0"),
        # A misspelt memory flag was planned as if absent (exit 0).
        (["--model", "llama-3-8b", "--host-mem", "64GB",
          "--check-sglang=--enable-hierarchical-cache --hicache-sise 48"],
         "SGLang has no --hicache-sise: did you mean --hicache-size?"),
        (["--model", "llama-3-8b", "--host-mem", "64GB",
          "--check-vllm=vllm serve m --gpu-memory-utilisation 0.9"],
         "vLLM has no --gpu-memory-utilisation: did you mean --gpu-memory-utilization?"),
    ],
)  # fmt: skip
def test_cli_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err


def test_cli_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--model", "llama-3-8b", "--tp", "eight"])
    assert exc.value.code == 2


def test_cli_reads_host_ram_from_this_machine(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=123 * GB))
    code, out, _ = run_plan(capsys, "--model", "llama-3-8b", "--json")
    data = json.loads(out)
    assert code == 0 and data["host_available_bytes"] == 123 * GB


def test_cli_reads_a_hf_config_from_disk(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    args = ["--gpu", "24GB", "--host-mem", "64GB", "--json"]
    code, out, _ = run_plan(capsys, "--model", str(tmp_path), *args)
    data = json.loads(out)
    assert code == 0
    assert data["kv_bytes_per_token"] == 2 * 16 * 8 * 64 * 2 == 32_768
    assert data["weights_bytes"] == 4096  # the checkpoint's own size
    code, out, _ = run_plan(capsys, "--model", str(tmp_path / "config.json"), *args)
    assert json.loads(out)["kv_bytes_per_token"] == 32_768


def test_cli_reads_a_nested_mla_config(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # Kimi-K2.5-style: the language model's config sits under text_config.
    config = {"model_type": "kimi_k25", "text_config": model_preset("kimi-k2").config}
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ["--model", str(tmp_path), "--tp", "8", "--host-mem", "445GB", "--json"]
    _, out, _ = run_plan(capsys, *args, "--gpu", "h200")
    data = json.loads(out)
    assert data["attention"] == "MLA" and data["kv_bytes_per_token_per_rank"] == 70_272
    assert data["kv_replicated"] is True
    # No safetensors here: parameters estimated from the config, at its FP8 quantization
    # (embeddings stay bf16).
    assert data["weights_bytes"] == model_spec("x", config).weight_bytes
    assert 1.0 < data["weights_bytes"] / estimate_parameters(config) < 1.01


# --- a verdict that is never wrong -------------------------------------------------------------


def test_sglang_pipeline_stages_are_processes_with_their_own_pools() -> None:
    """tp 8 × pp 2 is 16 processes, each allocating --hicache-size; each stage holds half the
    layers, so KV per token per rank halves too."""
    machine = dataclasses.replace(seed_inputs().machine, gpus_per_node=16)
    inputs = dataclasses.replace(seed_inputs(), machine=machine, kv_bytes_per_token_per_rank=None)
    one = check_sglang("--tp-size 8 --enable-hierarchical-cache --hicache-size 24", inputs)
    two = check_sglang(
        "--tp-size 8 --pp-size 2 --enable-hierarchical-cache --hicache-size 24", inputs
    )
    assert one.flags.local_ranks == 8 and two.flags.local_ranks == 16
    assert two.host_bytes_per_node == pytest.approx(2 * one.host_bytes_per_node, rel=0.01)
    assert two.plan.kv.per_rank == pytest.approx(one.plan.kv.per_rank * 31 / 61, rel=0.01)
    assert "8 TP ranks × 2 pipeline stages: 16 processes" in two.lines[0]


def test_no_device_pool_is_a_device_verdict_not_a_host_one() -> None:
    preset = model_preset("kimi-k2")  # fp8, ~1 TB: 128 GB per rank on 8 × 96 GB
    inputs = dataclasses.replace(
        seed_inputs(),
        model=model_spec(preset.name, preset.config, preset.num_parameters),
        kv_bytes_per_token_per_rank=None,
        device_tokens_per_rank=None,
    )
    check = check_sglang("--tp-size 8 --enable-hierarchical-cache --hicache-size 48", inputs)
    text = "\n".join(check.lines)
    assert (
        not check.fits and "device memory does NOT fit" in text and "no room for a KV pool" in text
    )
    assert "host RAM" not in text and "ratio" not in check.suggestion
    assert "--tp 16" in check.suggestion


def test_suggestions_are_never_zero_sizes() -> None:
    tight = dataclasses.replace(seed_inputs().machine, host_available=55 * GB)
    inputs = dataclasses.replace(seed_inputs(), machine=tight)  # 40 GB overhead + 10 GiB margin
    check = check_sglang("--tp-size 8 --enable-hierarchical-cache --hicache-size 48", inputs)
    assert not check.fits and "--hicache-size 0" not in check.suggestion
    assert "drop --enable-hierarchical-cache" in check.suggestion
    plan = make_plan(inputs)  # auto: the largest that fits is under 1 GB a rank, so none
    flags = flags_of(plan)
    assert "--hicache-node-size 0GB" not in flags.tierserve
    assert "--enable-hierarchical-cache" not in flags.tierserve + flags.sglang
    broke = dataclasses.replace(seed_inputs().machine, host_available=30 * GB)
    verdict = judge(make_plan(dataclasses.replace(seed_inputs(), machine=broke)))
    assert not verdict.fits and [c.name for c in verdict.failed] == ["host RAM"]
    assert "the processes alone do not fit" in verdict.failed[0].arithmetic


def test_max_total_tokens_is_checked_against_gpu_memory_and_printed() -> None:
    inputs = dataclasses.replace(seed_inputs(), device_tokens_per_rank=24_000_000, page_size=64)
    verdict = judge(make_plan(inputs))  # 24 M × 136,793 B = 3.3 TB on a 96 GB GPU
    assert not verdict.fits and verdict.failed[0].name == "device memory"
    assert "at most --max-total-tokens" in verdict.failed[0].fix
    ok = judge(make_plan(dataclasses.replace(inputs, device_tokens_per_rank=127_000)))
    assert ok.fits
    ok_flags = launch_flags(ok)
    for line in (ok_flags.tierserve, ok_flags.sglang):
        assert "--max-total-tokens 127000" in line and "--page-size 64" in line
    off = flags_of(
        make_plan(
            dataclasses.replace(inputs, device_tokens_per_rank=127_000, host=HostRequest("off"))
        )
    )
    assert "hicache" not in off.tierserve + off.sglang
    assert "kv-offloading" not in off.vllm


def test_a_context_length_the_device_cannot_hold_does_not_fit() -> None:
    inputs = dataclasses.replace(seed_inputs(), context_length=131_072)  # pool: 127,000 tokens
    verdict = judge(make_plan(inputs))
    assert not verdict.fits and [c.name for c in verdict.failed] == ["context length"]
    assert "131,072 tokens > device pool 127,000" in verdict.failed[0].arithmetic
    assert judge(make_plan(dataclasses.replace(inputs, context_length=100_000))).fits
    assert make_plan(seed_inputs()).longest_request == 127_000


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--model", "llama-3-8b", "--tp", "3"], "tp 3 does not divide"),
        (["--model", "qwen2.5-7b", "--tp", "7"], "one must divide the other"),
        (["--model", "llama-3-8b", "--tp", "8", "--gpus", "3"], "do not fill nodes of 3 GPUs"),
        (["--model", "llama-3-8b", "--context-length", "9000"], "max_position_embeddings 8192"),
        (["--model", "/nowhere/model"], "model directory not found: /nowhere/model"),
        (["--model", "someorg/some-model"], "huggingface-cli download someorg/some-model"),
    ],
)
def test_layouts_sglang_would_refuse_are_bad_input(
    capsys: pytest.CaptureFixture[str], args: list[str], field: str
) -> None:
    code, _, err = run_plan(capsys, *args, "--host-mem", "500GB")
    assert code == 2 and field in err


def test_json_errors_are_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_plan(capsys, "--model", "llama-3-8b", "--tp", "3", "--json")
    data = json.loads(out)
    assert code == 2 and data["kind"] == "error" and data["field"] == "tp"
    assert "tp 3 does not divide" in data["message"] and "tp 3" in err


def test_hugging_face_ids_resolve_to_presets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_plan(
        capsys,
        "--model",
        "moonshotai/Kimi-K2-Instruct",
        "--tp",
        "8",
        "--gpu",
        "h200",
        "--host-mem",
        "1TB",
        "--json",
    )
    data = json.loads(out)
    assert code in (0, 1) and data["model"] == "kimi-k2"
    assert data["schema_version"] == JSON_SCHEMA_VERSION and data["kind"] == "plan"
    assert {c["name"] for c in data["constraints"]} == {"device memory", "host RAM"}
    code, out, _ = run_plan(
        capsys, "--model", "Kimi-K2.5", "--tp", "8", "--gpu", "h200", "--host-mem", "1TB"
    )
    assert "tierserve serve --model ./Kimi-K2.5" in out
    assert "huggingface-cli download moonshotai/Kimi-K2.5 --local-dir ./Kimi-K2.5" in out


def test_vllm_command_lines_are_checked_with_vllms_semantics() -> None:
    inputs = dataclasses.replace(seed_inputs(), kv_bytes_per_token_per_rank=None)
    fits = "--max-model-len 100000"  # the model's 131,072 is more than the 127,000-token pool
    ok = check_vllm(
        f"vllm serve m --tensor-parallel-size 8 --kv-offloading-size 300 {fits}", inputs
    )
    # 300 GiB for the engine = 322 GB on the node, split over its 8 workers.
    assert ok.fits and ok.plan.host.bytes_per_node == pytest.approx(300 * GiB, abs=8 * 64 * 2**17)
    assert ok.plan.local_ranks == 8 and "8 processes" in ok.lines[0]
    two = check_vllm(f"-tp 8 -dp 2 --kv-offloading-size 300 {fits}", inputs)  # two engines
    assert two.plan.local_ranks == 16 and not two.fits
    assert any("--kv-offloading-size 183 at most" in line for line in two.lines), two.lines
    host = next(c for c in two.to_dict()["constraints"] if c["name"] == "host RAM")
    assert host["suggest"] == {"kv_offloading_size": 183}  # the JSON speaks vLLM's unit too
    assert two.plan.host.bytes_per_node == pytest.approx(2 * 300 * GiB, abs=16 * 64 * 2**17)
    long = check_vllm("-tp 8 --max-model-len 130000", inputs)  # pool: 127,000 tokens
    assert not long.fits and any("vLLM refuses to start" in line for line in long.lines)
    assert any("--max-model-len 127,000 at most" in line for line in long.lines)


def test_printed_vllm_line_reproduces_the_plan() -> None:
    plan = make_plan(seed_inputs())
    vllm_line = flags_of(plan).vllm
    check = check_vllm(vllm_line, seed_inputs())
    # The model's 131,072 would not fit the 127,000-token pool: capped, in whole 16-token blocks.
    assert "--max-model-len 126992 --num-gpu-blocks-override 7937" in vllm_line
    assert check.fits and check.plan.local_ranks == plan.local_ranks
    assert check.plan.device_tokens_per_rank == 7937 * 16
    assert abs(check.plan.host.bytes_per_rank - plan.recommended.bytes_per_rank) <= GiB


def test_plan_speaks_serve_sglang_and_vllm_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "kimi-k2.5", "--gpu", "h200", "--host-mem", "600GB", "--json"]
    ours = ["--tp", "8", "--host-per-rank", "48", "--kv-dtype", "fp8"]
    theirs = ["--tp-size", "8", "--hicache-size", "48", "--kv-cache-dtype", "fp8_e4m3"]
    vllm = ["--tensor-parallel-size", "8", "--host-per-rank", "48GB", "--kv-cache-dtype", "fp8"]
    results = []
    for flags in (ours, theirs, vllm):
        code, out, _ = run_plan(capsys, *base, *flags)
        results.append((code, json.loads(out)))
    assert results[0] == results[1] == results[2]
    with pytest.raises(SystemExit) as exit_:
        run_plan(capsys, *base, "--kv-cache-dtype", "int3")
    assert exit_.value.code == 2 and "unknown KV dtype 'int3'" in capsys.readouterr().err


def test_plan_and_serve_share_one_definition_of_their_common_flags() -> None:
    import argparse

    from tierserve.plan import cli as plan_cli
    from tierserve.server import cli as serve_cli

    def actions(add) -> dict[str, argparse.Action]:
        parser = argparse.ArgumentParser()
        add(parser)
        return {a.option_strings[0]: a for a in parser._actions if a.option_strings}

    plan, serve = actions(plan_cli.add_arguments), actions(serve_cli.add_arguments)
    for name in plan_cli.SHARED_FLAGS:
        flag = "--" + name.replace("_", "-")
        assert plan[flag].help == serve[flag].help and plan[flag].type == serve[flag].type
    assert plan["--page-size"].default == 1 and serve["--page-size"].default == 16


def test_nnodes_splits_the_ranks_over_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "kimi-k2.5", "--gpu", "h200", "--host-mem", "1TB", "--json"]
    _, out, _ = run_plan(capsys, *base, "--tp-size", "16", "--nnodes", "2")
    data = json.loads(out)
    assert data["local_ranks"] == 8 and data["nodes"] == 2
    code, _, err = run_plan(capsys, *base, "--tp", "16", "--nnodes", "3")
    assert code == 2 and "--nnodes 3" in err


def test_data_parallel_replicas_are_processes_and_run_their_own_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--model", "llama-3-70b", "--gpu", "h200", "--host-mem", "1TB", "--json"]
    _, one, _ = run_plan(capsys, *base, "--tp", "4")
    _, two, _ = run_plan(capsys, *base, "--tp-size", "4", "--dp-size", "2")
    one, two = json.loads(one), json.loads(two)
    assert (one["local_ranks"], two["local_ranks"]) == (4, 8)
    assert two["device_tokens_per_rank"] == one["device_tokens_per_rank"]
    assert two["device_concurrency"] == 2 * one["device_concurrency"]
    assert "--dp-size 2" in two["flags"]["sglang"]
    assert "--data-parallel-size 2" in two["flags"]["vllm"]


# (total, free, weights per rank, --mem-fraction-static) of three cards, one with memory in use.
THREE_GPUS = [
    (80 * GB, 80 * GB, 16 * GB, 0.9),  # an empty H100 80GB
    (40 * GB, 37 * GB, 14 * GB, 0.85),  # an A100 40GB with 3 GB taken by another process
    (141 * GB, 140 * GB, 60 * GB, 0.93),  # an H200 with its CUDA context
]


@pytest.mark.parametrize(("total", "free", "weights", "fraction"), THREE_GPUS)
def test_plan_and_serve_size_the_device_pool_with_one_function(
    capsys: pytest.CaptureFixture[str], total: int, free: int, weights: int, fraction: float
) -> None:
    from tierserve.engine.startup import device_pool_tokens

    expected = int(total * fraction) - (total - free) - weights
    assert pools.device_pool_bytes(total, free, weights, fraction) == expected
    flags = ["--model", "kimi-k2.5", "--gpu", f"{total // GB}GB", "--weights", f"{weights}B"]
    flags += ["--mem-fraction-static", str(fraction), "--host-mem", "1TB", "--json"]
    _, out, _ = run_plan(capsys, *flags)
    printed = json.loads(out)
    # plan assumes a card with nothing on it yet; serve reads what is free.
    assert printed["device_pool_bytes_per_rank"] == pools.device_pool_bytes(
        total, total, weights, fraction
    )
    spec = kv_spec(ModelConfig.from_dict(MODEL_PRESETS["kimi-k2.5"].config), "bf16")
    served = device_pool_tokens(spec, total, free, weights, fraction)
    assert served == expected // spec.bytes_per_token
    if free == total:
        assert printed["device_tokens_per_rank"] == served


def test_the_plan_and_both_checks_count_a_draft_and_refuse_one_that_is_not_there(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """DeepSeek-V3's MTP layer (NEXTN; SGLang's EAGLE without a draft) split over the ranks,
    an EAGLE-3 draft whole on each, each one more KV layer per token; a model that ships no MTP
    layer is refused by name."""
    from tierserve.models import SHIPPED_DRAFT

    base = ["--model", "deepseek-v3", "--tp", "8", "--gpu", "h200", "--host-mem", "449GB"]
    plain = json.loads(run_plan(capsys, *base, "--json")[1])
    code, out, _ = run_plan(capsys, *base, "--speculative-algorithm", "NEXTN", "--json")
    mtp = json.loads(out)
    assert code == 0 and mtp["draft"]["name"] == "MTP layer" and mtp["draft"]["split"]
    # 11.7B own parameters in fp8 (DeepSeek-V3's report: 14B with the embedding and head).
    assert 11e9 < mtp["draft"]["weight_bytes"] < 12.5e9
    per_layer = plain["kv_bytes_per_token_per_rank"] // 61
    assert mtp["kv_bytes_per_token_per_rank"] == plain["kv_bytes_per_token_per_rank"] + per_layer
    assert mtp["weights_bytes_per_rank"] - plain["weights_bytes_per_rank"] == pytest.approx(
        mtp["draft"]["weight_bytes"] / 8, abs=1
    )
    assert mtp["device_tokens_per_rank"] < plain["device_tokens_per_rank"]
    sglang = "--tp-size 8 --speculative-algorithm EAGLE --speculative-num-steps 1"
    code, out, _ = run_plan(capsys, *base, "--check-sglang", sglang)
    assert code == 0 and "MTP layer: 1.5 GB of weights per rank" in out and "(2 rows)" in out
    draft = str(SHIPPED_DRAFT)
    vllm = f"""-tp 8 --speculative-config '{{"method": "eagle3", "model": "{draft}"}}'"""
    code, out, _ = run_plan(capsys, *base, "--check-vllm", vllm)
    assert code == 0 and "EAGLE-3 draft" in out and "whole on every rank" in out
    eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft]
    got = json.loads(run_plan(capsys, *base, *eagle, "--json")[1])["draft"]
    size = (SHIPPED_DRAFT / "model.safetensors").stat().st_size
    assert (got["weight_bytes"], got["bytes_per_rank"], got["split"]) == (size, size, False)
    code, _, err = run_plan(capsys, "--model", "kimi-k2.5", "--speculative-algorithm", "EAGLE")
    assert code == 2 and "ships none" in err
