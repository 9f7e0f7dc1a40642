"""Builds a model from a local Hugging Face directory: config.json + one or sharded safetensors.

Weights are read tensor by tensor into parameters already allocated at the model's dtype, so
loading never holds a second full copy of the model (peak ≈ the model + its largest tensor).
Checkpoints as DeepSeek-V3 ships them load too: fp8 block-scaled weights (`weight_scale_inv`,
blocks of `quantization_config.weight_block_size`) are dequantized as they arrive, and the
multi-token-prediction layer (`model.layers.{num_hidden_layers}`) is left to models/mtp.py,
which loads it as a draft; one tensor per expert lands in the model's stacked experts
(`checkpoint_target`). A multimodal checkpoint whose config nests the text model (Kimi-K2.5:
`text_config`) loads its `language_model.` tensors and leaves the vision tower.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from tierserve.errors import TierserveError
from tierserve.layers import (
    bound_primitive_caches,
    finalize_quantized,
    pack_for_cpu,
    packed_by_name,
    rotary_for,
    shards_by_name,
)
from tierserve.model_config import ModelConfig, read_hf_config, text_config
from tierserve.models.decoder import CausalLM
from tierserve.models.quant_config import QuantConfig
from tierserve.models.quantization import (
    check_declared,
    densify,
    quantize_modules,
    read_quantized,
)
from tierserve.models.registry import model_class

logger = logging.getLogger("tierserve")
SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
            if not all(isinstance(s, str) for s in shards):
                raise TypeError("its weight_map must map tensor names to file names")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            message = f"cannot read {index}: {type(err).__name__}: {err}"
            raise TierserveError(message, field="model") from None
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise TierserveError(f"no model.safetensors (or index) in {path}", field="model")


@dataclass(frozen=True)
class CheckpointLayout:
    """Which of a checkpoint's tensors the model holds, and under what name."""

    num_layers: int
    prefix: str = ""  # "language_model." when config.json nests the text model (Kimi-K2.5)

    @classmethod
    def of(cls, path: Path, num_layers: int) -> CheckpointLayout:
        nested = isinstance(read_hf_config(path).get("text_config"), dict)
        return cls(num_layers, "language_model." if nested else "")

    def model_name(self, key: str) -> str | None:
        """The model's name for checkpoint tensor `key`; None for a dequantization scale, an
        MTP layer, or another tower of a multimodal checkpoint (vision, projector)."""
        if key.endswith(SCALE_SUFFIX) or not key.startswith(self.prefix):
            return None
        name = key[len(self.prefix) :]
        layer = _LAYER.match(name)
        return name if layer is None or int(layer[1]) < self.num_layers else None


def _block_size(path: Path) -> tuple[int, int]:
    quant = text_config(read_hf_config(path)).get("quantization_config") or {}
    block = quant.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def quantize_fp8_blocks(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dequantize`'s inverse: a weight as DeepSeek-V3 ships it, float8_e4m3fn values and one
    float32 `weight_scale_inv` per block (the block's absmax / 448). Tests and benchmarks make
    fp8 checkpoints with it."""
    rows, cols = weight.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(nr * block[0], nc * block[1])
    padded[:rows, :cols] = weight
    blocks = padded.view(nr, block[0], nc, block[1])
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).view(nr * block[0], nc * block[1])[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """fp8 weight × its per-block scale (DeepSeek-V3's `weight_scale_inv`), in float32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    return weight.float() * scale.repeat_interleave(block[1], 1)[:, :cols]


def checkpoint_tensors(path: Path, layout: CheckpointLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """(model name, tensor) for every tensor the model uses, one at a time, fp8 ones
    dequantized."""
    block = _block_size(path)
    for file in weight_files(path):
        # Memory-mapped: a shard's tensors are page cache until copied into the model, so
        # only one tensor at a time (dequantized, for fp8) takes memory of its own.
        try:
            shard = load_file(str(file))
        except SafetensorError as err:  # truncated or corrupt past its header
            raise TierserveError(f"cannot read {file}: {err}", field="model") from None
        for key in sorted(shard):
            name = layout.model_name(key)
            if name is None:
                continue
            tensor = shard[key]
            if key + SCALE_SUFFIX in shard:
                tensor = dequantize(tensor, shard[key + SCALE_SUFFIX], block)
            elif tensor.element_size() == 1 and tensor.is_floating_point():
                # Its scale sits in another shard (or nowhere): cast alone it would be wrong.
                message = f"{file}: fp8 tensor {key} has no {key + SCALE_SUFFIX} in its shard"
                raise TierserveError(message, field="model")
            yield name, tensor
        del shard


def load_model(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantized_activations: str = "auto",
) -> CausalLM:
    """`quantized_activations`: EngineArgs' (auto: bf16 into the int4 kernel; model: `dtype`)."""
    bound_primitive_caches()  # before this process's first oneDNN primitive: the reorders
    path = Path(path)
    quant = QuantConfig.read(text_config(read_hf_config(path)))
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
        if quant is not None:  # before anything is allocated: dense weights never are
            quantize_modules(model, quant)
    model = materialize(model, device, dtype)
    for module in model.modules():
        if getattr(module, "keep_in_fp32", False):
            module.float()
    # Parameters and persistent buffers (V3's e_score_correction_bias is one), by name.
    targets = model.state_dict(keep_vars=True)
    if cfg.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    layout = CheckpointLayout.of(path, cfg.num_layers)
    total = sum(1 for f in weight_files(path) for _ in _keys(f, layout))
    bar = tqdm(total=total, desc="loading weights", unit="tensor", leave=False)

    def counted() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in checkpoint_tensors(path, layout):
            bar.update(1)
            if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
                yield name, tensor

    what = f"checkpoint {path} does not match {cfg.architecture}"
    if quant is None:
        fill(model, targets, counted(), what)
    else:
        declared: dict[str, list] = {}
        fill(model, targets, read_quantized(counted(), quant, declared), what)
        del targets  # it holds the checkpoint's layout: freed weight by weight as each is repacked
        check_declared(model, declared)
        densify(model, dtype)
        for scheme, backend, why in finalize_quantized(model, device, quantized_activations):
            logger.info("quantized weights %s: %s%s", scheme, backend, f" ({why})" if why else "")
    bar.close()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    pack_for_cpu(model)
    # Buffers made on the meta device hold no values: compute the rotary tables for real.
    fresh, rotary = rotary_for(cfg).to(device), model.model.rotary
    rotary.cos, rotary.sin = fresh.cos, fresh.sin
    _return_freed_heap()
    return model.eval()


def _return_freed_heap() -> None:
    """Give the OS back what the load's transient buffers left free in glibc's heap (a weight
    repacked for a kernel, reordered for oneDNN): after an int4 model's load it kept 0.19x of
    the model's bytes resident, which no plan counts (benchmarks/quantized.py)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_M = TypeVar("_M", bound=nn.Module)


def materialize(model: _M, device: torch.device, dtype: torch.dtype | None = None) -> _M:
    """`model.to_empty(device)` for a model made on the meta device, without its first-call
    cost: to_empty makes each tensor with empty_like of a meta tensor, whose first call imports
    torch's symbolic shapes and sympy (~0.5 CPU-seconds of every engine core's and rank's
    start). The model and its speculative drafts load through this. With `dtype`, floating
    tensors are made in it (as `.to(dtype)` after would, without a float32 copy first: a
    bf16 model's load peaked at 1.5x its bytes)."""
    made: dict[int, torch.Tensor] = {}  # a tensor two modules share stays one

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
            fresh = torch.empty(t.shape, dtype=kind, device=device)
            param = isinstance(t, nn.Parameter)
            made[id(t)] = nn.Parameter(fresh, t.requires_grad) if param else fresh
        return made[id(t)]

    for module in model.modules():
        tensors: dict[str, Any]  # Parameters (empty makes a Parameter of one), or buffers
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None:
                    tensors[name] = empty(t)
    return model


def fill(
    model: nn.Module,
    targets: dict[str, torch.Tensor],
    tensors: Iterable[tuple[str, torch.Tensor]],
    what: str,
    field: str = "model",
) -> None:
    """Copy checkpoint tensors (by model name) into `targets` (model's state-dict entries):
    packed parts into their rows, stacked experts into their slots, this rank's slice of a
    sharded one. Refuses, naming them, tensors that fit nowhere and targets left unfilled."""
    # Elements written per target: a stacked tensor fills from many checkpoint tensors.
    filled = dict.fromkeys(targets, 0)
    unexpected: list[str] = []
    place = getattr(model, "checkpoint_target", lambda name: None)
    shards = shards_by_name(model)  # tensor parallelism: this rank's slices
    packed = packed_by_name(model)  # q/k/v, gate/up, ...: rows of one packed weight
    seen_parts: set[str] = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name in packed:
                target_name, part = packed[name]
                index: tuple[int | slice, ...] = (part.rows,)
                tensor = part.of(tensor)
                seen_parts.add(name)
            else:
                target_name, index = place(name) or (name, ())
            target = targets.get(target_name)
            view = target[index] if target is not None else None
            if view is not None and target_name in shards and name not in packed:
                tensor = _rank_slice(tensor, view.shape, shards[target_name])
            mistyped = view is not None and view.is_floating_point() != tensor.is_floating_point()
            if view is None or view.shape != tensor.shape or mistyped:  # int weights: garbage
                if not name.endswith("rotary_emb.inv_freq"):
                    unexpected.append(name)
                continue
            view.copy_(tensor)  # converts to the model's dtype and device in place
            # A NaN or inf weight served until the first sampled token failed the engine
            # step, and the server with it: refused here, named.
            if view.is_floating_point() and not _finite(view):
                message = f"{what}: {name} holds NaN or infinite values"
                raise TierserveError(message, field=field)
            filled[target_name] += tensor.numel()
    # A target is loaded when exactly its elements arrived (a stacked one: every expert once);
    # a packed one's missing parts are named as the checkpoint names them.
    missing = sorted(set(packed) - seen_parts)
    packed_targets = {target for target, _ in packed.values()}
    missing += [n for n, t in targets.items() if filled[n] != t.numel() and n not in packed_targets]
    if missing or unexpected:
        raise TierserveError(
            f"{what}: missing {missing[:5]}, unexpected or misshapen {unexpected[:5]}",
            field=field,
        )


def _finite(t: torch.Tensor) -> bool:
    """Whether no element is NaN or inf: a sum is NaN or inf if any element is (1/25 of
    isfinite's time). It runs in the tensor's own dtype where that has float32's range (no
    weights sum past it; a bf16 tensor's float32 sum took 20× as long), float16's in float32
    (a sum of its ones passes 65,504). A meta tensor (a dry run's) and fp8 are not checked."""
    if t.is_meta or t.element_size() == 1:
        return True
    return bool(t.sum(dtype=torch.float32 if t.dtype == torch.float16 else None).isfinite())


def _rank_slice(
    tensor: torch.Tensor, shape: torch.Size, shard: tuple[int, int, int]
) -> torch.Tensor:
    """This rank's slice of a full checkpoint tensor (layers/parallel.py marks the parameter
    with the dimension, slice index and slice count). A tensor of any other length along that
    dimension is left whole, to be refused: one longer than the config says (an embedding of
    5,000 rows for a vocab_size of 4,096) was cut to fit and served garbage."""
    dim, index, count = shard
    if tensor.dim() != len(shape) or tensor.shape[dim] != count * shape[dim]:
        return tensor
    return tensor.narrow(dim, index * shape[dim], shape[dim])


def _keys(file: Path, layout: CheckpointLayout) -> list[str]:
    return [k for k in tensor_shapes(file) if layout.model_name(k)]


MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def tensor_shapes(file: Path) -> dict[str, list[int]]:
    """Each tensor's shape from a safetensors file's header alone: nothing is mapped, so a
    file larger than the address space allows (a draft that could never fit) is read too."""
    return {k: list(v["shape"]) for k, v in tensor_headers(file).items()}


def tensor_headers(file: Path) -> dict[str, dict]:
    """Each tensor's header entry (shape, dtype, data_offsets) of a safetensors file, checked
    against the file's length."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= MAX_HEADER_BYTES:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        # A copy cut short: its header is whole, its tensors not (loading then fails).
        end = 8 + length + max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        size = file.stat().st_size
        if end > size:
            raise ValueError(f"truncated: {size:,} bytes of the {end:,} it needs")
        for v in tensors.values():
            if not isinstance(v["shape"], list) or not isinstance(v["dtype"], str):
                raise TypeError("a tensor's shape must be a list and its dtype a string")
        return tensors
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise TierserveError(f"cannot read {file}: {err}", field="model") from None


# --- what names a model in a shared store ------------------------------------------------

FINGERPRINT_CHARS = 32  # 128 bits of SHA-256, hex, as storage keys
SAMPLE_BYTES = 2**20  # of each shard's start and end


def model_fingerprint(model_dir: str | Path, salt: str = "") -> str:
    """A hash of config.json, every tensor's name, shape and dtype, and each shard's size and
    first and last MiB: a fine-tune saved with the same config and shapes differs in those
    bytes (all of them would take minutes to read). `salt` separates what the user says is
    different."""
    path = Path(model_dir)
    h = hashlib.sha256((path / "config.json").read_bytes() + salt.encode())
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                tensor = f.get_slice(name)
                h.update(f"{name}:{tensor.get_shape()}:{tensor.get_dtype()};".encode())
        size = file.stat().st_size
        with file.open("rb") as raw:
            h.update(f"{size};".encode() + raw.read(SAMPLE_BYTES))
            raw.seek(max(0, size - SAMPLE_BYTES))
            h.update(raw.read(SAMPLE_BYTES))
    return h.hexdigest()[:FINGERPRINT_CHARS]
