"""What identifies an offloaded block: a chained block hash plus the KV-cache group index.

Hashes are chained (each one covers the whole prefix up to its block), so the hash of the last
hash-block inside an offloaded block identifies that block and everything before it. Keys are
plain `bytes` (hash followed by the group as 4 big-endian bytes) rather than tuples, as in vLLM:
the scheduler builds and looks up many of them per step, and bytes are cheap to hash and store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

OffloadKey = bytes

_GROUP_BYTES = 4


def make_offload_key(block_hash: bytes, group: int) -> OffloadKey:
    """The key of one offloaded block of `group`."""
    if not 0 <= group < 1 << (8 * _GROUP_BYTES):
        raise ValueError(f"group index {group} does not fit in {_GROUP_BYTES} bytes")
    return bytes(block_hash) + group.to_bytes(_GROUP_BYTES, "big")


def split_offload_key(key: OffloadKey) -> tuple[bytes, int]:
    """(block hash, group index) of a key made by `make_offload_key`."""
    if len(key) < _GROUP_BYTES:
        raise ValueError(f"offload key {key!r} is shorter than its {_GROUP_BYTES}-byte group suffix")
    return key[:-_GROUP_BYTES], int.from_bytes(key[-_GROUP_BYTES:], "big")


def chained_block_hashes(token_ids: Sequence[int], block_tokens: int, parent: bytes = b"",
                         extras: Sequence[bytes | None] | None = None) -> list[bytes]:
    """SHA-256 of every *full* block of `block_tokens` tokens, each chained on the previous one.

    `extras[i]` (bytes or None) is folded into block i after its tokens: what else makes a
    block's KV what it is (a tenant's salt, an adapter, an image), as vLLM's extra keys do.
    Token bytes have a fixed length per block and an extra is length-prefixed, so no block with
    extras hashes like one without."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    out, prev = [], parent
    for i, start in enumerate(range(0, len(token_ids) - block_tokens + 1, block_tokens)):
        chunk = b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids[start:start + block_tokens])
        extra = extras[i] if extras is not None and i < len(extras) else None
        if extra:
            chunk += b"\xffextra" + len(extra).to_bytes(8, "little") + extra
        prev = hashlib.sha256(prev + chunk).digest()
        out.append(prev)
    return out


def offloaded_block_hashes(hashes: Sequence[bytes], hash_block_factor: int) -> list[bytes]:
    """The hash of each offloaded block: every `hash_block_factor`-th hash, starting at the factor's last."""
    if hash_block_factor < 1:
        raise ValueError(f"hash_block_factor must be >= 1, got {hash_block_factor}")
    return list(hashes[hash_block_factor - 1::hash_block_factor])


def group_keys(hashes: Sequence[bytes], group: int) -> list[OffloadKey]:
    return [make_offload_key(h, group) for h in hashes]


__all__ = ["OffloadKey", "chained_block_hashes", "group_keys", "make_offload_key", "offloaded_block_hashes",
           "split_offload_key"]
