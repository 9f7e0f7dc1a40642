"""The model's side of a quantized checkpoint (its config: models/quant_config.py): linears
given `QuantizedWeight`s before anything is allocated, the checkpoint's tensors streamed in as
the model names them, their declared shapes checked, and the sizes a backend will hold."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import cast

import torch
from torch import nn

from tierserve.errors import TierserveError
from tierserve.layers import (
    ColumnParallelLinear,
    Experts,
    PackedColumnLinear,
    ParallelLMHead,
    QuantizedWeight,
    QuantScheme,
    RowParallelLinear,
    backend_for,
    held_bytes,
    kernel_activations,
    mark_shard,
    unpack_int32,
)
from tierserve.models.quant_config import QuantConfig, refused

# A quantized linear's checkpoint tensors, named in the model as QuantizedWeight's buffers
# (`weight_shape` is checked by the loader and consumed).
_QUANT_KEY = re.compile(r"^(.*)\.weight_(packed|scale|zero_point)$")
SHAPE_SUFFIX = ".weight_shape"
LINEAR_KINDS = (ColumnParallelLinear, PackedColumnLinear, RowParallelLinear, ParallelLMHead)


def quantize_modules(model: nn.Module, quant: QuantConfig) -> None:
    """Give each linear the checkpoint quantizes a `QuantizedWeight` in place of its dense
    weight (on the meta device, before anything is allocated)."""
    for prefix, module in list(model.named_modules()):
        if isinstance(module, Experts):
            _quantize_experts(module, prefix, quant)
            continue
        if not isinstance(module, LINEAR_KINDS):
            continue
        scheme = _scheme_of(module, prefix, quant)
        if scheme is None:
            continue
        out_features, in_features = module.weight.shape
        weight = QuantizedWeight(out_features, in_features, scheme).to(module.weight.device)
        shard = getattr(module, "tp_shards", {}).pop("weight", None)
        if shard is not None:
            _shard_buffers(weight, shard, prefix)
        # Read as a tensor elsewhere (MLA's kv_b_proj, folded into queries and outputs): loaded
        # quantized, then made dense once (`densify`); llm-compressor's recipes quantize it.
        weight.dense_at_load = getattr(module, "keep_dense", False)
        del module.weight
        # A module where nn.Linear declares a Tensor (PackedColumnLinear.checkpoint_keys and
        # layers/cpu_linear.py's `linear` take either).
        cast(nn.Module, module).weight = weight


def densify(model: nn.Module, dtype: torch.dtype) -> None:
    """The quantized weights read as tensors (`dense_at_load`) made dense parameters."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight) and weight.dense_at_load:
            module.weight = nn.Parameter(weight.dense().to(dtype), requires_grad=False)


def _quantize_experts(experts: Experts, prefix: str, quant: QuantConfig) -> None:
    """A MoE layer's stacked experts (gate/up packed, down), quantized as the checkpoint's
    expert 0 is (its experts are quantized alike, or the config says nothing of them)."""
    scheme = _one_scheme([f"{prefix}.0.{proj}_proj" for proj in ("gate", "up", "down")], quant)
    if scheme is None:
        return
    for param in ("gate_up_proj", "down_proj"):
        count, out_features, in_features = getattr(experts, param).shape
        weight = QuantizedWeight(out_features, in_features, scheme, experts=count)
        weight = weight.to(getattr(experts, param).device)
        _shard_buffers(weight, experts.tp_shards.pop(param), f"{prefix}.{param}")
        delattr(experts, param)
        setattr(experts, param, weight)


def _scheme_of(module: nn.Module, prefix: str, quant: QuantConfig) -> QuantScheme | None:
    """A packed linear (q/k/v, gate/up) is quantized when all its parts are, alike."""
    parent = prefix.rpartition(".")[0]
    names = (
        [f"{parent}.{p.name}" if parent else p.name for p in module.parts]
        if isinstance(module, PackedColumnLinear)
        else [prefix]
    )
    return _one_scheme(names, quant)


def _one_scheme(names: list[str], quant: QuantConfig) -> QuantScheme | None:
    """The scheme of linears tierserve holds as one weight; refused where they differ."""
    schemes = {quant.scheme_for(n) for n in names}
    if len(schemes) > 1:
        message = f"{', '.join(names)} are quantized unlike each other; tierserve packs them"
        raise refused(message)
    return schemes.pop()


def _shard_buffers(weight: QuantizedWeight, shard: tuple[int, int, int], name: str) -> None:
    """A tensor-parallel slice of a quantized weight: rows split as the dense weight's
    (packed, scale, zero point alike); columns (a row-parallel linear's input) on whole groups
    and whole int32 words, refused with the arithmetic otherwise."""
    dim, index, count = shard
    out_features, in_features = weight.out_features, weight.in_features
    s = weight.scheme
    whole = [out_features, in_features]
    whole[dim] *= count
    weight.whole_shape = tuple(whole)
    if dim == -1:
        per_word = 32 // s.num_bits
        group = s.group_size or whole[1]
        if in_features % per_word or (s.group_size and in_features % group):
            message = (
                f"{name}: its {whole[1]} input features split over {count} ranks are "
                f"{in_features} a rank, not a whole number of {s.describe()} groups of "
                f"{group} (and int32 words of {per_word})"
            )
            raise TierserveError(message, field="tp_size")
        mark_shard(weight, "packed", -1, index, count)
        if s.group_size is not None:
            mark_shard(weight, "scale", -1, index, count)
            if not s.symmetric:
                mark_shard(weight, "zero_point", -1, index, count)
        return
    for buffer in ("packed", "scale", "zero_point"):
        if buffer != "zero_point" or not s.symmetric:
            mark_shard(weight, buffer, -2, index, count)


def model_key(name: str) -> str:
    """A checkpoint tensor's model name: `x.weight_packed` is `x.weight.packed`."""
    match = _QUANT_KEY.match(name)
    return f"{match[1]}.weight.{match[2]}" if match else name


def read_quantized(
    tensors: Iterable[tuple[str, torch.Tensor]], quant: QuantConfig, declared: dict[str, list]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's stream as the model takes it: each `weight_shape` kept in `declared`
    (by module name) for `check_declared`, each asymmetric zero point unpacked
    (compressed-tensors packs it along the output rows, which a packed q/k/v or a
    tensor-parallel slice cuts) to [rows, groups], rows from the module's weight_shape."""
    held: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(SHAPE_SUFFIX):
            module = name.removesuffix(SHAPE_SUFFIX)
            declared[module] = tensor.tolist()
            if module in held:
                yield (
                    model_key(module + ".weight_zero_point"),
                    _unpack_zero(held.pop(module), quant, module, declared[module][0]),
                )
            continue
        if name.endswith(".weight_zero_point"):
            module = name.removesuffix(".weight_zero_point")
            if module not in declared:  # its rows come with weight_shape, later in the shard
                held[module] = tensor
                continue
            tensor = _unpack_zero(tensor, quant, module, declared[module][0])
        yield model_key(name), tensor
    for module, tensor in held.items():  # no weight_shape: refused by check_declared
        yield model_key(module + ".weight_zero_point"), tensor


def _unpack_zero(tensor: torch.Tensor, quant: QuantConfig, module: str, rows: int) -> torch.Tensor:
    scheme = quant.scheme_for(module)
    bits = scheme.num_bits if scheme is not None else 4
    return unpack_int32(tensor.t().contiguous(), bits, rows).t().contiguous()


def check_declared(model: nn.Module, declared: Mapping[str, list]) -> None:
    """Each quantized linear's checkpoint `weight_shape` (each part's, for a packed one)
    against the model's: a weight packed for other features is refused by name."""
    for prefix, module in model.named_modules():
        if isinstance(module, Experts) and isinstance(module.down_proj, QuantizedWeight):
            _check_experts(module, prefix, declared)
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, QuantizedWeight):
            continue
        parent = prefix.rpartition(".")[0]
        if isinstance(module, PackedColumnLinear):  # each part whole, as the checkpoint has it
            parts = [(f"{parent}.{p.name}" if parent else p.name,
                      (p.rows.stop - p.rows.start) * p.shards) for p in module.parts]  # fmt: skip
        else:
            parts = [(prefix, weight.whole_shape[0])]
        for name, rows in parts:
            _check_shape(name, declared, [rows, weight.whole_shape[1]])


def _check_experts(experts: Experts, prefix: str, declared: Mapping[str, list]) -> None:
    down = experts.down_proj
    assert isinstance(down, QuantizedWeight)  # the caller's check
    hidden, inter = down.whole_shape  # down: [hidden, intermediate]
    for e in range(experts.num_experts):
        for proj, want in (("gate", [inter, hidden]), ("up", [inter, hidden]),
                           ("down", [hidden, inter])):  # fmt: skip
            _check_shape(f"{prefix}.{e}.{proj}_proj", declared, want)


def _check_shape(name: str, declared: Mapping[str, list], want: list[int]) -> None:
    shape = declared.get(name)
    if shape != want:
        message = f"quantized {name} declares weight_shape {shape}, the model {want}"
        raise TierserveError(message, field="model")


def quantized_size(
    key: str, name: str, shapes: Mapping[str, list[int]], quant: QuantConfig,
    itemsize: int, device: torch.device, activations: str,
) -> tuple[int, int] | None:  # fmt: skip
    """(parameters, bytes held) of checkpoint tensor `key` (model name `name`) if it is part
    of a quantized linear: its packed words count the whole weight's parameters (for FLOPs)
    and what its backend holds; its scale, zero point and shape count nothing more. None for
    any other tensor."""
    match = _QUANT_KEY.match(name)
    if name.endswith(SHAPE_SUFFIX) or (match and match[2] != "packed"):
        return 0, 0
    if match is None:
        return None
    scheme = quant.scheme_for(match[1])
    scale = shapes.get(key.removesuffix("packed") + "scale")
    if scheme is None or scale is None:
        return None  # not read as quantized: the loader refuses it by name
    *lead, rows, words = shapes[key]
    columns = scale[-1] * scheme.group_size if scheme.group_size else words * 32 // scheme.num_bits
    experts = math.prod(lead)
    backend = backend_for(scheme, rows, device)[0]
    kernel = kernel_activations(backend, activations)
    act = kernel.itemsize if kernel is not None else itemsize
    held = held_bytes(scheme, rows, columns, backend, itemsize, act, experts)
    return experts * rows * columns, held


def describe_backends(quant: QuantConfig, device: torch.device, activations: str) -> str:
    """Each scheme's backend on `device`, and why where it is the dequantize path (the
    engine logs the kinds each weight met at load)."""
    said = []
    for scheme in dict.fromkeys(s for _, s in quant.groups):
        backend, why = backend_for(scheme, 16, device)
        act = "bf16" if kernel_activations(backend, activations) else "model dtype"
        said.append(f"{scheme.describe()} on {backend} ({why or act + ' activations'})")
    return "; ".join(said)
