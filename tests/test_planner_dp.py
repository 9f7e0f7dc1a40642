"""The planner and the SGLang/vLLM checks under data-parallel attention, and what each SGLang
release does with host pools that do not fit (before v0.5.19 it hangs, since then it refuses,
since v0.5.21 it sizes them itself)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.test_planner import SEED_BYTES_PER_TOKEN, seed_inputs
from tierserve import cli
from tierserve.errors import TierserveError
from tierserve.plan.plan import Machine, PlanInputs, make_plan
from tierserve.plan.presets import GPU_PRESETS, model_preset
from tierserve.plan.sglang import check_sglang
from tierserve.plan.sglang_versions import NEWEST, SGLangVersion, auto_ratio, rank_budget
from tierserve.plan.verdict import judge
from tierserve.plan.vllm import check_vllm
from tierserve.plan.weights import model_spec
from tierserve.utils import GB, GiB

HOST = "--tp-size 8 --enable-hierarchical-cache"


def kimi_on(gpu: str, **kw) -> PlanInputs:
    preset = model_preset("kimi-k2.5")
    spec = model_spec("kimi-k2.5", preset.config, preset.num_parameters)
    machine = Machine(gpu, GPU_PRESETS[gpu].memory_bytes, 445 * GB)
    return PlanInputs(model=spec, machine=machine, tp=8, **kw)


# --- the plan ---------------------------------------------------------------------------------


def test_dp_attention_multiplies_the_requests_an_mla_pool_runs() -> None:
    tp = make_plan(kimi_on("h200"))
    dp = make_plan(kimi_on("h200", dp=8, dp_attention=True))
    assert dp.kv.per_rank == tp.kv.per_rank  # the latent is whole on every rank either way
    assert dp.local_ranks == tp.local_ranks == 8  # the groups are made of the same GPUs
    # Each rank keeps the attention side whole: more weights, a smaller pool per rank...
    attention = dp.inputs.model.attention_bytes
    assert dp.weights_bytes_per_rank - tp.weights_bytes_per_rank == pytest.approx(
        attention - attention / 8, rel=1e-6
    )
    assert dp.device_tokens_per_rank < tp.device_tokens_per_rank
    # ...but 8 pools of distinct latents: far more requests at once.
    assert dp.device_concurrency == dp.device_tokens_per_rank // 4000 * 8
    assert dp.device_concurrency > 4 * tp.device_concurrency
    data = dp.to_dict()
    assert data["dp_meaning"] == "attention groups" and data["attention_tp"] == 1


def test_dp_attention_does_not_fit_kimi_on_the_seeds_cards() -> None:
    """On 8 × RTX PRO 6000 at 0.85 the attention side kept whole on each rank leaves no room
    for a KV pool: the plan says so rather than promising 8 pools."""
    verdict = judge(make_plan(kimi_on("rtx-pro-6000", dp=8, dp_attention=True)))
    assert "device memory" in [c.name for c in verdict.failed]


def test_dp_attention_needs_groups_that_divide_tp() -> None:
    with pytest.raises(TierserveError, match="dp > 1 dividing tp"):
        kimi_on("h200", dp=3, dp_attention=True)


def test_plan_says_which_meaning_dp_has(capsys) -> None:
    args = ["plan", "--model", "kimi-k2.5", "--tp", "8", "--gpu", "h200", "--host-mem", "445GB"]
    cli.main([*args, "--dp", "8", "--enable-dp-attention"])
    groups = capsys.readouterr().out
    assert "DP attention 8 (--dp as attention groups of 1)" in groups
    assert "8 attention groups ×" in groups
    assert "Measured pools can be smaller" in groups and "136,793" in groups
    cli.main([*args, "--dp", "2", "--gpus", "16"])
    assert "--dp as replicas: add --enable-dp-attention" in capsys.readouterr().out


# --- SGLang's releases ------------------------------------------------------------------------


def test_sglang_0_5_19_refuses_what_older_releases_hang_on() -> None:
    flags = f"{HOST} --hicache-size 300"
    old = "\n".join(check_sglang(flags, seed_inputs(), "0.5.18").lines)
    new = check_sglang(flags, seed_inputs(), "v0.5.19")
    assert "hangs" in old
    budget = (445 * GB - 10 * GiB) // 8
    assert rank_budget(445 * GB, 8) == budget
    assert "SGLang v0.5.19 refuses at start-up" in "\n".join(new.lines)
    assert not new.fits and new.to_dict()["sglang_version"] == "v0.5.19"


def test_a_fitting_pool_on_a_shared_host_names_the_open_bug() -> None:
    check = check_sglang(f"{HOST} --hicache-size 48", seed_inputs(), NEWEST)
    text = "\n".join(check.lines)
    assert check.fits and "own check passes" in text and "#38156" in text


def test_sglang_0_5_21_sizes_the_host_pool_when_no_size_or_ratio_is_given() -> None:
    seed = seed_inputs()  # the seed's layout on a node with 200 GB free, not 445
    inputs = dataclasses.replace(
        seed, machine=dataclasses.replace(seed.machine, host_available=200 * GB)
    )
    new = check_sglang(HOST, inputs, "0.5.21")
    old = check_sglang(HOST, inputs, "0.5.20")
    device = new.plan.device_tokens_per_rank * SEED_BYTES_PER_TOKEN
    ratio = auto_ratio(device, new.plan.budget.available, 8, 0.8)
    assert 0 < ratio < 2  # 8 ranks × 2 × a 17 GB device pool do not fit 200 GB
    assert not old.fits and new.fits  # 0.5.20 applies ratio 2 blindly; 0.5.21 shrinks it
    assert new.host_tokens_per_rank < old.host_tokens_per_rank
    assert f"ratio {ratio:.2f}" in "\n".join(new.lines)
    lower = check_sglang(f"{HOST} --hicache-host-memory-fraction 0.4", inputs, "0.5.21")
    assert lower.host_tokens_per_rank < new.host_tokens_per_rank
    given = check_sglang(f"{HOST} --hicache-ratio 2", inputs, "0.5.21")
    assert given.host_tokens_per_rank == old.host_tokens_per_rank  # an explicit ratio stands


@pytest.mark.parametrize("text", ["0.5", "latest", "0.5.x"])
def test_a_version_that_does_not_parse_is_refused(text) -> None:
    with pytest.raises(TierserveError, match="is not a version"):
        SGLangVersion.parse(text)
    assert SGLangVersion.parse("0.5.22.dev20261009").parts == (0, 5, 22)


# --- checks of DP attention command lines -----------------------------------------------------


def test_check_sglang_counts_dp_attention_groups() -> None:
    inputs = kimi_on("h200")
    plain = check_sglang("--tp-size 8", inputs)
    groups = check_sglang("--tp-size 8 --dp-size 8 --enable-dp-attention", inputs)
    assert groups.flags.local_ranks == plain.flags.local_ranks == 8
    assert groups.plan.device_concurrency > 4 * plain.plan.device_concurrency
    assert "its attention group's own requests (8 groups of 1)" in "\n".join(groups.lines)
    assert "the same latents as the other 7 ranks" in "\n".join(plain.lines)


def test_check_vllm_reads_data_parallel_moe_as_dp_attention() -> None:
    check = check_vllm("vllm serve x -tp 1 -dp 8", kimi_on("h200"))
    assert check.plan.inputs.dp_attention and check.plan.inputs.attention_tp == 1
    assert "each engine's attention and KV are its own" in "\n".join(check.lines)
    assert check.plan.local_ranks == 8
    # Each engine keeps its dense MLPs and shared experts too; only routed experts span all 8.
    model = check.plan.inputs.model
    whole = model.attention_bytes + model.dense_mlp_bytes
    assert model.dense_mlp_bytes > 0
    assert check.plan.weights_bytes_per_rank == pytest.approx(
        (model.weight_bytes - whole) / 8 + whole, rel=1e-6
    )
