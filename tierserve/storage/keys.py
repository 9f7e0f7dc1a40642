"""Content keys of KV pages in a shared store.

A page's key is a chained hash: it covers the page's tokens and, through its parent's key, every
token before it, so equal keys mean equal prefixes. The chain starts from a namespace that names
the model (a hash of config.json, the safetensors headers, and each shard's size and first and
last MiB; not all the weight bytes, which would take minutes to read; plus a user's salt),
the KV format (kind, dtype, page size, page shape) and the rank's shard (`shard_of`: the KV heads
it holds, or the latent), so different models, KV dtypes or head slices never read each other's
pages, while an MLA latent, the same under every layout, is shared by all of them. SHA-256
throughout: stable across processes and machines (never `hash()`).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from tierserve.sizing import KVSpec

KEY_CHARS = 32  # 128 bits of SHA-256, hex


@dataclass(frozen=True)
class Namespace:
    model: str  # models/loader.py's model_fingerprint
    spec: KVSpec
    shard: str = "kv heads all"  # this rank's part of the KV (shard_of)

    @property
    def root(self) -> str:
        """The chain's start: a key no page has."""
        s = self.spec
        fmt = {"kind": s.kind, "dtype": s.dtype, "page_shape": s.page_shape, "layout": "page-major"}
        text = json.dumps({"model": self.model, "format": fmt, "shard": self.shard})
        return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]

    def chain(self, parent: str | None, tokens: Sequence[int]) -> list[str]:
        """Keys of the whole pages of `tokens`, following the page whose key is `parent` (None:
        the first page of a sequence)."""
        ps, keys, prev = self.spec.page_size, [], parent or self.root
        for start in range(0, len(tokens) - ps + 1, ps):
            page = array("q", tokens[start : start + ps]).tobytes()
            prev = hashlib.sha256(prev.encode() + page).hexdigest()[:KEY_CHARS]
            keys.append(prev)
        return keys


def shard_of(spec: KVSpec, attention_rank: int) -> str:
    """What a rank's pages hold: "latent" for MLA (every rank the same), else the KV heads of
    its slice, e.g. "kv heads 2-3 of 8" (neighbouring ranks share a replicated head)."""
    if spec.kind == "latent":
        return "latent"
    first = attention_rank // spec.copies * spec.heads
    return f"kv heads {first}-{first + spec.heads - 1} of {spec.model_heads}"
