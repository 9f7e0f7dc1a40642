"""One host copy of KV that several local ranks hold identically (MLA latents on every rank; a KV
head replicated on tp / kv_heads ranks), in shared memory.

Every rank's radix tree and host tier make the same decisions (distributed/bus.py), so the host
page ids agree across ranks and one buffer can serve a group of ranks. The group's first rank
(the writer) copies device pages to it. The others skip their backups, whose bytes are
identical, and load from it. The buffer is a POSIX shared-memory segment in /dev/shm: RAM, not
disk. Its name is unlinked once every rank has mapped it, so a crash leaves nothing behind.

Ordering:
- A load reads pages that a backup of the same step may have just written: the writer finishes
  its backups and every rank meets at a barrier before such a load (`before_load`).
- Across steps, a page is loaded back only after its backup has landed on every rank
  (cache/transfer.py agrees on landings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch


@dataclass
class HostShare:
    writer: bool  # this rank writes the copy; the others only read it
    barrier: Callable[[], None]
    segment: shared_memory.SharedMemory
    nbytes: int
    backed_up: bool = False  # a backup was issued since the last barrier

    def buffer(self) -> torch.Tensor:
        """The segment as bytes, for a PagedKV to view as pages."""
        return torch.frombuffer(self.segment.buf, dtype=torch.uint8, count=self.nbytes)

    def before_load(self, wait_backups: Callable[[], None]) -> None:
        if self.backed_up:
            if self.writer:
                wait_backups()
            self.barrier()
            self.backed_up = False


def open_share(name: str, nbytes: int, writer: bool, barrier: Callable[[], None]) -> HostShare:
    """Called by every rank of the node at once: writers create their group's segment, the
    others map it, then the name is unlinked (the mappings stay)."""
    segment = shared_memory.SharedMemory(name, create=True, size=nbytes) if writer else None
    barrier()
    if segment is None:
        segment = shared_memory.SharedMemory(name)
        # Python < 3.13 registers a mapped segment for removal at exit; the writer owns it.
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    barrier()
    if writer:
        segment.unlink()
    return HostShare(writer, barrier, segment, nbytes)
