"""Causal LMs whose transformers class keeps no per-layer K/V: refused from the config, before any layer is read.

The signal is the class's forward: a causal LM that caches takes its cache there (`past_key_values`,
`cache`, `cache_params`, `state`). One that takes none (GPT-1) keeps nothing; one that takes only
`mems` (XLNet: its layers' input hidden states, re-sliced by its own generate) or
`past_buckets_states` (Reformer: LSH buckets and hidden states) keeps something that is not a KV
cache. `kvbridge plan` then says so in one line instead of planning K/V that no engine holds; the
proof (`proofs.proof`) checks the same at run time for classes whose forward takes a cache it never
returns (XLM).
"""

from __future__ import annotations

import inspect
from typing import Any

_CACHE_ARGS = ("past_key_values", "cache", "cache_params", "state")
_NOT_KV = {"mems": "its layers' input hidden states", "past_buckets_states": "LSH buckets and hidden states"}


def no_kv_cache_refusal(config: Any) -> str | None:
    """One line naming layer 0 and what the class keeps instead of K/V; None where it takes a cache
    (or its class or forward cannot be read here: the config's layers then decide)."""
    from kvbridge.models.own_state import causal_lm_class

    cls = causal_lm_class(config)
    try:
        params = inspect.signature(cls.forward).parameters if cls is not None else {}
    except (TypeError, ValueError):
        return None
    if not params or any(name in params for name in _CACHE_ARGS):
        return None
    other = next((name for name in _NOT_KV if name in params), None)
    if other:
        return (f"layer 0: {cls.__name__} keeps its cache as {other} ({_NOT_KV[other]}), not per-layer K/V "
                "(transformers exposes no KV cache for it), so there is nothing to move")
    return (f"layer 0: {cls.__name__} takes and returns no cache (its forward has no past_key_values): "
            "transformers exposes none for it, so there is nothing to move")


__all__ = ["no_kv_cache_refusal"]
