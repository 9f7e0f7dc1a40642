"""The stored form of one KV page: a header that says what it is, then the page's bytes.

    b"TSKV" | version (u16) | header length (u32) | header (JSON) | payload

The header carries the key, the page shape and dtype, the payload's length and its BLAKE2b
checksum. `unpack` returns None for anything that does not match what the reader expects
(another key's payload, a flipped byte, a truncated file, another format), so a damaged object
is counted and recomputed and never reaches attention.
"""

from __future__ import annotations

import hashlib
import json
import struct

from tierserve.sizing import KVSpec

MAGIC = b"TSKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")


def _checksum(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _header(key: str, spec: KVSpec, nbytes: int) -> dict[str, object]:
    return {"key": key, "shape": list(spec.page_shape), "dtype": spec.dtype, "nbytes": nbytes}


def pack(key: str, spec: KVSpec, payload: bytes) -> bytes:
    header = {**_header(key, spec, len(payload)), "checksum": _checksum(payload)}
    head = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(head)) + head + payload


def unpack(blob: bytes, key: str, spec: KVSpec) -> bytes | None:
    """The payload of `blob` if it is page `key` of `spec`'s format, intact; else None."""
    if len(blob) < _PREFIX.size:
        return None
    magic, version, head_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC or version != VERSION or len(blob) < _PREFIX.size + head_len:
        return None
    try:
        header = json.loads(blob[_PREFIX.size : _PREFIX.size + head_len])
    except ValueError:
        return None
    payload = blob[_PREFIX.size + head_len :]
    expected = _header(key, spec, spec.bytes_per_page)
    if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
        return None
    if len(payload) != spec.bytes_per_page or header.get("checksum") != _checksum(payload):
        return None
    return payload
