"""Linear weights kept quantized: compressed-tensors' pack-quantized int4 / int8, as
llm-compressor writes them and Kimi-K2.5 ships its routed experts.

A quantized linear's `weight` is a `QuantizedWeight`: at load it holds the checkpoint's tensors
as they are (`packed`: int32 words of 32 / bits values along the input features, offset by
2^(bits-1); `scale`: per output row and group; `zero_point`: the asymmetric schemes' offsets,
unpacked by the loader), then `finalize` hands them once to the backend chosen at start-up,
which keeps them in its kernel's layout:

- `int4_cpu`: torch's `_weight_int4pack_mm_for_cpu` (weights repacked once by
  `_convert_weight_to_int4pack_for_cpu`; groups of 32-256; the output features a multiple of
  16). It computes w = (q - 8) * s + z, so an integer zero point zp (stored offset, as the
  checkpoint packs it) becomes z = (8 - zp) * s. It vectorises bf16 activations only (float32
  runs a scalar path 20-80x slower): its GEMMs run in `activation_dtype`, bf16 unless asked.
- `int8_cpu`: torch's `_weight_int8pack_mm`, symmetric int8 with one scale per output row.
- `dequantize`: the weight made dense for each call, then F.linear: the oracle the others are
  checked against, and the path for what no kernel takes (other group sizes, asymmetric int8).

Models do not learn formats: a linear is a linear (layers/parallel.py's `linear` calls the
weight when it is one of these).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tierserve.layers.quant_scheme import QuantScheme

INT4_GROUPS = (32, 64, 128, 256)  # what the int4 CPU kernel takes
REPACK_ROWS = 256  # rows unpacked at a time when a weight is handed to a kernel


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' dense packing undone along the last dimension: value i sits at bit
    i * bits of the row's words (little-endian), offset by 2^(bits-1). Returns the stored,
    unsigned values [..., count] as int32 (0..2^bits - 1)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)[..., :count]


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack_int32`'s inverse for stored (unsigned) values, along the last dimension."""
    per_word = 32 // bits
    pad = (-values.shape[-1]) % per_word
    v = torch.nn.functional.pad(values.to(torch.int32), (0, pad)).reshape(
        *values.shape[:-1], -1, per_word
    )
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=values.device)
    return (v << shifts).sum(-1, dtype=torch.int32)


class QuantizedWeight(nn.Module):
    """A linear's [out_features, in_features] weight, quantized; calling it is x @ weight.T.
    With `experts`, the stacked weights of that many experts ([experts, out, in], as MoE
    layers stack them): `weight[e]` is expert e's, called the same way."""

    # Buffers: the checkpoint's (until `finalize` drops them; `zero_point`: asymmetric only),
    # then the backend's (int4_cpu: int4_packed, scales_zeros; int8_cpu: int8_weight, row_scale).
    packed: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    int4_packed: torch.Tensor
    scales_zeros: torch.Tensor
    int8_weight: torch.Tensor
    row_scale: torch.Tensor

    def __init__(
        self, out_features: int, in_features: int, scheme: QuantScheme, experts: int = 0
    ) -> None:
        super().__init__()
        self.out_features, self.in_features, self.scheme = out_features, in_features, scheme
        self.experts = experts
        # The checkpoint's (out, in), before TP slices.
        self.whole_shape: tuple[int, ...] = (out_features, in_features)
        self.dense_at_load = False  # made a dense tensor after loading (models/quantization.py)
        bits, groups = scheme.num_bits, scheme.groups(in_features)
        words = -(-in_features * bits // 32)
        lead = (experts,) if experts else ()
        self.register_buffer("packed", torch.empty(*lead, out_features, words, dtype=torch.int32))
        self.register_buffer("scale", torch.empty(*lead, out_features, groups))
        if not scheme.symmetric:  # unpacked by the loader: rows split under TP as any other
            zero = torch.empty(*lead, out_features, groups, dtype=torch.int32)
            self.register_buffer("zero_point", zero)
        self.backend = "dequantize"
        # x, an expert (None: the weight is not stacked) → x @ that weight.T
        self._matmul: Callable[[torch.Tensor, int | None], torch.Tensor] = self._dequantized

    def extra_repr(self) -> str:
        stacked = f"{self.experts} experts of " if self.experts else ""
        shape = f"{self.out_features}x{self.in_features}"
        return f"{stacked}{shape} {self.scheme.describe()} {self.backend}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, None)

    def __getitem__(self, expert: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: self._matmul(x, expert)

    # --- after the checkpoint is in -----------------------------------------------------

    def finalize(self, backend: str, activation_dtype: torch.dtype) -> None:
        """Hand the weight to `backend`: its layout kept, the checkpoint's freed."""
        BACKENDS[backend](self, activation_dtype)
        self.backend = backend

    def dense(self, expert: int | None = None) -> torch.Tensor:
        """The weight (one expert's, of a stacked one) dequantized, [out, in], in the scale's
        dtype."""
        s = self.scheme
        pick = (lambda t: t) if expert is None else (lambda t: t[expert])
        q = unpack_int32(pick(self.packed), s.num_bits, self.in_features).to(self.scale.dtype)
        zero: torch.Tensor | float = float(1 << (s.num_bits - 1))
        if not s.symmetric:
            zero = pick(self.zero_point).to(self.scale.dtype)
        scale = pick(self.scale)
        if s.group_size is not None:
            scale = scale.repeat_interleave(s.group_size, dim=-1)
            if isinstance(zero, torch.Tensor):  # asymmetric
                zero = zero.repeat_interleave(s.group_size, dim=-1)
        return (q - zero) * scale

    def _dequantized(self, x: torch.Tensor, expert: int | None) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dense(expert).to(x.dtype))

    def held_bytes(self) -> int:
        """What the backend keeps of this weight."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


def _int4_cpu(w: QuantizedWeight, activation_dtype: torch.dtype) -> None:
    s = w.scheme
    # One weight at a time (an expert's): the unpacked values of all experts at once would be
    # 8x their packed bytes, the peak a load must not reach.
    packed, scales_zeros = [], []
    for i in range(w.experts or 1):
        pick = (lambda t: t) if not w.experts else (lambda t, i=i: t[i])
        words = pick(w.packed)
        # Rows repack alone (checked: equal to the whole), so the int32 values the kernel's
        # repacking takes stay a few rows' worth, not 8x the weight's packed bytes.
        rows = [
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                unpack_int32(words[r : r + REPACK_ROWS], 4, w.in_features).contiguous(), 1
            )
            for r in range(0, w.out_features, REPACK_ROWS)
        ]
        packed.append(torch.cat(rows))
        scale = pick(w.scale).float()
        zero = (8 - pick(w.zero_point).float()) * scale if not s.symmetric else 0 * scale
        # [groups, out, 2] in the activations' dtype, as the kernel reads them.
        pair = torch.stack([scale.t(), zero.t()], dim=-1).to(activation_dtype).contiguous()
        scales_zeros.append(pair)
    _drop(w, "packed", "scale", "zero_point")
    stack = torch.stack if w.experts else (lambda ts: ts[0])
    w.register_buffer("int4_packed", stack(packed))
    w.register_buffer("scales_zeros", stack(scales_zeros))
    group = s.group_size

    def matmul(x: torch.Tensor, expert: int | None) -> torch.Tensor:
        weight, pairs = w.int4_packed, w.scales_zeros
        if expert is not None:
            weight, pairs = weight[expert], pairs[expert]
        flat = x.reshape(-1, x.shape[-1]).to(activation_dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, weight, group, pairs)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)

    w._matmul = matmul


def _int8_cpu(w: QuantizedWeight, activation_dtype: torch.dtype) -> None:
    rows = w.packed.split(REPACK_ROWS, dim=-2)  # as int4's: a few rows' int32 values at a time
    q = torch.cat([(unpack_int32(r, 8, w.in_features) - 128).to(torch.int8) for r in rows], -2)
    scale = w.scale.squeeze(-1).to(activation_dtype).contiguous()
    _drop(w, "packed", "scale")
    w.register_buffer("int8_weight", q.contiguous())
    w.register_buffer("row_scale", scale)

    def matmul(x: torch.Tensor, expert: int | None) -> torch.Tensor:
        weight, scale = w.int8_weight, w.row_scale
        if expert is not None:
            weight, scale = weight[expert], scale[expert]
        flat = x.reshape(-1, x.shape[-1]).to(activation_dtype)
        y = torch.ops.aten._weight_int8pack_mm(flat, weight, scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)

    w._matmul = matmul


def _dequantize(w: QuantizedWeight, activation_dtype: torch.dtype) -> None:
    w._matmul = w._dequantized


def _drop(w: QuantizedWeight, *names: str) -> None:
    for name in names:
        w._buffers.pop(name, None)


BACKENDS: dict[str, Callable[[QuantizedWeight, torch.dtype], None]] = {
    "int4_cpu": _int4_cpu,
    "int8_cpu": _int8_cpu,
    "dequantize": _dequantize,
}


def backend_for(scheme: QuantScheme, out_features: int, device: torch.device) -> tuple[str, str]:
    """The backend a weight of `scheme` gets on `device`, and why not a kernel where it is the
    oracle's (for the start-up table)."""
    if device.type != "cpu":
        return "dequantize", "no GPU kernel measured yet"
    if scheme.num_bits == 4:
        if scheme.group_size not in INT4_GROUPS:
            return "dequantize", f"the int4 kernel takes groups of {INT4_GROUPS}"
        if out_features % 16:
            return "dequantize", "the int4 kernel takes output features in multiples of 16"
        return "int4_cpu", ""
    if scheme.num_bits == 8 and scheme.group_size is None and scheme.symmetric:
        return "int8_cpu", ""
    return "dequantize", "the int8 kernel takes symmetric per-channel scales only"


def kernel_activations(backend: str, activations: str) -> torch.dtype | None:
    """What `backend`'s GEMMs take in under `--quantized-activations` (`activations`): bf16 for
    the int4 kernel under `auto` (its only vectorised path); None: the model's dtype."""
    return torch.bfloat16 if backend == "int4_cpu" and activations == "auto" else None


def finalize_quantized(
    model: nn.Module, device: torch.device, activations: str
) -> list[tuple[str, str, str]]:
    """Every quantized weight of `model` handed to its backend, its GEMMs taking what
    `kernel_activations` says; the (scheme, backend, why) of each kind met, for the log."""
    kinds: dict[tuple[str, str, str], None] = {}
    for module in model.modules():
        if not isinstance(module, QuantizedWeight):
            continue
        backend, why = backend_for(module.scheme, module.out_features, device)
        module.finalize(backend, kernel_activations(backend, activations) or module.scale.dtype)
        kinds[(module.scheme.describe(), backend, why)] = None
    return list(kinds)


def held_bytes(
    scheme: QuantScheme, out_features: int, in_features: int, backend: str,
    itemsize: int, activation_itemsize: int, experts: int = 1,
) -> int:  # fmt: skip
    """What `backend` keeps of such a weight (`finalize`'s layout), without making it: the
    figure start-up, `--dry-run` and `plan` count. `itemsize`: the model dtype's (a kept
    checkpoint scale's), `activation_itemsize`: the kernel's scales'."""
    n, k, groups = out_features, in_features, scheme.groups(in_features)
    if backend == "int4_cpu":  # two values a byte; a scale and a zero a group and row
        return experts * (n * k // 2 + groups * n * 2 * activation_itemsize)
    if backend == "int8_cpu":
        return experts * (n * k + n * activation_itemsize)
    words = -(-k * scheme.num_bits // 32)
    zero = 0 if scheme.symmetric else n * groups * 4
    return experts * (n * words * 4 + n * groups * itemsize + zero)
