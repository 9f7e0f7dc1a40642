"""A request's hold on the KV cache, which only the cache manager (manager.py) creates and
updates. Its own module, free of torch: the API process builds requests and never runs the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierserve.cache.radix import RadixNode
    from tierserve.cache.transfer import CopyOp


@dataclass(eq=False)
class KVHandle:
    """A request's hold on the cache."""

    pages: list[int] = field(default_factory=list)
    node: RadixNode | None = None  # deepest locked tree node
    tree_tokens: int = 0  # leading tokens whose pages the tree owns
    computed: int = 0  # leading tokens whose KV is in the device pool
    device_hit: int = 0  # prefix found on the device at admission
    host_nodes: list[RadixNode] = field(default_factory=list)  # prefix found on the host only
    host_hit: int = 0  # tokens of host_nodes
    loaded: bool = False  # the host part is (being) loaded back
    waiting: list[CopyOp] = field(default_factory=list)  # loads its pages still wait for

    @property
    def cached(self) -> int:
        """Prefix tokens the cache supplied at admission (device + loaded host part)."""
        return self.device_hit + (self.host_hit if self.loaded else 0)

    @property
    def ready(self) -> bool:
        """True when every page it reads holds its KV (no load still on the way)."""
        if self.waiting:
            self.waiting = [op for op in self.waiting if not op.readable]
        return not self.waiting
