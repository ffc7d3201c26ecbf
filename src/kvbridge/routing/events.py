"""vLLM's KV events on the wire (`vllm.distributed.kv_events`), typed, bounded, without vLLM.

An instance's publisher sends multipart `[topic, seq (8 bytes, big-endian), payload]` on a ZMQ
PUB socket; the payload is a msgpack `KVEventBatch`: `[ts, events, data_parallel_rank]`, each
event a map tagged by its class name. These structs mirror vLLM 0.32's fields so that what the
relay publishes decodes in vLLM's own classes (a test checks both ways when vLLM is there), and
decoding refuses what is malformed or oversized before anything depends on it: every byte comes
from a process of the fleet's network, authenticated or not.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

MAX_PAYLOAD = 16 << 20
"""Bytes of one batch (vllm-router refuses larger)."""
MAX_EVENTS = 1 << 16
"""Events in one batch."""
MAX_TOKENS = 1 << 20
"""Token ids in one BlockStored (an instance stores at most a prompt's worth at once)."""
MAX_HASHES = 1 << 16

MAX_BLOCK_SIZE = 1 << 16
"""Tokens per block an event may carry (vLLM's are at most a few hundred; a pool's, thousands)."""
Name = Annotated[str, Meta(max_length=256)]
BlockHash = Annotated[bytes, Meta(max_length=64)] | Annotated[int, Meta(ge=0)]  # msgspec: at most 2^64 - 1
TokenId = Annotated[int, Meta(ge=0, lt=1 << 32)]
POOL_OWNER = "kvbridge-pool"
"""`ownership` of the events a pool connector emits for what it stored in the shared pool: the
relay announces them on every instance's stream, as the tier the pool is for that instance."""


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[TokenId]
    block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
    lora_id: int | None  # vLLM requires these three (no defaults): always on the wire
    medium: Name | None
    lora_name: Name | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: Annotated[int, Meta(ge=0, lt=1024)] | None = None
    kv_cache_spec_kind: Name | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Name | None = None
    ownership: Name | None = None
    session_id: Name | None = None


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: Name | None
    group_idx: Annotated[int, Meta(ge=0, lt=1024)] | None = None
    locality: Name | None = None
    ownership: Name | None = None


class AllBlocksCleared(_Event):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class BadBatch(ValueError):
    """A batch that is not a well-formed, bounded vLLM KV event batch (the reason in one line)."""


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode and bound one batch; `BadBatch` says why not."""
    if len(payload) > MAX_PAYLOAD:
        raise BadBatch(f"KV event batch of {len(payload)} bytes (at most {MAX_PAYLOAD})")
    try:
        batch = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadBatch(f"not a KV event batch: {str(exc)[:120]}") from None
    if len(batch.events) > MAX_EVENTS:
        raise BadBatch(f"{len(batch.events)} events in one batch (at most {MAX_EVENTS})")
    for e in batch.events:
        if isinstance(e, BlockStored):
            n = len(e.block_hashes)
            if not 0 < n <= MAX_HASHES or len(e.token_ids) > MAX_TOKENS or e.block_size < 1:
                raise BadBatch(f"BlockStored of {n} blocks, {len(e.token_ids)} tokens, block size {e.block_size}")
            if len(e.token_ids) != n * e.block_size:
                raise BadBatch(f"BlockStored of {n} blocks of {e.block_size} tokens carries {len(e.token_ids)} "
                               f"token ids")
            if e.extra_keys is not None and len(e.extra_keys) != n:
                raise BadBatch(f"BlockStored of {n} blocks with {len(e.extra_keys)} extra-key entries")
        elif isinstance(e, BlockRemoved) and len(e.block_hashes) > MAX_HASHES:
            raise BadBatch(f"BlockRemoved of {len(e.block_hashes)} blocks (at most {MAX_HASHES})")
    return batch


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def hash_key(h: BlockHash) -> bytes:
    """One dictionary key for a hash sent as bytes or as an unsigned integer."""
    return h if isinstance(h, bytes) else b"i" + int(h).to_bytes(16, "big", signed=True)


__all__ = ["MAX_PAYLOAD", "POOL_OWNER", "AllBlocksCleared", "BadBatch", "BlockRemoved", "BlockStored", "Event", "KVEventBatch",
           "decode_batch", "encode_batch", "hash_key"]
