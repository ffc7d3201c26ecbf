"""The 32-byte seal at the end of every pool object: a store's bytes are untrusted until it checks.

Anyone who reaches the store can put, overwrite or truncate objects, and a store that lost a
node or a client that died mid-put can hand back bytes that were never whole. So an object is
its payload followed by a seal: magic, payload length, and a BLAKE2b-128 MAC over the object's
key, that length and the payload. With the fleet's secret the MAC is keyed (a peer without it
cannot forge or move an object to another key); without one it is a checksum (corruption and
misplaced objects are still caught). A load uses an object only if its seal checks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

MAGIC = b"KVB1"
SEAL_BYTES = 32
_PERSON = b"kvbridge-pool1"
_HEAD = struct.Struct("<4sQ")  # magic, payload length; then the 16-byte MAC and 4 reserved zero bytes


def _mac(secret: bytes, key: str, length: int, pieces: Sequence[torch.Tensor]) -> bytes:
    h = hashlib.blake2b(digest_size=16, key=secret[:64], person=_PERSON)
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
    if _mac(secret, key, length, pieces) != trailer[_HEAD.size:_HEAD.size + 16]:
        return "MAC differs (corrupt, forged or stored under another key)"
    return ""


__all__ = ["MAGIC", "SEAL_BYTES", "check_seal", "seal"]
