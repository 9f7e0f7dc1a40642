"""Which CPU cores each of a node's processes computes on: its ranks' torch threads, and the
API process with what it starts (grammar workers, tokenization), inside the affinity the
node's first process inherited (`taskset`, a container's cpuset, a test worker's).

The flags carry vLLM's CPU semantics under names of our own: `--cpu-omp-threads-bind` is its
VLLM_CPU_OMP_THREADS_BIND (`auto`, `nobind`, or one core list per local rank, `0-3|4-7`) and
`--cpu-reserved-cores` its VLLM_CPU_NUM_OF_RESERVED_CPU (cores kept from the ranks for the API
process). The decision is made once, by the node's first process, and travels to the others
as an explicit list in the engine args, so a rank spawned by a pinned rank 0 does not mistake
rank 0's cores for the node's.

`auto` on a CPU-only host: the ranks split the cores in contiguous runs; one core is kept for
the API process only when the ranks keep at least two each, because on this project's 2-core
machine keeping one halved the engine's GEMM threads and 64 served streams ran at 0.75×
(docs/cpu-placement.md); more ranks than cores are not pinned (one thread each), never
refused. On a GPU host `auto` pins nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tierserve.args import EngineArgs
from tierserve.errors import TierserveError

AUTO, NOBIND = "auto", "nobind"
FIELD = "cpu_omp_threads_bind"


@dataclass(frozen=True)
class Placement:
    ranks: tuple[tuple[int, ...], ...]  # each local rank's cores; () = not pinned
    api: tuple[int, ...]  # the API process's cores; () = every core the node has
    cores: int  # how many the node's first process may use
    why: str  # what the start-up table says of the choice

    @property
    def pinned(self) -> bool:
        return any(self.ranks)

    def spec(self) -> str:
        """The decision as `--cpu-omp-threads-bind` spells it, for the node's other processes."""
        if not self.pinned:
            return NOBIND
        return "|".join(format_cores(cores) for cores in self.ranks)

    def describe(self) -> str:
        if not self.pinned:
            threads = torch_threads(max(1, self.cores // len(self.ranks)))
            return f"not pinned, {_count(threads, 'torch thread')} a rank ({self.why})"
        ranks = "; ".join(
            f"rank {i}: {_cores(c)} ({_count(torch_threads(len(c)), 'thread')})"
            for i, c in enumerate(self.ranks)
        )
        api = _cores(self.api) if self.api else "every core (shared)"
        return f"{ranks}; API process: {api} ({self.why})"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _cores(cores: Sequence[int]) -> str:
    return f"core{'' if len(cores) == 1 else 's'} {format_cores(cores)}"


def allowed_cores() -> tuple[int, ...]:
    """The cores this process may run on, as it inherited them."""
    return tuple(sorted(os.sched_getaffinity(0)))


def plan_placement(
    bind: str,
    reserved: int | None,
    local_ranks: int,
    allowed: Sequence[int],
    serving: bool,
    cpu_host: bool = True,
) -> Placement:
    """The node's placement. `serving`: an API process shares the node (it may get reserved
    cores); the offline LLM's ranks take every core."""
    allowed = tuple(sorted(allowed))
    if reserved is not None and reserved < 0:
        message = f"cpu_reserved_cores must be >= 0, got {reserved}"
        raise TierserveError(message, "cpu_reserved_cores")
    if reserved is not None and (bind != AUTO or not cpu_host):
        raise TierserveError(
            "--cpu-reserved-cores shapes --cpu-omp-threads-bind auto on a CPU-only host; "
            f"with {bind if bind != AUTO else 'a GPU'} it would be ignored (with lists, the "
            "cores no rank takes go to the API process)",
            "cpu_reserved_cores",
        )
    if bind == NOBIND or (bind == AUTO and not cpu_host):
        why = "--cpu-omp-threads-bind nobind" if bind == NOBIND else "a GPU host"
        return _unpinned(allowed, local_ranks, why)
    if bind != AUTO:
        return _explicit(bind, local_ranks, allowed)
    if local_ranks > len(allowed):
        why = f"{local_ranks} ranks on {len(allowed)} cores"
        return _unpinned(allowed, local_ranks, why)
    keep = reserved
    if keep is None:
        keep = 1 if serving and len(allowed) - 1 >= 2 * local_ranks else 0
    if len(allowed) - keep < local_ranks:
        raise TierserveError(
            f"--cpu-reserved-cores {keep} leaves {max(0, len(allowed) - keep)} of the "
            f"{len(allowed)} cores this process may use for {local_ranks} rank(s)",
            "cpu_reserved_cores",
        )
    engine, api = allowed[: len(allowed) - keep], allowed[len(allowed) - keep :]
    ranks = _split(engine, local_ranks)
    if keep:
        why = f"auto: {_count(keep, 'core')} kept for the API process"
    elif serving:
        why = f"auto: {_count(len(allowed), 'core')}, none kept for the API process"
    else:
        why = "auto: every core to the ranks"
    return Placement(ranks, api, len(allowed), why)


def torch_threads(cores: int) -> int:
    """A rank's torch threads on `cores` cores: one a core, unless OMP_NUM_THREADS says (as
    vLLM, which also yields to it)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdecimal() and int(given) > 0 else cores


def resolve_placement(args: EngineArgs, serving: bool) -> tuple[EngineArgs, Placement]:
    """The node's placement, decided by its first process, and the args that carry it to the
    node's other processes (an explicit list, or nobind)."""
    placement = plan_placement(
        args.cpu_omp_threads_bind,
        args.cpu_reserved_cores,
        args.local_ranks,
        allowed_cores(),
        serving,
        cpu_host=not _cuda(args.device),
    )
    return args.replace(cpu_omp_threads_bind=placement.spec()), placement


@dataclass(frozen=True)
class Pinned:
    """What pinning a rank changed in its process, put back when its engine closes (the
    offline LLM's rank 0 is the user's process)."""

    cores: tuple[int, ...]
    threads: int

    def release(self) -> None:
        import torch  # here, not above: the API process pins itself without loading torch

        pin(self.cores)
        torch.set_num_threads(self.threads)


def pin_rank(args: EngineArgs, local_rank: int) -> Pinned:
    """This process, one of the node's ranks, on its cores with one torch thread per core, as
    resolved args say. Unpinned ranks share the cores a thread each apiece (more threads than
    cores only contend); a single unpinned rank keeps torch's threads as they were."""
    import torch

    before = Pinned(allowed_cores(), torch.get_num_threads())
    bind = args.cpu_omp_threads_bind
    if bind in (AUTO, NOBIND):
        if args.local_ranks > 1:
            torch.set_num_threads(torch_threads(max(1, len(before.cores) // args.local_ranks)))
        return before
    cores = _parse_lists(bind, args.local_ranks)[local_rank]
    if set(cores) != set(before.cores):  # one rank on every core: nothing to change
        pin(cores)
    if torch_threads(len(cores)) != before.threads:
        torch.set_num_threads(torch_threads(len(cores)))
    return before


def pin(cores: Sequence[int]) -> None:
    """Every thread of this process, and what it starts from now on, on `cores` (a thread
    that exits meanwhile is skipped)."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            continue


# Device nodes without which no GPU is visible (NVIDIA's; ROCm's, which torch.cuda also drives).
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


def _cuda(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    # Without a GPU's device node torch sees none either, and is not loaded to be told so:
    # an engine core places its ranks before its torch loads (node_start.py).
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return False
    import torch

    return torch.cuda.is_available()


def format_cores(cores: Sequence[int]) -> str:
    """`0-3,8` for (0, 1, 2, 3, 8)."""
    runs: list[str] = []
    start = prev = None
    for core in [*sorted(cores), None]:
        if core is not None and prev is not None and core == prev + 1:
            prev = core
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = core
    return ",".join(runs)


# A core or a range of them, in ASCII digits: str.isdigit() also takes "²", which int() refuses.
CORE_RUN = re.compile(r"([0-9]+)(?:-([0-9]+))?")
# Past any machine's core ids (Linux's NR_CPUS is at most 8192): a list naming more is a typo,
# and "0-99999999999" would otherwise be spelt out core by core.
MAX_CORE_ID = 1 << 16


def parse_cores(text: str) -> tuple[int, ...]:
    cores: list[int] = []
    for part in text.split(","):
        run = CORE_RUN.fullmatch(part.strip())  # "0-" is none
        if run is None or int(run[2] or run[1]) < int(run[1]):  # or a backwards one, "3-1"
            raise TierserveError(
                f"--cpu-omp-threads-bind: {text!r} is not a core list like 0-3,8", FIELD
            )
        lo, hi = int(run[1]), int(run[2] or run[1])
        if hi >= MAX_CORE_ID:
            raise TierserveError(
                f"--cpu-omp-threads-bind: {text!r} names core {hi}, past any machine's", FIELD
            )
        cores += range(lo, hi + 1)
    return tuple(sorted(set(cores)))


def _parse_lists(bind: str, local_ranks: int) -> tuple[tuple[int, ...], ...]:
    bind = str(bind)  # LLM(cpu_omp_threads_bind=5) means core 5, as the flag "5" does
    lists = tuple(parse_cores(part) for part in bind.split("|"))
    if len(lists) != local_ranks:
        raise TierserveError(
            f"--cpu-omp-threads-bind {bind!r} gives {len(lists)} core list(s) for "
            f"{local_ranks} rank(s) on this node: one list per rank, separated by |",
            FIELD,
        )
    return lists


def _explicit(bind: str, local_ranks: int, allowed: tuple[int, ...]) -> Placement:
    ranks = _parse_lists(bind, local_ranks)
    taken = [core for cores in ranks for core in cores]
    outside = sorted(set(taken) - set(allowed))
    if outside:
        raise TierserveError(
            f"--cpu-omp-threads-bind {bind!r}: core(s) {format_cores(outside)} are outside "
            f"the {format_cores(allowed)} this process may run on",
            FIELD,
        )
    if len(taken) != len(set(taken)):
        raise TierserveError(f"--cpu-omp-threads-bind {bind!r}: ranks share a core", FIELD)
    api = tuple(core for core in allowed if core not in taken)
    why = "--cpu-omp-threads-bind" + (", the other cores to the API process" if api else "")
    return Placement(ranks, api, len(allowed), why)


def _unpinned(allowed: tuple[int, ...], local_ranks: int, why: str) -> Placement:
    return Placement(((),) * local_ranks, (), len(allowed), why)


def _split(cores: tuple[int, ...], parts: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous runs, the first ones a core longer when they do not divide evenly."""
    size, extra = divmod(len(cores), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(cores[at : at + n])
        at += n
    return tuple(out)
