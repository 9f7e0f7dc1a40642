"""Hierarchical cache: equal outputs with and without the host tier, host hits that happen,
multi-turn reuse, preemption by offload, and start-up sizing that refuses what cannot fit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import once_per_run, random_prompts, serve_cmd, weights_hash
from tierserve import LLM, SamplingParams, TierserveError
from tierserve.engine.kv_plan import startup_table
from tierserve.utils import format_bytes

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
POLICIES = ["write_through", "write_through_selective", "write_back"]


def mixed_workload(llm: LLM) -> list[list[int]]:
    """A prefix used three times (hot enough for selective write-through), a flood that pushes
    it off the device, the prefix again, then two rounds of multi-turn conversations."""
    shared = random_prompts(1, [96], seed=20)[0]
    tails = random_prompts(4, [12], seed=21)
    flood = random_prompts(6, [180], seed=22)
    outs = [llm.generate(shared + t, GREEDY)[0] for t in tails[:3]]
    outs += llm.generate(flood, GREEDY)
    outs += llm.generate(shared + tails[3], GREEDY)
    convs = random_prompts(6, [150], seed=23)
    for r in range(2):
        round_outs = llm.generate(convs, GREEDY)
        outs += round_outs
        questions = random_prompts(6, [6], seed=30 + r)
        convs = [c + o.token_ids + q for c, o, q in zip(convs, round_outs, questions, strict=True)]
    return [o.token_ids for o in outs]


def mixed_workload_reference(run_dir: Path, checkpoint: Path, **config: Any) -> list[list[int]]:
    """`mixed_workload` on one process with `config`, run once for the whole test run (the
    tensor- and data-parallel files compare against the same outputs)."""
    import hashlib

    settings = json.dumps(config, sort_keys=True)
    name = f"mixed-{weights_hash(checkpoint)}-{hashlib.sha256(settings.encode()).hexdigest()[:12]}"

    def compute() -> list[list[int]]:
        with LLM(str(checkpoint), **config) as llm:
            return mixed_workload(llm)

    return once_per_run(run_dir, name, compute)


@pytest.mark.parametrize("page_size", [1, 16])
def test_outputs_equal_and_host_hits_for_every_policy(llama_dir, page_size):
    common = dict(page_size=page_size, max_total_tokens=480, chunked_prefill_size=128)
    reference = mixed_workload(LLM(str(llama_dir), **common))
    for policy in POLICIES:
        llm = LLM(
            str(llama_dir),
            enable_hierarchical_cache=True,
            hicache_ratio=8,
            hicache_write_policy=policy,
            **common,
        )
        assert mixed_workload(llm) == reference, policy
        stats = llm.engine.kv.host.stats
        assert stats.host_hit_tokens > 0, policy
        assert stats.load_backs > 0 and stats.load_back_bytes > 0, policy
        assert stats.host_written_tokens > 0, policy
        llm.engine.check_accounting()


def run_multiturn(llm: LLM, page: int, clients=8, rounds=4, first=400, question=8, out=8):
    convs = random_prompts(clients, [first], seed=40)
    params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
    recomputed = 0
    prev_lens: list[int] = []
    for r in range(rounds):
        outs = llm.generate(convs, params)
        if r >= 1:
            for prev_len, o in zip(prev_lens, outs, strict=True):
                floor = (prev_len + out - 1) // page * page
                if llm.args.enable_hierarchical_cache:
                    assert o.cached_tokens >= floor, (r, o.cached_tokens, floor)
                recomputed += o.prompt_tokens - o.cached_tokens
        prev_lens = [len(c) for c in convs]
        questions = random_prompts(clients, [question], seed=50 + r)
        convs = [c + o.token_ids + q for c, o, q in zip(convs, outs, questions, strict=True)]
    return recomputed


@pytest.mark.parametrize("page_size", [1, 16])
def test_multiturn_rounds_hit_the_host_tier(llama_dir, page_size):
    # 8 conversations grow to ~450 tokens: the device pool holds about a quarter of them.
    pool = 896
    off = LLM(str(llama_dir), page_size=page_size, max_total_tokens=pool)
    on = LLM(
        str(llama_dir),
        page_size=page_size,
        max_total_tokens=pool,
        enable_hierarchical_cache=True,
        hicache_ratio=6,
    )
    without = run_multiturn(off, page_size)
    with_cache = run_multiturn(on, page_size)
    assert with_cache <= 0.10 * without, (with_cache, without)
    stats = on.engine.kv.host.stats
    assert stats.host_hit_tokens > 0
    # Every token loaded back is counted as a host hit of the request that needed it.
    assert stats.host_hit_tokens == stats.load_back_tokens
    on.engine.check_accounting()


def test_preemption_offloads_instead_of_recomputing(llama_dir):
    prompts = random_prompts(10, [60, 140, 90, 200, 30], seed=60)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    common = dict(page_size=16, max_total_tokens=640, chunked_prefill_size=64)
    recompute = LLM(str(llama_dir), **common)
    offload = LLM(str(llama_dir), enable_hierarchical_cache=True, hicache_ratio=4, **common)
    a = recompute.generate(prompts, params)
    b = offload.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    sa, sb = recompute.engine.scheduler.stats, offload.engine.scheduler.stats
    assert sa.num_preemptions > 0 and sb.num_offload_preemptions > 0
    assert sa.num_offload_preemptions == 0
    assert sb.num_recomputed_tokens < sa.num_recomputed_tokens
    offload.engine.check_accounting()


def test_flush_empties_both_tiers(llama_dir):
    llm = LLM(str(llama_dir), max_total_tokens=512, enable_hierarchical_cache=True)
    llm.generate(random_prompts(4, [100], seed=70), GREEDY)
    assert llm.engine.kv.host.used_pages > 0
    llm.engine.flush_cache()
    assert llm.engine.kv.host.used_pages == 0
    assert llm.engine.kv.allocator.num_free == llm.engine.kv.num_pages


# --- sizing ---------------------------------------------------------------------------------


def test_oversized_host_tier_is_refused_with_the_arithmetic(llama_dir):
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), enable_hierarchical_cache=True, hicache_size="100TB")
    message = str(err.value)
    assert "1 rank(s) × 100,000.0 GB = 100,000.0 GB requested" in message
    assert "available" in message and "margin" in message
    assert "use --hicache-size" in message and "--hicache-node-size" in message


def test_serve_exits_2_within_seconds_allocating_nothing(llama_dir):
    start = time.monotonic()
    proc = subprocess.run(
        serve_cmd(llama_dir, "--enable-hierarchical-cache", "--hicache-node-size", "50TB"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "requested" in proc.stderr and "use --hicache-size" in proc.stderr
    assert time.monotonic() - start < 60


def test_auto_size_starts_and_fits(llama_dir):
    llm = LLM(str(llama_dir), enable_hierarchical_cache=True, hicache_size="auto")
    host = llm.engine.kv.host
    assert host.host_pool.num_pages > 0
    llm.generate(random_prompts(2, [40], seed=71), GREEDY)
    llm.engine.check_accounting()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hicache_size": "48XB"}, "hicache_size"),
        ({"hicache_size": "-4GB"}, "hicache_size"),
        ({"hicache_size": "4GB", "hicache_node_size": "8GB"}, "hicache_size"),
        ({"hicache_ratio": 0}, "hicache_ratio"),
        ({"disable_radix_cache": True}, "enable_hierarchical_cache"),
    ],
)
def test_bad_host_flags_are_user_errors(llama_dir, kwargs, field):
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), enable_hierarchical_cache=True, **kwargs)
    assert err.value.field == field


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_one_kv_spec_for_planner_pools_and_startup_table(checkpoints, family, caplog):
    """`tierserve plan`, the start-up table and every pool read one spec object."""
    llm = LLM(str(checkpoints[family]), max_total_tokens=256, enable_hierarchical_cache=True)
    engine = llm.engine
    spec = engine.kv_plan.spec
    assert engine.kv.pool.spec is spec and engine.kv.host.host_pool.spec is spec
    for pool in (engine.kv.pool, engine.kv.host.host_pool):
        assert pool.nbytes == spec.bytes_per_page * pool.num_pages
        assert pool.data[0].numel() * pool.data.element_size() == spec.bytes_per_page
    # The planner's figure for this model and dtype is the same spec's.
    from tierserve.sizing.kv import kv_spec

    planned = kv_spec(engine.model_config, "fp32", tp=1, page_size=spec.page_size)
    assert planned == spec
    assert startup_table(engine.kv_plan).count(format_bytes(spec.bytes_per_token)) == 1


def test_nothing_else_computes_kv_bytes_per_token():
    """Sizes come from sizing/kv.py only: no other product of layers and KV widths."""
    import ast
    from pathlib import Path

    import tierserve

    layers = {"num_layers", "num_hidden_layers"}
    widths = {"head_dim", "kv_lora_rank", "qk_rope_head_dim", "num_kv_heads", "itemsize", "dim"}

    def names(node: ast.AST) -> set[str]:
        found = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                found.add(n.id)
            elif isinstance(n, ast.Attribute):
                found.add(n.attr)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                found.add(n.value)
        return found

    root = Path(tierserve.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).as_posix() == "sizing/kv.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                used = names(node)
                if used & layers and used & widths:
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"enable_hierarchical_cache": True, "hicache_ratio": float("nan")}, "hicache_ratio"),
        ({"enable_hierarchical_cache": True, "hicache_ratio": float("inf")}, "hicache_ratio"),
        ({"enable_hierarchical_cache": True, "hicache_size": "1e400"}, "hicache_size"),
        ({"enable_hierarchical_cache": True, "hicache_size": "0"}, "hicache_size"),
        ({"enable_hierarchical_cache": True, "hicache_node_size": "0GB"}, "hicache_node_size"),
        ({"hicache_size": "5"}, "hicache_size"),  # sized, but the tier is off
        ({"hicache_write_policy": "write_back"}, "hicache_write_policy"),
        ({"max_total_tokens": 10**10}, "max_total_tokens"),  # CPU: more than the RAM
        ({"hicache_io_backend": "direct"}, "hicache_io_backend"),  # the tier is off
        (
            {"enable_hierarchical_cache": True, "hicache_mem_layout": "layer_first"},
            "hicache_mem_layout",
        ),
        ({"num_continuous_decode_steps": 0}, "num_continuous_decode_steps"),
        (
            {"num_continuous_decode_steps": 4, "speculative_algorithm": "NGRAM"},
            "num_continuous_decode_steps",
        ),
    ],
)
def test_start_up_flags_are_checked_before_anything_is_allocated(llama_dir, kwargs, field):
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), **kwargs)
    assert err.value.field == field


def test_a_pool_bigger_than_ram_is_refused_with_what_fits(llama_dir):
    with pytest.raises(TierserveError) as err:
        LLM(str(llama_dir), max_total_tokens=10**10)
    message = str(err.value)
    assert "does not fit in RAM" in message and "margin" in message
    fits = int(message.rsplit("--max-total-tokens ", 1)[1].split()[0])
    assert fits > 0
    LLM(str(llama_dir), max_total_tokens=min(fits, 4096))  # what it suggests starts


@pytest.mark.parametrize(
    "flags",
    [
        ["--enable-hierarchical-cache", "--hicache-ratio", "nan"],
        ["--enable-hierarchical-cache", "--hicache-size", "1e400"],
        ["--enable-hierarchical-cache", "--hicache-size", "1e999999"],  # was exit 1, a traceback
        ["--enable-hierarchical-cache", "--hicache-size", "1KB"],  # "too small", not "does not fit"
        ["--max-total-tokens", "10000000000"],
    ],
)
def test_serve_refuses_bad_sizes_with_one_line_and_status_2(llama_dir, flags):
    proc = subprocess.run(
        serve_cmd(llama_dir, *flags),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    name = flags[-2]  # the flag, in its dashed or its field spelling
    assert len(errors) == 1
    assert name in errors[0] or name.lstrip("-").replace("-", "_") in errors[0]


# The seed's SGLang launch line (shared/seed/), its memory flags as it ran them.
SEED_SGLANG = (
    "--tp-size 8 --mem-fraction-static 0.93 --num-continuous-decode-steps 4 "
    "--disable-custom-all-reduce --enable-hierarchical-cache --hicache-write-policy "
    "write_through --hicache-io-backend kernel --hicache-size 48"
)


def test_the_seeds_sglang_line_starts_tierserve_with_the_plans_verdict(tmp_path, capsys):
    """Pasted as it is, the seed's line is a tierserve command line, and `serve --dry-run`
    gives it the verdict `plan --check-sglang` gives SGLang on this machine's RAM (8 KV heads:
    each of the 8 ranks holds its own host copy in both); `page_first`, the layout tierserve's
    pools have, is taken too."""
    from tests.conftest import make_checkpoint
    from tierserve import cli  # the CLI's own entry point, in this process

    model = make_checkpoint(tmp_path / "m", "llama", num_attention_heads=8, num_key_value_heads=8)
    flags = [*SEED_SGLANG.split(), "--hicache-mem-layout", "page_first"]
    code = cli.main(["serve", "--model", str(model), "--device", "cpu", "--dry-run", *flags])
    served = capsys.readouterr()
    assert code in (0, 2) and "Traceback" not in served.err, served.err
    assert code == 0 or "host cache does not fit" in served.err
    assert cli.main(["plan", "--model", str(model), "--check-sglang", SEED_SGLANG, "--json"]) in (
        0,
        1,
    )
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["kind"] == "sglang_check" and verdict["local_ranks"] == 8
    assert (code == 0) == verdict["fits"], (served.err, verdict["explanation"])


def serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("port", ["70000", "-1", "0", "99999999999999999999"])
def test_a_port_outside_tcps_range_is_refused(llama_dir, port):
    """getaddrinfo took 70000 as 4464 (the server said :70000 and listened elsewhere), -1 as
    a bad --host, and 10**20 as an OverflowError; the dry run passed them all."""
    done = serve("--model", str(llama_dir), "--dry-run", "--port", port)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith(f"--port must be in [1, 65535], got {port}")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        # The start crashed in its warm-up (ZeroDivisionError, exit 1); the dry run passed.
        (["--context-length", "1"], "context_length must be >= 2"),
        # Each passed the dry run, then refused a real start after the weights loaded.
        (["--hidden-states-dir", "FILE"], "is not a directory"),
        (["--hidden-states-dir", "DIR", "--hidden-states-layers", "99"], "must be ids in [0, "),
        (["--host", "999.1.1.1"], "--host '999.1.1.1' does not resolve"),
        # `--api-key "$KEY"` with KEY unset served with no key, over $TIERSERVE_API_KEY too.
        (["--api-key="], "--api-key is empty"),
        (["--served-model-name="], "--served-model-name is empty"),  # served the dir's name
    ],
)  # fmt: skip
def test_the_dry_run_refuses_what_a_start_would(llama_dir, tmp_path, flags, words):
    (tmp_path / "file").write_text("not a directory")
    paths = {"FILE": str(tmp_path / "file"), "DIR": str(tmp_path / "hs")}
    done = serve("--model", str(llama_dir), "--dry-run", *(paths.get(f, f) for f in flags))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert words in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "hs").exists()  # the dry run makes nothing


def test_serve_dry_run_prints_the_plan_and_allocates_nothing(llama_dir, tmp_path):
    ok = serve(
        "--model",
        str(llama_dir),
        "--dry-run",
        "--max-total-tokens",
        "2048",
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "4",
    )
    assert ok.returncode == 0, ok.stderr
    assert "would start" in ok.stdout and "host tier tokens per rank    8,192" in ok.stdout
    # A pool this machine's RAM cannot hold is refused the same way a real start is.
    big = serve("--model", str(llama_dir), "--dry-run", "--max-total-tokens", "10000000000")
    assert big.returncode == 2 and "Traceback" not in big.stderr
    # A checkpoint without tokenizer files: one line naming --tokenizer, not a traceback.
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    bare = serve("--model", str(tmp_path), "--dry-run")
    assert bare.returncode == 2 and "Traceback" not in bare.stderr
    assert "--tokenizer" in bare.stderr.strip().splitlines()[-1]
