"""Paged KV buffers (one per tier) and the allocator that hands out their pages.

Layout, the same in every tier and stable for kernels and stores to rely on:

    buffer = [num_pages, layers, parts, heads, page_size, dim], C-contiguous, spec.torch_dtype()

Page p is the contiguous block `buffer[p]` of `spec.bytes_per_page` bytes: layer by layer; in a
layer K before V (parts = 2) or the one MLA latent (parts = 1); then head, token offset, dim.
Heads before tokens: one head's tokens of a page are one `page_size × dim` run, so a gather
yields `[heads, tokens, dim]` blocks that attention's matmuls take without a transposing copy.
A token's slot is `page * page_size + offset`. Moving a page to another tier, process, file or
store is one contiguous copy of its block; attention reads per-layer views of the same memory.
"""

from __future__ import annotations

import logging

import torch

from tierserve.errors import TierserveError
from tierserve.sizing import KVSpec

logger = logging.getLogger("tierserve")


class PagedKV:
    """`num_pages` pages of `spec` on one device."""

    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        device: torch.device,
        host_tier: bool = False,
        pin_memory: bool = False,
        compute_dtype: torch.dtype | None = None,
        buffer: torch.Tensor | None = None,
    ) -> None:
        """`buffer`: host-tier bytes to lay the pages over (a shared-memory segment)."""
        self.spec = spec
        # Attention computes in the model's dtype whatever the pool stores (fp8 KV: bytes of
        # float8 values, no scale, as SGLang's and vLLM's default fp8 KV without k/v scales).
        self.compute_dtype = compute_dtype or spec.torch_dtype()
        self._float8 = spec.float8()
        self.lossy = self._float8 is not None or self.compute_dtype != spec.torch_dtype()
        self.num_pages = num_pages
        self.page_size = spec.page_size
        self.device = torch.device(device)
        dims = (num_pages, *spec.page_shape)
        if host_tier:
            # Only pages written are ever read, so it is not zeroed: on CPU, RAM is committed as
            # the tier fills. Page-locked on CUDA machines, for async copies.
            if buffer is None:
                self.data = torch.empty(dims, dtype=spec.torch_dtype())
            else:
                self.data = buffer.view(spec.torch_dtype()).view(dims)
            if pin_memory:
                _page_lock(self.data)
        else:
            # Padded attention reads unused pages with zero weight; 0 × stale NaN would not be 0.
            self.data = torch.zeros(dims, dtype=spec.torch_dtype(), device=self.device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    # --- layout-neutral page I/O ------------------------------------------------------------

    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Whole pages as `[len(pages), *spec.page_shape]`, a copy `write_pages` takes back."""
        return self.data.index_select(0, pages.to(self.data.device))

    def write_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        self.data.index_copy_(0, pages.to(self.data.device), data.to(self.data.device))

    def page_bytes(self, pages: list[int]) -> list[bytes]:
        """Each page's block as bytes (what a store keeps), in `pages` order."""
        block = self.read_pages(torch.tensor(pages, dtype=torch.long)).cpu()
        raw = block.view(torch.uint8).reshape(len(pages), -1).numpy()
        return [row.tobytes() for row in raw]

    def write_page_bytes(self, pages: list[int], payloads: list[bytes]) -> None:
        """`page_bytes`' inverse."""
        raw = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        block = raw.view(self.data.dtype).view(len(pages), *self.spec.page_shape)
        self.write_pages(torch.tensor(pages, dtype=torch.long), block)

    # --- per-layer views for attention ------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, *parts: torch.Tensor) -> None:
        """Store new tokens of one layer: one `[tokens, heads, dim]` tensor per part (K, V; or
        the latent as `[tokens, 1, dim]`)."""
        page, offset = slots // self.page_size, slots % self.page_size
        view = self.data[:, layer]
        for i, x in enumerate(parts):
            view[:, i][page, :, offset] = self._stored(x)

    def gather(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """One layer of `pages` ([..., P]) as `[parts, heads, ..., P * page_size, dim]`, in the
        compute dtype."""
        spec = self.spec
        rows = self.data[:, layer].view(self.num_pages, spec.parts, spec.heads, -1)
        out = rows.permute(1, 2, 0, 3).index_select(2, pages.reshape(-1))
        tokens = (*pages.shape[:-1], pages.shape[-1] * self.page_size)
        return self._loaded(out.view(spec.parts, spec.heads, *tokens, spec.dim))

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as attention will read it back from this pool (rounded to the stored dtype), so
        fresh tokens and cached ones look the same whichever path a request takes."""
        return self._loaded(self._stored(x)) if self.lossy else x

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        if self._float8 is not None:  # torch's CPU index_put has no float8 kernel: bytes
            # Saturate, as e4m3's cast already does: e5m2 would turn large values into inf.
            top = torch.finfo(self._float8).max
            return x.clamp(-top, top).to(self._float8).view(torch.uint8)
        return x.to(self.data.dtype)

    def _loaded(self, x: torch.Tensor) -> torch.Tensor:
        if self._float8 is not None:
            x = x.view(self._float8)
        return x.to(self.compute_dtype)


def _page_lock(t: torch.Tensor) -> None:
    """Pin an existing host tensor in place. torch's pinned allocator rounds a block up to a
    power of two (a 300 GB tier would lock 512 GB), past what the start-up check approved."""
    size = t.numel() * t.element_size()
    cudart = torch.cuda.cudart()
    assert cudart is not None  # cudart() has raised where CUDA's runtime is missing
    err = cudart.cudaHostRegister(t.data_ptr(), size, 0)
    if int(err) != 0:  # still correct, only the copies to and from the device are synchronous
        logger.warning("could not page-lock the %d-byte host tier (cuda error %s)", size, err)


class PageAllocator:
    """Free list of page ids 0..num_pages-1, reused LIFO for cache locality; a batch comes out
    in ascending order, so a run of pages freed together is one contiguous copy later."""

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
        taken.reverse()
        return taken

    def free(self, pages: list[int]) -> None:
        if len(self._free) + len(pages) > self.num_pages:
            raise RuntimeError("page freed twice: allocator holds more pages than exist")
        self._free.extend(reversed(pages))


def check_pool_size(max_total_tokens: int, page_size: int) -> int:
    num_pages = max_total_tokens // page_size
    if num_pages < 1:
        raise TierserveError(
            f"max_total_tokens {max_total_tokens} holds no page of {page_size} tokens",
            field="max_total_tokens",
        )
    return num_pages
