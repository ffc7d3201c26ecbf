"""The 32-byte seal at the end of every pool object: a store's bytes are untrusted until it checks.

Anyone who reaches the store can put, overwrite or truncate objects, and a store that lost a
node or a client that died mid-put can hand back bytes that were never whole. So an object is
its payload followed by a seal: magic, payload length, and a BLAKE2b-128 MAC over the object's
key, that length and the payload. With the fleet's secret the MAC is keyed (a peer without it
cannot forge or move an object to another key); without one (`insecure`) it is a checksum
(corruption and misplaced objects are still caught). A load uses an object only if its seal
checks; MACs are compared in constant time. The same secret, under another personalisation,
names the objects (`mac_key`, `objects.block_name`), so names say nothing without it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from functools import lru_cache
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

MAGIC = b"KVB1"
SEAL_BYTES = 32
_PERSON = b"kvbridge-pool1"
_HEAD = struct.Struct("<4sQ")  # magic, payload length; then the 16-byte MAC and 4 reserved zero bytes


@lru_cache(maxsize=8)
def mac_key(secret: bytes) -> bytes:
    """BLAKE2b's key (at most 64 bytes) for a secret of any length: longer ones are digested, not cut."""
    return secret if len(secret) <= 64 else hashlib.blake2b(secret, person=b"kvbridge-key").digest()


def _mac(secret: bytes, key: str, length: int, pieces: Sequence[torch.Tensor]) -> bytes:
    h = hashlib.blake2b(digest_size=16, key=mac_key(secret), person=_PERSON)
    h.update(key.encode())
    h.update(length.to_bytes(8, "little"))
    for p in pieces:
        h.update(p.numpy())  # a 1-D uint8 view: hashed in place, no copy
    return h.digest()


def seal(secret: bytes, key: str, pieces: Sequence[torch.Tensor]) -> bytes:
    """The seal of an object whose payload is `pieces` (uint8 CPU tensors) in order."""
    length = sum(int(p.numel()) for p in pieces)
    return _HEAD.pack(MAGIC, length) + _mac(secret, key, length, pieces) + bytes(4)


def check_seal(secret: bytes, key: str, pieces: Sequence[torch.Tensor], trailer: bytes) -> str:
    """'' when `trailer` seals exactly these bytes under `key`, else why not (one line)."""
    if len(trailer) != SEAL_BYTES:
        return f"seal of {len(trailer)} bytes, expected {SEAL_BYTES}"
    magic, length = _HEAD.unpack_from(trailer)
    if magic != MAGIC:
        return "no kvbridge seal (magic differs)"
    want = sum(int(p.numel()) for p in pieces)
    if length != want:
        return f"sealed payload of {length} bytes, expected {want}"
    if not hmac.compare_digest(_mac(secret, key, length, pieces), trailer[_HEAD.size:_HEAD.size + 16]):
        return "MAC differs (corrupt, forged or stored under another key)"
    return ""


_POOL: ThreadPoolExecutor | None = None
_BATCH = 64  # objects per task: enough hashing per task to outweigh the hand-off


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="kvbridge-seal")
    return _POOL


def _batched(fn, items: list) -> list:
    """`fn` over `items` on the seal threads (hashlib releases the GIL while it hashes), in order."""
    if len(items) <= _BATCH:
        return [fn(*x) for x in items]
    parts = [items[i:i + _BATCH] for i in range(0, len(items), _BATCH)]
    return [r for part in _pool().map(lambda p: [fn(*x) for x in p], parts) for r in part]


def seal_many(secret: bytes, objects: list[tuple[str, Sequence[torch.Tensor]]]) -> list[bytes]:
    """`seal` of each (key, pieces), hashed on several threads."""
    return _batched(lambda key, pieces: seal(secret, key, pieces), objects)


def check_many(secret: bytes, objects: list[tuple[str, Sequence[torch.Tensor], bytes]]) -> list[str]:
    """`check_seal` of each (key, pieces, trailer), on several threads."""
    return _batched(lambda key, pieces, trailer: check_seal(secret, key, pieces, trailer), objects)


__all__ = ["MAGIC", "SEAL_BYTES", "check_many", "check_seal", "mac_key", "seal", "seal_many"]
