"""What a compressed attention cache layer keeps, said in the line that refuses it.

DeepSeek-V4's "heavily_compressed_attention" and "compressed_sparse_attention" layers keep, besides
the K=V rows of a sliding window of raw tokens, one compressed row per `compress_rate` tokens for
each compressor they run ("compressor", and the sparse layers' "indexer"), the raw rows of the
tokens since the last `compress_rate` boundary (not yet compressed), and for the sparse layers the
first half of the last complete window's rows (its windows overlap). kvbridge's planner maps one
token to one row (or one row per token of a trailing window), so none of the compressed rows fits it
yet. The numbers come from the cache layer transformers itself builds for the layer (the class its
modeling code registers in `DYNAMIC_LAYER_TYPE_MAPPING`), not from a list of model types; where that
class cannot be built the refusal falls back to the layer type alone.
"""

from __future__ import annotations

from typing import Any


def compressed_cache_layer(text: Any, lt: str, kw: dict[str, Any]) -> Any:
    """The cache layer transformers builds for layer type `lt`, or None where it cannot be built.
    The class is registered when its modeling module is imported, so that is imported first."""
    from kvbridge.models.modules import _decoder_layer_class

    _decoder_layer_class(text)  # imports the modeling module, which registers its cache layer classes
    try:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING
        return DYNAMIC_LAYER_TYPE_MAPPING[lt](**kw)
    except Exception:  # noqa: BLE001 - no such class here, or one of another shape: name the type alone
        return None


def compressed_holds(text: Any, lt: str, kw: dict[str, Any]) -> str:
    """What one compressed cache layer keeps per request, in words for a one-line refusal ("" when
    transformers' cache layer does not show it)."""
    layer = compressed_cache_layer(text, lt, kw)
    rate = getattr(layer, "compress_rate", None)
    entries = list(getattr(layer, "compressed_kv", None) or ())
    if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1 or not entries:
        return ""
    parts = []
    window = getattr(layer, "sliding_window", None)
    if isinstance(window, int) and window > 1:
        parts.append(f"K=V rows of the last {window - 1} tokens")
    names = " and ".join(repr(e) for e in entries)
    held = (f"{names}: 1 row per {rate} tokens{' each' if len(entries) > 1 else ''} "
            f"+ raw rows of up to {rate - 1} uncompressed tokens")
    if getattr(layer, "overlap_kv", None) is not None:
        held += f" + half rows of the last full {rate}-token window"
    parts.append(held)
    return "; ".join(parts)
