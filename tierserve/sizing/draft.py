"""A speculative draft model's memory, as `tierserve plan` and `tierserve serve` count it: its
weights (an EAGLE-3 draft whole on every rank, as vLLM's `draft_tensor_parallel_size: 1`; an
MTP layer split over the ranks as the target's layers are), one more KV layer per token of the
target's shape (SGLang's draft pool holds as many tokens as the target's, vLLM adds the draft's
layers to its KV cache spec, tierserve adds one layer to every page: the same bytes), and the
verify step's logits (drafted + 1 float32 rows per running request: activations, beside
`--mem-fraction-static` on a GPU, RAM on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

from tierserve.sizing.pools import weights_per_rank

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class DraftSize:
    name: str  # "EAGLE-3 draft" or "MTP layer"
    weight_bytes: int  # one copy
    split: bool  # over the TP ranks (an MTP layer), else whole on every rank
    tokens_per_step: int  # verified per request per step: drafted + 1
    source: str  # where weight_bytes came from, for the reader
    kv_layers: int = 1

    def bytes_per_rank(self, tp: int) -> int:
        return weights_per_rank(self.weight_bytes, tp) if self.split else self.weight_bytes

    def bytes_per_node(self, tp: int) -> int:
        return self.weight_bytes if self.split else self.weight_bytes * tp

    def verify_bytes(self, vocab_size: int, requests: int = 1) -> int:
        """Logits of `requests` running requests' verify rows."""
        return requests * self.tokens_per_step * vocab_size * FLOAT32_BYTES

    @property
    def placement(self) -> str:
        return "split over the ranks" if self.split else "whole on every rank"
