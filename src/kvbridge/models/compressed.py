"""A compressed attention cache layer (DeepSeek-V4) as kvbridge layers.

DeepSeek-V4's "heavily_compressed_attention" and "compressed_sparse_attention" layers keep, per
request: the K=V rows of a sliding window of raw tokens (MQA, one head); per compressor they run
("compressor", and the sparse layers' "indexer") one compressed row per `compress_rate` (C) tokens
of complete windows; the raw projected rows and gates of the tokens since the last window boundary
(n mod C of them, not yet compressed); and for the sparse layers, whose windows overlap, the first
half (Ca) of the last complete window's rows and gates. One such cache layer is described as:

* the window: an "mla" layer of `head_dim` with the window (vLLM's `SlidingWindowMLASpec`);
* per compressor: an "mla" layer of its row width keeping one row per C tokens (`tokens_per_row`,
  vLLM's `tokens_per_state`), every TP rank holding it whole (one KV head);
* the rest: one "recurrent" layer ("compressed") of replicated components (one unit each): each
  compressor's buffer rows and gates padded to C rows, and its overlap rows and gates (vLLM keeps
  the open window in a per-request ring block, `CircularBufferSpec`).

Everything comes from the cache layer transformers builds for the layer type (the class its
modeling code registers in `DYNAMIC_LAYER_TYPE_MAPPING`: its `compress_rate`, `sliding_window`,
the compressors it keys, whether it keeps overlaps) and the config's row widths, not from a list
of model types. Overlapping windows project two series (Ca | Cb) per token, so their buffers are
twice the row width (transformers' CSA compressor).
"""

from __future__ import annotations

from typing import Any

from kvbridge.core.spec import Component, LayerSpec
from kvbridge.errors import ConfigError

MAX_COMPRESS_RATE = 1 << 16
"""Largest compress rate read (DeepSeek-V4 uses 4 and 128): a block holds whole rows, so the rate
sizes the smallest block and every open-window buffer; a config asking for more is refused."""

COMPRESSED_TYPES = ("heavily_compressed_attention", "compressed_sparse_attention")

# The config field giving each compressor's row width: transformers names the compressors by role
# in the cache layer's dicts and sizes them from these fields (no per-compressor width on the layer).
ROW_WIDTH_FIELDS = {"compressor": "head_dim", "indexer": "index_head_dim"}


def compressed_cache_layer(text: Any, lt: str, kw: dict[str, Any]) -> Any:
    """The cache layer transformers builds for layer type `lt`, or None where it cannot be built.
    The class is registered when its modeling module is imported, so that is imported first."""
    from kvbridge.models.modules import _decoder_layer_class

    _decoder_layer_class(text)  # imports the modeling module, which registers its cache layer classes
    try:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING
        return DYNAMIC_LAYER_TYPE_MAPPING[lt](**kw)
    except Exception:  # noqa: BLE001 - no such class here, or one of another shape
        return None


def compressed_layers(text: Any, layer: Any, lt: str, kw: dict[str, Any], read_int: Any) -> tuple[LayerSpec, ...]:
    """The window, one row-rate layer per compressor, then the per-request recurrent part.
    `read_int(layer_config, key)` reads a positive integer config field (noting defaults)."""
    built = compressed_cache_layer(text, lt, kw if kw else {"config": text})
    if built is None:
        built = compressed_cache_layer(text, lt, {"config": text})
    rate = getattr(built, "compress_rate", None)
    entries = list(getattr(built, "compressed_kv", None) or ())
    window = getattr(built, "sliding_window", None)
    if built is None or not entries:
        raise ConfigError(f"type {lt!r}: transformers' cache layer for it shows no compressors kvbridge can read")
    if not isinstance(rate, int) or isinstance(rate, bool) or not 1 <= rate <= MAX_COMPRESS_RATE:
        raise ConfigError(f"type {lt!r}: compress rate {rate!r}; needs an integer in [1, {MAX_COMPRESS_RATE}]")
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise ConfigError(f"type {lt!r}: sliding window {window!r}; needs an integer >= 2")
    unknown = [e for e in entries if e not in ROW_WIDTH_FIELDS]
    if unknown:
        raise ConfigError(f"type {lt!r}: compressor {unknown[0]!r} has no known row width")
    overlap = getattr(built, "overlap_kv", None) is not None
    head_dim = read_int(layer, "head_dim")
    out = [LayerSpec("mla", 1, head_dim, window=window)]
    state: list[Component] = []
    for name in entries:
        dim = read_int(layer, ROW_WIDTH_FIELDS[name])
        out.append(LayerSpec("mla", 1, dim, tokens_per_row=rate))
        buffer = rate * dim * (2 if overlap else 1)
        state += [Component(f"{name}_buffer_kv", 1, buffer), Component(f"{name}_buffer_gate", 1, buffer)]
        if overlap:
            state += [Component(f"{name}_overlap_kv", 1, rate * dim), Component(f"{name}_overlap_gate", 1, rate * dim)]
    out.append(LayerSpec("recurrent", state=tuple(state), recurrent_type="compressed"))
    return tuple(out)
