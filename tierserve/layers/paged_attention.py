"""The CPU paged attention backend (`--attention-backend cpu`): every sequence of up to
`MAX_KERNEL_QUERIES` new tokens (`MAX_LATENT_QUERIES` for MLA; decode, speculative verification,
prefill spans) attends in one kernel call per layer over the pool's pages as they lie
(layers/kernels/); longer prefill spans go to SDPA as in the torch backend, where the
attention's arithmetic, not its KV reads, is the cost. No decode workspace: nothing is gathered,
padded or kept between steps, so the backend adds no memory to the plan.

The same library fuses a float32 or bf16 model's small per-layer ops (layer_ops.cpp): RMSNorm,
rotary in place, the store of new K and V into their pages and the gated MLP's SiLU x up, each
one call where torch ran several.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierserve.cache import PagedKV
from tierserve.layers import kernels
from tierserve.layers.attention import AttentionBackend, TorchAttention
from tierserve.layers.forward_batch import ForwardBatch, long_tensor
from tierserve.layers.mlp import GatedMLP
from tierserve.layers.norm import RMSNorm
from tierserve.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from tierserve.layers.mla import MLA

# How the kernel reads the pool's bytes (layers/kernels/paged_attention.cpp's KVFormat).
_KV_FORMAT = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


class CPUPagedAttention(TorchAttention):
    # Past this many new tokens SDPA's blocked matmuls catch up with the kernel, which scores
    # only a span's causal half: one 1,024-token prompt took 6.2 ms in both (demo model's
    # head shape, 2 threads), 512 tokens 1.4 ms against SDPA's 2.4. Shorter spans with a
    # cached prefix (a turn added to a conversation) also skip SDPA's gather of the prefix.
    MAX_KERNEL_QUERIES = 1024
    # MLA's latent: a prefill span past decode and verification attends in the expanded form
    # (layers/mla.py's attend_expanded), where every head's keys are narrower than the latent.
    MAX_LATENT_QUERIES = 16

    def __init__(self, pool: PagedKV, num_layers: int) -> None:
        AttentionBackend.__init__(self, pool)  # no decode workspace: the kernel reads pages
        # Start-up (backends.resolve_backend) refused other devices and built the kernel; a
        # rank's own process loads it here.
        kernels.load(build_if_missing=True)
        self.kv_format = _KV_FORMAT[pool.spec.float8()]
        self.workspace = None

    def adopt(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, GatedMLP)):
                module.kernel = True

    def _write(self, layer: int, *parts: torch.Tensor) -> None:
        """The step's new tokens into their pages: one kernel call when they are already in
        the pool's dtype (else the pool converts them: float8 pools, a bf16 pool of a float32
        model)."""
        dtype = self.pool.data.dtype  # parts: K and V, or the latent alone
        if parts[0].dtype == dtype and parts[-1].dtype == dtype:
            k, v = parts[0], parts[1] if len(parts) > 1 else None
            torch.ops.tierserve.kv_write(self.pool.data, layer, self.batch.out_slots, k, v)
        else:
            self.pool.write(layer, self.batch.out_slots, *parts)

    def prepare(self, batch: ForwardBatch) -> None:
        self.batch = batch
        latent = self.pool.spec.kind == "latent"
        limit = self.MAX_LATENT_QUERIES if latent else self.MAX_KERNEL_QUERIES
        rows = [i for i, s in enumerate(batch.spans) if s.q_len <= limit]
        self._prepare_extend([s for s in batch.spans if s.q_len > limit])
        self.short = [batch.spans[i] for i in rows]
        if rows:
            table = batch.table()
            self.table = table if len(rows) == len(batch.spans) else table[rows].contiguous()
            self.q_start = long_tensor([s.q_start for s in self.short])
            self.q_len = long_tensor([s.q_len for s in self.short])
            self.kv_len = long_tensor([s.kv_len for s in self.short])

    def _kernel(
        self,
        layer: int,
        q: torch.Tensor,
        k_part: int,
        v_part: int,
        v_dim: int,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """[tokens, heads, v_dim] in q's dtype; rows of the short spans only. Queries the kernel
        does not take (float16) are attended in float32, the rows converted back."""
        dtype = q.dtype
        q = q if dtype in kernels.ROW_DTYPES else q.float()
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # a row stride of its own is read
            q = q.contiguous()  # as it is (q is a view of the step's packed q, k, v)
        out = q.new_empty(*q.shape[:2], v_dim)
        torch.ops.tierserve.paged_attention(
            q,
            self.pool.data,
            layer,
            k_part,
            v_part,
            v_dim,
            self.table,
            self.q_start,
            self.q_len,
            self.kv_len,
            window or 0,
            scale,
            self.kv_format,
            out,
        )
        return out if out.dtype == dtype else out.to(dtype)  # a no-op .to costs ~2.5 µs

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        self._write(layer, k, v)
        if self.short:
            out = self._kernel(layer, q, 0, 1, q.shape[-1], window, q.shape[-1] ** -0.5)
        else:
            out = torch.empty_like(q)
        if self.extend:
            k, v = self.pool.as_stored(k), self.pool.as_stored(v)
            self._attend_extend(layer, q, k, v, window, out)
        return out

    def forward_latent(
        self, layer: int, mla: MLA, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor
    ) -> torch.Tensor:
        self._write(layer, latent.unsqueeze(1))
        rank = mla.cfg.kv_lora_rank
        if self.short:
            context = self._kernel(
                layer, mla.absorbed_query(q_nope, q_rope), 0, 0, rank, None, mla.cfg.scaling
            )
            out = mla.absorbed_output(context)
        else:
            out = q_nope.new_empty(*q_nope.shape[:2], mla.cfg.v_head_dim)
        if self.extend:
            self._attend_extend_latent(layer, mla, q_nope, q_rope, self.pool.as_stored(latent), out)
        return out
