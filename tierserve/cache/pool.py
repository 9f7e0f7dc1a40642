"""Device KV pool: a fixed number of pages, and the allocator that hands them out.

A token's KV lives at slot `page * page_size + offset`. The pool owns the layout (K and V per
layer for MHA/GQA; an MLA latent pool can be registered beside it): the scheduler, the radix cache
and the tiers speak only of pages and slots, never of tensor shapes.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierserve.errors import TierserveError

logger = logging.getLogger("tierserve")


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

    device: torch.device

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.layer_waiter: Callable[[int], None] | None = None

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @abstractmethod
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V of one layer at `slots`."""

    @abstractmethod
    def gather(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of one layer in `pages` ([..., P]), as [kv_heads, ..., P * page_size, head_dim]."""

    @abstractmethod
    def read_pages(self, pages: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """KV of `pages` (all layers, or one), as one tensor `write_pages` takes back."""

    @abstractmethod
    def write_pages(
        self, pages: torch.Tensor, data: torch.Tensor, layer: int | None = None
    ) -> None: ...

    def wait_layer(self, layer: int) -> None:
        """Block compute on `layer` until a pending load-back into it has landed."""
        if self.layer_waiter is not None:
            self.layer_waiter(layer)


class MHAKVPool(KVPool):
    """K and V for every layer: [layers, 2, kv_heads, slots, head_dim].

    Heads outside slots: a gather yields [kv_heads, tokens, dim] blocks that attention's matmuls
    take as they are, without a transposing copy.
    """

    def __init__(
        self,
        shape: PoolShape,
        num_pages: int,
        page_size: int,
        device: torch.device,
        host_tier: bool = False,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(num_pages, page_size)
        self.shape = shape
        self.device = torch.device(device)
        dims = (shape.num_layers, 2, shape.num_kv_heads, num_pages * page_size, shape.head_dim)
        if host_tier:
            # Only pages written are ever read, so it is not zeroed: on CPU, RAM is committed as
            # the tier fills. Page-locked on CUDA machines, for async copies.
            self.kv = torch.empty(dims, dtype=shape.dtype)
            if pin_memory:
                _page_lock(self.kv)
        else:
            # Padded attention reads unused pages with zero weight; 0 × stale NaN would not be 0.
            self.kv = torch.zeros(dims, dtype=shape.dtype, device=self.device)

    # index_copy_/index_select: several times faster than advanced indexing on CPU.
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer, 0].index_copy_(1, slots, k.transpose(0, 1))
        self.kv[layer, 1].index_copy_(1, slots, v.transpose(0, 1))

    def gather(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Whole pages are copied as blocks: far faster than a row per token.
        heads, dim = self.shape.num_kv_heads, self.shape.head_dim
        out_shape = (heads, *pages.shape[:-1], pages.shape[-1] * self.page_size, dim)
        flat = pages.reshape(-1)
        k, v = (
            self.kv[layer, i]
            .view(heads, self.num_pages, self.page_size * dim)
            .index_select(1, flat)
            .view(out_shape)
            for i in (0, 1)
        )
        return k, v

    def _by_page(self, layer: int | None) -> torch.Tensor:
        """A view with one row per page ([..., pages, page_size * dim]): copies move blocks."""
        kv = self.kv if layer is None else self.kv[layer]
        return kv.view(*kv.shape[:-2], self.num_pages, self.page_size * self.shape.head_dim)

    def read_pages(self, pages: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        view = self._by_page(layer)
        return view.index_select(view.dim() - 2, pages.to(self.kv.device))

    def write_pages(
        self, pages: torch.Tensor, data: torch.Tensor, layer: int | None = None
    ) -> None:
        view = self._by_page(layer)
        data = data.to(self.kv.device, non_blocking=True)
        view.index_copy_(view.dim() - 2, pages.to(self.kv.device), data)

    @property
    def bytes_per_page(self) -> int:
        return self.shape.bytes_per_token * self.page_size


def _page_lock(t: torch.Tensor) -> None:
    """Pin an existing host tensor in place. torch's pinned allocator rounds a block up to a
    power of two (a 300 GB tier would lock 512 GB), past what the start-up check approved."""
    size = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 0)
    if int(err) != 0:  # still correct, only the copies to and from the device are synchronous
        logger.warning("could not page-lock the %d-byte host tier (cuda error %s)", size, err)


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
