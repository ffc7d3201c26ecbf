"""What makes a request's KV what it is, as pool keys: tokens, and everything vLLM's own block hash folds in.

Why: the same token ids give different KV under another LoRA adapter, another image behind the
same placeholder ids, or other prompt embeddings, and a tenant's `cache_salt` exists so that
tenants never learn each other's prefixes (a hit is visible: a faster first token,
`vllm:external_prefix_cache_hits`). vLLM folds all of these into its block hash
(`generate_block_hash_extra_keys`), but that hash is per engine block size, so the pool cannot
use it. The pool keeps its own chain (kvbridge's SHA-256 over `block_tokens`-token blocks,
which no engine's block size changes) and folds in, per pool block, exactly the extra keys
vLLM computes for that token range: the salt on the first block (so the whole chain carries
it), the adapter's name and path, each multimodal item's identifier and offset, the embeds'
digest. vLLM's own function is called, so whatever a later vLLM adds is keyed too.

The namespace carries the rest (`pool_model_id`): the served model and its revision; the spec
fingerprint and format version are added by `kvbridge.pool`.

Refused at start (`refuse_unkeyable`), never served wrong: multimodal models. Their items are
keyed as vLLM keys them, but no test serves one through the pool yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from kvbridge.errors import IncompatibleEngines
from kvbridge.offload.keys import OffloadKey, chained_block_hashes, group_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

_ENCODER = msgspec.msgpack.Encoder()


def _encode_extra(keys: tuple[Any, ...]) -> bytes:
    """vLLM's extra keys (tuples of str, int, bytes) as bytes, the same in every process."""
    try:
        return _ENCODER.encode(keys)
    except TypeError:  # a type msgpack does not know: its repr, still deterministic for vLLM's key types
        return repr(keys).encode()


def block_extras(request: Request, block_tokens: int, num_blocks: int) -> list[bytes | None]:
    """Per pool block of `request`, vLLM's extra keys for its token range, encoded (None: none)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    out: list[bytes | None] = []
    mm_index = 0
    for i in range(num_blocks):
        keys, mm_index = generate_block_hash_extra_keys(request, i * block_tokens, (i + 1) * block_tokens, mm_index)
        out.append(_encode_extra(keys) if keys else None)
    return out


def request_pool_keys(request: Request, tokens: list[int], block_tokens: int) -> list[OffloadKey]:
    """The pool keys of the full `block_tokens`-token blocks of `tokens` (a prefix of the request's)."""
    return request_group_keys(request, tokens, block_tokens, 1)[0]


def request_group_keys(request: Request, tokens: list[int], block_tokens: int, num_groups: int
                       ) -> list[list[OffloadKey]]:
    """Per KV-cache group, the pool keys of those blocks: one chain of hashes, one key per group."""
    n = len(tokens) // block_tokens
    hashes = chained_block_hashes(tokens, block_tokens, extras=block_extras(request, block_tokens, n))
    return [group_keys(hashes, g) for g in range(num_groups)]


def tenant_of(request: Request) -> bytes:
    """The tenant whose key encrypts the request's pool objects: its `cache_salt` (b"": none).
    The salt already keys the request's block names (`block_extras`); this keeps tenants'
    bytes apart too, so that one tenant's key opens no other tenant's objects."""
    salt = getattr(request, "cache_salt", None)
    return salt.encode() if isinstance(salt, str) and salt else b""


def pool_model_id(vllm_config: VllmConfig, configured: str = "") -> str:
    """The model identity every instance of a pool must agree on: the configured id or the served
    model, with its revision when one was asked for (other weights, other KV)."""
    mc = vllm_config.model_config
    base = configured or str(mc.model)
    revision = getattr(mc, "revision", None)
    return f"{base}@{revision}" if revision else base


def refuse_unkeyable(vllm_config: VllmConfig) -> None:
    """Refuse, in one line, a model whose requests the pool cannot key exactly yet."""
    if getattr(vllm_config.model_config, "is_multimodal_model", False):
        raise IncompatibleEngines("KVBridgePoolConnector does not serve multimodal models yet (its image keys are "
                                  "not proven through vLLM); serve this model without the pool")


__all__ = ["block_extras", "pool_model_id", "refuse_unkeyable", "request_group_keys", "request_pool_keys", "tenant_of"]
