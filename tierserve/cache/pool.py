"""Device KV pool: a fixed number of pages, and the allocator that hands them out.

A token's KV lives at slot `page * page_size + offset`. The pool owns the layout (K and V per
layer for MHA/GQA; an MLA latent pool can be registered beside it): the scheduler, the radix cache
and the tiers speak only of pages and slots, never of tensor shapes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierserve.errors import TierserveError


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


class KVPool(ABC):
    """Paged KV storage. Subclasses choose the per-token layout."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @abstractmethod
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V of one layer at `slots`."""

    @abstractmethod
    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of one layer at `slots` (any shape), as [*slots.shape, kv_heads, head_dim]."""

    @abstractmethod
    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """All layers' KV of `pages`, as one tensor that `write_pages` takes back (tier copies)."""

    @abstractmethod
    def write_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None: ...


class MHAKVPool(KVPool):
    """K and V for every layer: [layers, 2, slots, kv_heads, head_dim]."""

    def __init__(
        self, shape: PoolShape, num_pages: int, page_size: int, device: torch.device
    ) -> None:
        super().__init__(num_pages, page_size)
        self.shape = shape
        self.kv = torch.zeros(
            shape.num_layers,
            2,
            num_pages * page_size,
            shape.num_kv_heads,
            shape.head_dim,
            dtype=shape.dtype,
            device=device,
        )

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer, 0, slots] = k
        self.kv[layer, 1, slots] = v

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0, slots], self.kv[layer, 1, slots]

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, device=pages.device)
        return (pages[:, None] * self.page_size + offsets).flatten()

    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        return self.kv[:, :, self._page_slots(pages)]

    def write_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        self.kv[:, :, self._page_slots(pages)] = data


POOLS: dict[str, Callable[..., KVPool]] = {"mha": MHAKVPool}


class PageAllocator:
    """Free list of page ids. Page 0.. num_pages-1; order of reuse is LIFO for cache locality."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken

    def free(self, pages: list[int]) -> None:
        if len(self._free) + len(pages) > self.num_pages:
            raise RuntimeError("page freed twice: allocator holds more pages than exist")
        self._free.extend(pages)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def check_pool_size(max_total_tokens: int, page_size: int) -> int:
    num_pages = max_total_tokens // page_size
    if num_pages < 1:
        raise TierserveError(
            f"max_total_tokens {max_total_tokens} holds no page of {page_size} tokens",
            field="max_total_tokens",
        )
    return num_pages
