"""The one path by which KV pages cross tiers. CPU and CUDA differ only inside it.

On CUDA the host pool is pinned, copies are non_blocking on a side stream, and a load-back
records one event per layer, so layer i's attention waits only for layer i's pages. On CPU the
same calls are plain vectorised copies and the waits are no-ops.
"""

from __future__ import annotations

import torch

from tierserve.cache.pool import KVPool


class KVTransfer:
    def __init__(self, device_pool: KVPool, host_pool: KVPool, num_layers: int) -> None:
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.num_layers = num_layers
        self.cuda = torch.cuda.is_available() and device_pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(device_pool.device) if self.cuda else None
        self._layer_ready: list[torch.cuda.Event] = []
        device_pool.layer_waiter = self.wait_layer

    def to_host(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Back pages up; returns once the copy is done, so the device pages may be freed."""
        src, dst = _index(device_pages), _index(host_pages)
        if self.stream is None:
            self.host_pool.write_pages(dst, self.device_pool.read_pages(src))
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # the KV must be computed first
        with torch.cuda.stream(self.stream):
            staged = self.device_pool.read_pages(src).to("cpu", non_blocking=True)
        self.stream.synchronize()
        self.host_pool.write_pages(dst, staged)

    def to_device(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Load pages back layer by layer; compute on a layer waits for its own event."""
        src, dst = _index(host_pages), _index(device_pages)
        if self.stream is None:
            self.device_pool.write_pages(dst, self.host_pool.read_pages(src))
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # target pages may still be read
        self._layer_ready = []
        with torch.cuda.stream(self.stream):
            for layer in range(self.num_layers):
                staged = self.host_pool.read_pages(src, layer).pin_memory()
                self.device_pool.write_pages(dst, staged, layer)
                event = torch.cuda.Event()
                event.record(self.stream)
                self._layer_ready.append(event)

    def wait_layer(self, layer: int) -> None:
        if layer < len(self._layer_ready):
            torch.cuda.current_stream().wait_event(self._layer_ready[layer])
            if layer == self.num_layers - 1:
                self._layer_ready = []


def _index(pages: list[int]) -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.long)
