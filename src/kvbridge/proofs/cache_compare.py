"""Comparing and saving transformers caches, bit for bit (the proof's verdict on a moved cache).

`cache_differences` names every layer where two `DynamicCache`s differ in kind, length, shape or
any bit (integer views: NaN equals NaN, -0.0 differs from 0.0); `save_cache` writes what each layer
holds to safetensors; `restore_position_history` gives an imported cache the position history a
prefill leaves beside indexer keys, which is no cache content an engine moves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvbridge.errors import ConfigError
from kvbridge.proofs.hf_cache import _cached_length, _is_attention, _is_indexed, _is_linear


def restore_position_history(cache: DynamicCache, reference: DynamicCache, num_tokens: int) -> None:
    """Give an imported cache the position history a prefill leaves beside the indexer keys
    (`DynamicIndexedLayer.indexer_position_ids`, `[rows, batch 1, tokens]`: Qwen4-Exp keeps its
    M-RoPE positions there for the indexer to rotate pooled keys). It is no cache content a serving
    engine moves: the decode engine derives a request's positions from its prompt, which for a text
    prompt are 0..N-1 on every row. They are rebuilt so, in the layout the model keeps (`reference`:
    a prefill of the same prompt); a history that is not the text positions is refused."""
    for i, (layer, ref) in enumerate(zip(cache.layers, reference.layers)):
        held = getattr(ref, "indexer_position_ids", None) if _is_indexed(ref) else None
        if held is None:
            continue
        if held.dim() != 3 or held.shape[1] != 1:
            raise ConfigError(f"cache layer {i}: indexer position history {tuple(held.shape)}, expected "
                              f"[rows, 1, {num_tokens}]")
        positions = torch.arange(num_tokens, device=held.device, dtype=held.dtype).expand(held.shape[0], 1, -1)
        if held.shape[2] != num_tokens or not torch.equal(held, positions):
            raise ConfigError(f"cache layer {i}: the indexer position history is not the text positions 0..{num_tokens - 1} "
                              f"(a multimodal prompt's M-RoPE positions); kvbridge does not derive those")
        layer.indexer_position_ids = positions.clone()


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same bytes, so that equality is bitwise (NaN == NaN, -0.0 != 0.0)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _layer_tensors(layer: Any) -> dict[str, torch.Tensor | None]:
    """What a cache layer holds, by the names `save_cache` writes."""
    out: dict[str, torch.Tensor | None] = {}
    if _is_attention(layer):
        out["keys"], out["values"] = layer.keys, layer.values
    if _is_indexed(layer):
        out["indexer_keys"] = layer.indexer_keys
        if getattr(layer, "indexer_position_ids", None) is not None:
            out["indexer_position_ids"] = layer.indexer_position_ids
    if isinstance(getattr(layer, "compressed_kv", None), dict):  # DeepSeek-V4: per compressor
        for name in layer.compressed_kv:
            for part in ("compressed_kv", "buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
                if isinstance(getattr(layer, part, None), dict):
                    out[f"{part}.{name}"] = getattr(layer, part)[name]
            out[f"entry_count.{name}"] = torch.tensor(layer.entry_count[name])
    if _is_linear(layer):  # always indexed by transformers' state index, however many states the layer keeps
        for name in ("conv_states", "recurrent_states"):
            for i, t in sorted(getattr(layer, name).items()):
                out[f"{name}.{i}"] = t
    return out


def dump_names(cache: DynamicCache) -> list[str]:
    """The tensor names `save_cache` writes for `cache` (its non-empty tensors), in layer order."""
    return [f"layers.{li}.{name}" for li, layer in enumerate(cache.layers)
            for name, t in _layer_tensors(layer).items() if t is not None]


def cache_differences(a: DynamicCache, b: DynamicCache) -> list[str]:
    """Layers where two caches differ in kind, length, shape or any bit of what they hold
    (keys, values, conv states, recurrent states)."""
    if len(a.layers) != len(b.layers):
        return [f"layer count {len(a.layers)} != {len(b.layers)}"]
    out = []
    for li, (x, y) in enumerate(zip(a.layers, b.layers)):
        if (_is_linear(x), _is_attention(x)) != (_is_linear(y), _is_attention(y)):
            out.append(f"layer {li}: {type(x).__name__} != {type(y).__name__}")
            continue
        if _is_attention(x) and _cached_length(x) != _cached_length(y):
            out.append(f"layer {li}: length {_cached_length(x)} != {_cached_length(y)}")
            continue
        if _is_linear(x) and dict(x.has_previous_state) != dict(y.has_previous_state):
            out.append(f"layer {li}: has_previous_state {x.has_previous_state} != {y.has_previous_state}")
        tx, ty = _layer_tensors(x), _layer_tensors(y)
        for name in sorted(set(tx) | set(ty)):
            s, t = tx.get(name), ty.get(name)
            if s is None or t is None:
                if (s is None) != (t is None):
                    out.append(f"layer {li} {name}: {'missing' if s is None else 'present'} != "
                               f"{'missing' if t is None else 'present'}")
            elif s.shape != t.shape or s.dtype != t.dtype:
                out.append(f"layer {li} {name}: {tuple(s.shape)} {s.dtype} != {tuple(t.shape)} {t.dtype}")
            elif not torch.equal(as_bits(s), as_bits(t)):
                n = int((as_bits(s) != as_bits(t)).sum())
                out.append(f"layer {li} {name}: {n} of {s.numel()} elements differ")
    return out


def save_cache(cache: DynamicCache, path: str | Path) -> None:
    """safetensors file with every tensor each layer holds, as transformers holds it.

    Names (one rule, `layers.{layer}.{tensor}`, the layer being transformers' cache layer index):
    attention layers `keys` / `values` `[1, H, tokens_held, D]`; sparse-attention indexers
    `indexer_keys` (and `indexer_position_ids` where the model keeps them); recurrent states always
    by transformers' state index, `conv_states.{j}` `[1, conv_dim, kernel]` and
    `recurrent_states.{j}` (j = 0 for a layer with one state; Inkling's K, V and residual convs are
    `conv_states.0`, `.1`, `.2`, ...); compressed layers (DeepSeek-V4) per compressor
    `{compressed_kv,buffer_kv,buffer_gate,overlap_kv,overlap_gate}.{compressor}` and
    `entry_count.{compressor}` (a 0-d int64).

    Every name is its own copy: where the cache holds one tensor under two names (DeepSeek-V4's
    window layers keep K and V as one tensor, so `values` is `keys`) or names views of one storage,
    each name is written as a clone (safetensors refuses shared memory), and the file's metadata
    maps each such name to the first name holding the same memory (`{"layers.3.values":
    "layers.3.keys"}`), so a reader can tell that they are one tensor in the cache."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    shared: dict[str, str] = {}
    first: dict[tuple[str, int], str] = {}  # (device, storage pointer) -> first name on that memory
    for li, layer in enumerate(cache.layers):
        for name, t in _layer_tensors(layer).items():
            if t is None:
                continue
            key = f"layers.{li}.{name}"
            storage = (str(t.device), t.untyped_storage().data_ptr())
            if storage in first and t.numel():
                shared[key] = first[storage]
            elif t.numel():
                first[storage] = key
            tensors[key] = t.detach().to("cpu", copy=True).contiguous()  # its own memory, whatever it shared
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt", **shared})


__all__ = ["as_bits", "cache_differences", "dump_names", "restore_position_history", "save_cache"]
