"""Tensor-parallel layers (Megatron's split, as vLLM and SGLang make it).

- Column-parallel linear: each rank holds a slice of the output features (q/k/v, gate/up,
  MLA's query and kv_b projections); no communication.
- Row-parallel linear: each rank holds a slice of the input features and adds its partial
  product into every rank's copy (one all-reduce); the bias after the sum.
- Vocab-parallel embedding: each rank looks up the ids in its slice of the vocabulary and the
  ranks' rows are summed; the LM head is column-parallel over the vocabulary and its slices are
  gathered, so every rank holds the same full logits and samples the same token.

Layers are built for the group that is current when the model is made (`tp_group()`; one rank
unless `distributed/` set one up), and keep it: with data-parallel attention the attention
layers, the embedding and the LM head are built for their attention group (`attention_group()`,
made current by `building_attention`), the MLP and MoE layers for every rank. A module with
sharded parameters lists them in `tp_shards` (parameter name → (dim, index, count)): the
loader narrows the full checkpoint tensor, `count` slices long along `dim` (counted from the
end), to slice `index` of the parameter's size, so a checkpoint loads the same way at any TP
size (kept on the module: parameters are remade when the model leaves `meta`).
A KV head that more ranks need than the model has (tp > kv_heads) is `replicas` ranks' shared
slice.

Linears that read the same input run as one GEMM (`PackedColumnLinear`: q, k and v; gate and
up; MLA's two down-projections): the checkpoint's separate tensors load straight into their
rows of the packed weight, each sliced for this rank as its own linear would be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tierserve.errors import TierserveError
from tierserve.layers.cpu_linear import linear, pack_linears


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # its torch.distributed ProcessGroup; None: the default (every rank)


_current = TPGroup()
_attention = TPGroup()


def tp_group() -> TPGroup:
    return _current


def attention_group() -> TPGroup:
    """The ranks that split one attention group's heads: every rank, unless attention is
    data-parallel."""
    return _attention


def set_tp_group(group: TPGroup, attention: TPGroup | None = None) -> None:
    global _current, _attention
    _current, _attention = group, attention or group


@contextlib.contextmanager
def building_attention() -> Iterator[None]:
    """Layers made inside are split over the attention group."""
    global _current
    outer, _current = _current, _attention
    try:
        yield
    finally:
        _current = outer


def shard_size(total: int, shards: int, what: str) -> int:
    if total % shards:
        raise TierserveError(f"{what} ({total}) does not split over {shards} ranks", "tp_size")
    return total // shards


def mark_shard(module: nn.Module, name: str, dim: int, index: int, count: int) -> None:
    """`name` is slice `index` of `count` along `dim` of the checkpoint's tensor."""
    shards = module.__dict__.setdefault("tp_shards", {})
    shards[name] = (dim, index, count)


def shards_by_name(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Every sharded parameter of `model`, by its state-dict name."""
    return {
        f"{prefix}.{name}" if prefix else name: shard
        for prefix, module in model.named_modules()
        for name, shard in getattr(module, "tp_shards", {}).items()
    }


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    # An idle attention group has no tokens on any of its ranks: nothing to sum.
    if tp.size > 1 and x.numel():
        dist.all_reduce(x, group=tp.group)
    return x


class ColumnParallelLinear(nn.Linear):
    """`out_features` split over the ranks; with `replicas` > 1, that many neighbouring ranks
    hold the same slice (a KV head shared by their query heads)."""

    # Set on a linear whose weight is read as a tensor elsewhere (MLA's kv_b_proj): left dense.
    keep_dense: bool

    def __init__(self, in_features: int, out_features: int, bias: bool, replicas: int = 1) -> None:
        tp = tp_group()
        shards = max(1, tp.size // replicas)
        super().__init__(in_features, shard_size(out_features, shards, "output features"), bias)
        index = tp.rank // max(1, replicas) if shards > 1 else 0
        mark_shard(self, "weight", -2, index, shards)
        if self.bias is not None:
            mark_shard(self, "bias", -1, index, shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class PackedPart:
    """One checkpoint linear inside a packed one: `name` is its module's name beside the packed
    module (`q_proj` beside `qkv_proj`); this rank holds slice `index` of `shards` of its output
    features (1 shard: the whole), at `rows` of the packed output."""

    name: str
    rows: slice
    index: int
    shards: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint's whole tensor (weight or bias)."""
        size = tensor.shape[0] // self.shards
        return tensor.narrow(0, self.index * size, size) if self.shards > 1 else tensor


class PackedColumnLinear(nn.Linear):
    """Several column-parallel linears of one input, side by side in one weight; `forward`
    returns each one's output. A part is (checkpoint name, output features, replicas): split
    over the ranks as `ColumnParallelLinear(..., replicas)` splits it, or whole on every rank
    when replicas is None (MLA's latent projection)."""

    def __init__(
        self, in_features: int, parts: Sequence[tuple[str, int, int | None]], bias: bool
    ) -> None:
        tp = tp_group()
        packed, start = [], 0
        for name, features, replicas in parts:
            shards = 1 if replicas is None else max(1, tp.size // replicas)
            rows = shard_size(features, shards, f"{name} output features")
            index = tp.rank // replicas if replicas and shards > 1 else 0
            packed.append(PackedPart(name, slice(start, start + rows), index, shards))
            start += rows
        super().__init__(in_features, start, bias)
        self.parts = tuple(packed)
        self.sizes = [p.rows.stop - p.rows.start for p in packed]
        if any(p.shards > 1 for p in packed):  # a slice of the whole: listed as sharded
            mark_shard(self, "weight", -2, tp.rank, tp.size)
            if self.bias is not None:
                mark_shard(self, "bias", -1, tp.rank, tp.size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        # split_with_sizes: Tensor.split's Python wrapper took 10 µs a call here, this 5.
        return linear(x, self.weight, self.bias).split_with_sizes(self.sizes, dim=-1)

    def checkpoint_keys(self, parent: str) -> dict[str, list[tuple[str, PackedPart]]]:
        """Per parameter ("weight", "bias"), the checkpoint names of its parts and the parts,
        for a packed linear whose parent module's keys start with `parent` ("" or "a.b.")."""
        weight = self.weight
        # Quantized, it is a QuantizedWeight (layers/quantized.py), a module where nn.Linear
        # declares a Tensor: its buffers, each packed by rows.
        if isinstance(weight, nn.Module):
            params = [f"weight.{name}" for name, _ in weight.named_buffers()]
        else:
            params = ["weight"]
        params += ["bias"] if self.bias is not None else []
        return {p: [(f"{parent}{part.name}.{p}", part) for part in self.parts] for p in params}

    def pack(self, state_dict: dict[str, torch.Tensor], parent: str, name: str) -> None:
        """Replace the parts' tensors in `state_dict` (a module's, keys under `parent`) by this
        rank's packed ones, so `load_state_dict` takes checkpoint names."""
        for param, keys in self.checkpoint_keys(parent).items():
            if all(k in state_dict for k, _ in keys):
                rows = [part.of(state_dict.pop(k)) for k, part in keys]
                state_dict[f"{parent}{name}.{param}"] = torch.cat(rows)


def load_unpacked(module: nn.Module) -> None:
    """Let `module.load_state_dict` take its packed linears' parts by their checkpoint names
    (`q_proj.weight`, ...), as transformers' modules name them."""

    def hook(m: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
        for name, child in m.named_children():
            if isinstance(child, PackedColumnLinear):
                child.pack(state_dict, prefix, name)

    module.register_load_state_dict_pre_hook(hook)


def packed_by_name(model: nn.Module) -> dict[str, tuple[str, PackedPart]]:
    """Checkpoint tensor name → (the packed parameter it loads into, its part), for every part
    of every packed linear of `model`."""
    found = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, PackedColumnLinear):
            continue
        parent = prefix.rpartition(".")[0]
        for param, keys in module.checkpoint_keys(f"{parent}." if parent else "").items():
            found |= {key: (f"{prefix}.{param}", part) for key, part in keys}
    return found


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        tp = tp_group()
        super().__init__(shard_size(in_features, tp.size, "input features"), out_features, bias)
        self.tp = tp
        mark_shard(self, "weight", -1, tp.rank, tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        tp = tp_group()
        super().__init__(shard_size(vocab_size, tp.size, "vocab_size"), hidden_size)
        self.tp = tp
        self.start = tp.rank * self.num_embeddings
        mark_shard(self, "weight", -2, tp.rank, tp.size)

    def reset_parameters(self) -> None:
        # The checkpoint fills the table. A random one would be thrown away, and on the meta
        # device (where the loader builds models) normal_ runs through torch's reference ops,
        # whose first use imports torch._dynamo: about a CPU-second in every engine process.
        if self.weight.device.type != "meta":
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0), self.tp)


class ParallelLMHead(nn.Linear):
    """The vocabulary split over the ranks; `forward` returns every rank the full logits."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        tp = tp_group()
        super().__init__(hidden_size, shard_size(vocab_size, tp.size, "vocab_size"), bias=False)
        self.tp = tp
        mark_shard(self, "weight", -2, tp.rank, tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = linear(x, self.weight)
        if self.tp.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=-1)


def pack_for_cpu(model: nn.Module, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """Every tensor-parallel linear's weight in oneDNN's layout, where it runs on CPU in one of
    `dtypes` (this machine's choice unless given: layers/cpu_linear.py); after loading, as the
    loader calls it."""
    kinds = (ColumnParallelLinear, PackedColumnLinear, RowParallelLinear, ParallelLMHead)
    pack_linears(model, kinds, dtypes)
