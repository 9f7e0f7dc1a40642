"""CPU placement (distributed/placement.py): which cores the ranks' torch threads and the API
process run on, decided once by the node's first process inside the affinity it inherited."""

from __future__ import annotations

import concurrent.futures
import os

import psutil
import pytest

from tests.conftest import Server, eventually, maps_library
from tierserve import cli
from tierserve.distributed.omp_wait import DEFAULT_WAIT, WAIT_VARS
from tierserve.distributed.placement import (
    allowed_cores,
    format_cores,
    plan_placement,
    torch_threads,
)
from tierserve.errors import TierserveError
from tierserve.frontend.grammar_worker import COMPILE_HOLD_ENV


@pytest.mark.parametrize(
    ("cores", "ranks", "serving", "want_ranks", "want_api"),
    [
        # 2 cores, one rank: keeping a core would halve the GEMM threads, so none is kept.
        ((0, 1), 1, True, ((0, 1),), ()),
        ((4, 5, 6, 7), 1, True, ((4, 5, 6),), (7,)),  # inside the inherited set, not from 0
        ((0, 1, 2, 3), 2, True, ((0, 1), (2, 3)), ()),  # a core kept would leave a rank one
        (tuple(range(8)), 2, True, ((0, 1, 2, 3), (4, 5, 6)), (7,)),
        (tuple(range(8)), 2, False, ((0, 1, 2, 3), (4, 5, 6, 7)), ()),  # offline: every core
        ((0, 1), 2, True, ((0,), (1,)), ()),
        ((0, 1), 4, True, ((), (), (), ()), ()),  # more ranks than cores: not pinned
    ],
)
def test_auto_splits_the_inherited_cores_and_keeps_one_for_the_api_only_where_it_pays(
    cores, ranks, serving, want_ranks, want_api
):
    placement = plan_placement("auto", None, ranks, cores, serving)
    assert placement.ranks == want_ranks and placement.api == want_api
    assert placement.spec() == ("nobind" if not any(want_ranks) else
                                "|".join(format_cores(c) for c in want_ranks))  # fmt: skip
    # What the node's first process decided, the others read back unchanged.
    if placement.pinned:
        again = plan_placement(placement.spec(), None, ranks, cores, serving)
        assert again.ranks == placement.ranks and again.api == placement.api


def test_the_off_switch_a_gpu_host_and_a_reserve_given_by_flag():
    assert not plan_placement("nobind", None, 1, (0, 1, 2, 3), True).pinned
    assert not plan_placement("auto", None, 1, (0, 1, 2, 3), True, cpu_host=False).pinned
    reserved = plan_placement("auto", 2, 1, (0, 1, 2, 3), True)
    assert reserved.ranks == ((0, 1),) and reserved.api == (2, 3)
    assert "2 cores kept for the API process" in reserved.describe()


@pytest.mark.parametrize(
    ("bind", "reserved", "says"),
    [
        ("0|3-5", None, "core(s) 4-5 are outside the 0-3 this process may run on"),
        ("0-1|1-2", None, "ranks share a core"),
        ("0-1", None, "gives 1 core list(s) for 2 rank(s)"),
        ("0-x|2", None, "is not a core list like 0-3,8"),
        ("0-|2", None, "'0-' is not a core list like 0-3,8"),  # not core 0
        ("3-1|0", None, "is not a core list like 0-3,8"),
        ("0|1-99999999999", None, "'1-99999999999' names core 99999999999, past any machine's"),
        ("0|\u00b2", None, "is not a core list like 0-3,8"),  # a digit to isdigit(), not to int()
        ("auto", 3, "--cpu-reserved-cores 3 leaves 1 of the 4 cores"),
        ("auto", 9, "--cpu-reserved-cores 9 leaves 0 of the 4 cores"),
        ("auto", -1, "cpu_reserved_cores must be >= 0"),
        ("0|1", 1, "--cpu-reserved-cores shapes --cpu-omp-threads-bind auto"),
        ("nobind", 0, "with nobind it would be ignored"),
    ],
)
def test_lists_and_reserves_that_cannot_be_honoured_are_refused_by_name(bind, reserved, says):
    with pytest.raises(TierserveError) as err:
        plan_placement(bind, reserved, 2, (0, 1, 2, 3), True)
    assert says in err.value.message


@pytest.mark.parametrize(
    ("given", "threads"), [("3", 3), ("", 2), ("0", 2), ("4,2", 2), ("\u00b2", 2)]
)
def test_omp_num_threads_is_a_ranks_thread_count_when_it_is_a_count(monkeypatch, given, threads):
    """As vLLM yields to it; anything else (unset, 0, a nested list, a digit int() cannot
    read) leaves one thread a core."""
    monkeypatch.setenv("OMP_NUM_THREADS", given)
    assert torch_threads(2) == threads


def test_the_start_up_table_shows_the_placement(llama_dir, capsys):
    code = cli.main(["serve", "--model", str(llama_dir), "--device", "cpu", "--dry-run"])
    assert code == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "CPU placement" in line]
    assert f"rank 0: {'core' if len(allowed_cores()) == 1 else 'cores'} " in row, row
    assert format_cores(allowed_cores()) in row and "API process: every core" in row, row


def test_a_served_core_computes_on_its_cores_and_the_api_side_on_the_rest(
    llama_dir, offline, tmp_path
):
    """The engine core on the first inherited core, the API process and the grammar workers it
    starts on the others (every core when there is one only); the tokens are the same. The API
    process serves plain requests without loading torch (~2 CPU-seconds of its start), and
    structured ones too: its compile workers read the tokenizer themselves, while the core
    loads xgrammar beside its loop (held here until it has, before the grammar is compiled)."""
    cores = allowed_cores()
    rest = set(cores[1:]) or set(cores)
    hold = tmp_path / "hold"  # absent: compiles run at once; the worker stays for the next
    flags = ("--max-total-tokens", "2048", "--cpu-omp-threads-bind", str(cores[0]))
    flags += ("--grammar-compile-timeout", "600")  # the held compile's clock runs meanwhile
    with Server(llama_dir, *flags, env={COMPILE_HOLD_ENV: str(hold)}) as server:
        assert server.core.cpu_affinity() == [cores[0]]
        api = psutil.Process(server.proc.pid)
        assert set(api.cpu_affinity()) == rest
        assert all(set(os.sched_getaffinity(t.id)) == rest for t in api.threads())
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}
        got = server.http.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        want = offline.generate([[5, 6, 7, 8]], _greedy(8))[0].token_ids
        assert got["usage"]["completion_tokens"] == 8
        assert not maps_library(api, "libtorch")
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        body = {"prompt": "A", "max_tokens": 4, "response_format": rf}
        hold.touch()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # The reply waits for the held compile: bounded as the compile is, not by a guess
            # at how fast this machine gets there.
            sent = pool.submit(server.http.post, f"{server.url}/v1/completions", json=body,
                               timeout=600)  # fmt: skip
            assert eventually(lambda: any(tmp_path.glob("hold.held.*")), 120)
            assert eventually(lambda: maps_library(server.core, "libxgrammar_bindings"), 120)
            hold.unlink()
            assert sent.result().is_success
        workers = [p for p in api.children() if "grammar_worker" in " ".join(p.cmdline())]
        assert workers and all(set(w.cpu_affinity()) == rest for w in workers)
        assert not maps_library(api, "libtorch")
        ids = server.http.post(
            f"{server.url}/v1/completions",
            json={**body, "prompt": [5, 6, 7, 8], "max_tokens": 8, "response_format": None,
                  "temperature": 0, "return_token_ids": True},
            timeout=120,
        ).json()  # fmt: skip
        assert ids["choices"][0]["token_ids"] == want


def _greedy(n: int):
    from tierserve import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0)


def test_the_engine_core_waits_as_the_user_chose_or_as_tierserve_bounds_it(server):
    """The served engine core's environment: the user's OMP_WAIT_POLICY / GOMP_SPINCOUNT
    where either is set (make test sets PASSIVE), tierserve's bounded spin otherwise; libgomp's
    default spin took the cores a neighbouring server needed."""
    chosen = {k: os.environ[k] for k in WAIT_VARS if k in os.environ}
    want = chosen or DEFAULT_WAIT
    env = server.core.environ()
    assert {k: env[k] for k in WAIT_VARS if k in env} == want


OFFLINE_TP = """
import os, sys, psutil
from tierserve import LLM
llm = LLM(sys.argv[1], tp_size=2, device="cpu", max_total_tokens=1024)
ranks = [p for p in psutil.Process().children() if "tierserve.engine.worker" in p.cmdline()]
print([os.environ.get("GOMP_SPINCOUNT")] + [r.environ().get("GOMP_SPINCOUNT") for r in ranks])
"""


def test_an_offline_engine_and_its_ranks_get_the_bounded_spin_unless_the_user_chose(llama_dir):
    """Offline: set in the LLM's own process before torch loads, and in the ranks it spawns;
    nothing added where the user chose; a warning where torch came first (too late then)."""
    import subprocess
    import sys

    bare = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    run = lambda code, env, *a: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code, *a], env=env, capture_output=True, text=True, timeout=300
    )
    done = run(OFFLINE_TP, bare, str(llama_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    spin = DEFAULT_WAIT["GOMP_SPINCOUNT"]
    assert done.stdout.splitlines()[-1] == str([spin, spin])  # rank 0 (the LLM), rank 1
    late = "import torch, os, tierserve; tierserve.LLM; print(os.environ.get('GOMP_SPINCOUNT'))"
    done = run(late, bare)
    assert done.stdout.split() == ["None"] and "torch was imported before" in done.stderr
    done = run(late, {**bare, "OMP_WAIT_POLICY": "PASSIVE"})
    assert done.stdout.split() == ["None"] and "torch was imported" not in done.stderr
