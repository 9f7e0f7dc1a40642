"""`tierserve plan` under random inputs. The CLI under random flags and config.json mutations:
never a traceback, exit status 0 (fits), 1 (does not fit) or 2 (bad input), and every exit 2
names the flag or field it refuses. The verdict over random models, GPUs, nodes, layouts and
sizes: "fits" exactly when every constraint holds. The printed SGLang line, checked again,
gives the plan's numbers."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tierserve import cli
from tierserve.errors import TierserveError
from tierserve.plan.launch import launch_flags
from tierserve.plan.plan import Machine, PlanInputs, Workload, make_plan
from tierserve.plan.presets import GPU_PRESETS, MODEL_PRESETS, model_preset
from tierserve.plan.sglang import check_sglang
from tierserve.plan.verdict import judge
from tierserve.plan.vllm import check_vllm
from tierserve.plan.weights import model_spec
from tierserve.sizing.pools import HostRequest
from tierserve.utils import GB

NUMBERS = st.sampled_from(
    [
        "0",
        "-1",
        "1",
        "2",
        "3",
        "7",
        "8",
        "16",
        "64",
        "1000",
        "10**30",
        "nan",
        "inf",
        "-inf",
        "1e400",
        "0.5",
        "0.99",
        "1.5",
        "1e-9",
        "abc",
        "",
    ]
)
SIZES = st.sampled_from(
    [
        "0",
        "1",
        "48",
        "300GB",
        "0.5TB",
        "1e400",
        "nan",
        "inf",
        "-5GB",
        "10PB",
        "1e18",
        "9e17",
        "48GiB",
        "GB",
        "1e-30GB",
        "3.3TB",
    ]
)
INT_FLAGS = [
    "--tp",
    "--gpus",
    "--max-total-tokens",
    "--page-size",
    "--avg-seq-len",
    "--concurrency",
    "--kv-bytes-per-token",
]
FLOAT_FLAGS = ["--mem-fraction-static", "--host-ratio"]
SIZE_FLAGS = [
    "--host-mem",
    "--overhead",
    "--margin",
    "--weights",
    "--host-per-node",
    "--host-per-rank",
    "--gpu",
]
SGLANG = st.sampled_from(
    [
        "--tp-size 8 --enable-hierarchical-cache --hicache-size 300",
        "--tp-size 8 --pp-size 2 --enable-hierarchical-cache --hicache-size 48",
        "--tp 4 --dp 2 --enable-hierarchical-cache --hicache-ratio nan",
        "--tp-size 0",
        "--hicache-size 1e400",
        "--mem-fraction-static 2",
        "--enable-hierarchical-cache --hicache-ratio 1e300",
        "--page-size -1",
        "--tp-size 3 --enable-hierarchical-cache",
        "--max-total-tokens 10000000000000",
    ]
)


def run_plan(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["plan", *argv])
        except SystemExit as exit_:  # argparse: exit 2 with the flag named
            code = exit_.code
    return code, err.getvalue()


def check(argv: list[str], fields: set[str]) -> None:
    code, err = run_plan(argv)
    assert code in (0, 1, 2), (argv, code, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines, argv
        named = lines[-1].lower()
        assert any(f in named for f in fields), (argv, err)


FLAG_NAMES = {f.lstrip("-").replace("-", "_") for f in INT_FLAGS + FLOAT_FLAGS + SIZE_FLAGS}
FLAG_NAMES |= {f.lstrip("-") for f in INT_FLAGS + FLOAT_FLAGS + SIZE_FLAGS}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    model=st.sampled_from([*MODEL_PRESETS, "moonshotai/Kimi-K2-Instruct", "/no/such/dir"]),
    ints=st.dictionaries(st.sampled_from(INT_FLAGS), NUMBERS, max_size=4),
    floats=st.dictionaries(st.sampled_from(FLOAT_FLAGS), NUMBERS, max_size=2),
    sizes=st.dictionaries(st.sampled_from(SIZE_FLAGS), SIZES, max_size=3),
    kv_dtype=st.sampled_from(["bf16", "fp8", "fp32"]),
    sglang=st.none() | SGLANG,
    as_json=st.booleans(),
)
def test_random_flags_never_end_in_a_traceback(
    model, ints, floats, sizes, kv_dtype, sglang, as_json
):
    argv = ["--model", model, "--kv-dtype", kv_dtype]
    for flag, value in {**ints, **floats, **sizes}.items():
        argv += [flag, str(eval(value)) if value == "10**30" else value]
    if "--host-mem" not in sizes:
        argv += ["--host-mem", "500GB"]
    if sglang is not None:
        argv += ["--check-sglang", sglang]
    if as_json:
        argv.append("--json")
    check(argv, FLAG_NAMES | {"model", "host", "sglang", "check_sglang", "tp", "gpu", "size"})


BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
BAD_VALUES = st.sampled_from(
    [
        0, -1, 1.5, "x", None, [], {}, True, 10**40, float("nan"),
        {"quant_method": "compressed-tensors", "config_groups": {"group_0": 5}},
        {"quant_method": "gptq", "bits": 4, "config_groups": [], "ignore": 3},
        {"quant_method": "awq", "config_groups": {"group_0": {"weights": {"group_size": 0}}}},
    ]
)  # fmt: skip


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    mutations=st.dictionaries(
        st.sampled_from(
            [*BASE_CONFIG, "head_dim", "kv_lora_rank", "text_config", "quantization_config"]
        ),
        BAD_VALUES,
        min_size=1,
        max_size=3,
    ),
    drop=st.lists(st.sampled_from(list(BASE_CONFIG)), max_size=2),
)
def test_random_config_mutations_never_end_in_a_traceback(tmp_path: Path, mutations, drop):
    config = {**BASE_CONFIG, **mutations}
    for key in drop:
        config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(tmp_path), "--host-mem", "500GB", "--tp", "8"]
    fields = set(BASE_CONFIG) | {"head_dim", "kv_lora_rank", "text_config", "config", "model"}
    fields.add("quantization_config")
    check(argv, fields | {"tp", "heads"})


def test_a_closed_stdout_is_not_a_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = "import sys; from tierserve.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "plan", "--model", "llama-3-8b", "--host-mem", "500GB"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `tierserve plan ... | head -0` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) in (0, 1, 2, 141), err
    assert "Traceback" not in err


# --- the verdict, both directions ------------------------------------------------------------

GPUS = list(GPU_PRESETS.values())


@st.composite
def plan_inputs(draw, roomy: bool = False) -> PlanInputs:
    """Random inputs; `roomy` ones mostly launch (big nodes, the pool from the memory formula)."""
    preset = model_preset(draw(st.sampled_from(list(MODEL_PRESETS))))
    gpu = draw(st.sampled_from(GPUS))
    tp, pp = draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.sampled_from([1, 1, 2]))
    dp = draw(st.sampled_from([1, 1, 2]))
    machine = Machine(
        gpu_name=gpu.name,
        gpu_memory=gpu.memory_bytes,
        host_available=draw(st.integers(200 if roomy else 1, 3000)) * GB,
        gpus_per_node=None if roomy else draw(st.sampled_from([None, 4, 8])),
        host_overhead=None if roomy else draw(st.none() | st.integers(0, 200).map(GB.__mul__)),
    )
    host = draw(
        st.sampled_from(
            [
                HostRequest.auto(),
                HostRequest("off"),
                HostRequest.of_ratio(draw(st.floats(0, 20))),
                HostRequest.per_rank(draw(st.integers(0, 600)) * GB),
                HostRequest.per_node(draw(st.integers(0, 3000)) * GB),
            ]
        )
    )
    return PlanInputs(
        model=model_spec(preset.name, preset.config, preset.num_parameters),
        machine=machine,
        tp=tp,
        pp=pp,
        dp=dp,
        kv_dtype=draw(st.sampled_from(["bf16", "fp8", "fp32"])),
        mem_fraction_static=draw(st.floats(0.3, 0.97)),
        page_size=draw(st.sampled_from([1, 16, 64])),
        host=host,
        workload=Workload(draw(st.integers(100, 100_000)), draw(st.none() | st.integers(1, 500))),
        device_tokens_per_rank=None if roomy else draw(st.none() | st.integers(1, 10**7)),
        context_length=draw(st.none() | st.integers(1, 300_000)),
    )


def valid_inputs(draw_inputs) -> PlanInputs | None:
    try:
        return draw_inputs()
    except TierserveError:
        return None  # a layout SGLang would refuse too (tp vs heads, uneven nodes)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data())
def test_fits_exactly_when_every_constraint_holds(data) -> None:
    inputs = valid_inputs(lambda: data.draw(plan_inputs()))
    assume(inputs is not None)
    plan = make_plan(inputs)
    verdict = judge(plan)
    # Each constraint from first principles, not from plan/verdict.py.
    static = int(inputs.machine.gpu_memory * inputs.mem_fraction_static)
    weights = math.ceil(inputs.model.weight_bytes / (inputs.tp * inputs.pp))
    bpt, tokens = plan.kv.per_rank, plan.device_tokens_per_rank
    if inputs.device_tokens_per_rank is None:
        assert tokens == max(0, static - weights) // bpt // inputs.page_size * inputs.page_size
        device_ok = tokens > 0
    else:
        device_ok = tokens * bpt + weights <= static
    budget = plan.budget
    assert budget.local_ranks <= inputs.gpus_per_node
    host_pools = plan.host.bytes_per_rank * budget.local_ranks  # every process its own pool
    usable = budget.available - budget.overhead - budget.margin
    ram_ok = usable >= 0 and (inputs.host.mode == "off" or host_pools <= usable)
    length_ok = inputs.context_length is None or inputs.context_length <= tokens
    wanted = inputs.workload.concurrency
    running_ok = wanted is None or wanted * inputs.workload.avg_seq_len <= tokens * inputs.dp
    every = device_ok and ram_ok and length_ok and running_ok
    assert verdict.fits == every, [c for c in verdict.constraints if not c.holds]
    if verdict.fits:
        assert tokens > 0 and host_pools <= budget.usable
    for c in verdict.failed:  # what to do instead: never a zero size, in words or in numbers
        assert c.fix and not re.search(r"(size|tokens|node-size) 0\b", c.fix), c.fix
        assert all(value > 0 for value in c.suggest.values()), c


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_printed_sglang_lines_reproduce_the_plan(data) -> None:
    """Fed back to --check-sglang, the launch line the plan prints gives the plan's numbers:
    processes on the node, device pool, and a host pool within SGLang's whole-GB rounding."""
    inputs = valid_inputs(lambda: data.draw(plan_inputs(roomy=True)))
    assume(inputs is not None)
    plan = make_plan(inputs)
    verdict = judge(plan)
    assume(verdict.launchable)
    flags = launch_flags(verdict)
    check = check_sglang(flags.sglang, inputs)
    assert check.flags.local_ranks == plan.local_ranks
    assert check.plan.device_tokens_per_rank == plan.device_tokens_per_rank
    assert check.plan.kv.per_rank == plan.kv.per_rank
    vllm = check_vllm(flags.vllm, inputs)
    assert vllm.plan.local_ranks == plan.local_ranks and vllm.plan.kv.per_rank == plan.kv.per_rank
    # For a MoE model vLLM's -dp is not replicas but its DP attention (the routed experts span
    # every engine's workers): its pool is its own, not the plan's replica's.
    if inputs.dp == 1 or inputs.model.config.moe is None:
        assert 0 <= plan.device_tokens_per_rank - vllm.plan.device_tokens_per_rank < 16
        failed = {c.name for c in vllm.verdict.failed}
        assert failed <= {c.name for c in verdict.failed}, vllm.lines
    if "--enable-hierarchical-cache" in flags.sglang:
        assert check.fits, check.lines
        asked = plan.host if plan.host.fits else plan.recommended
        if asked.mode != "ratio":
            slack = GB + 2 * inputs.page_size * plan.kv.per_rank
            assert abs(check.host_bytes_per_rank - asked.bytes_per_rank) <= slack
