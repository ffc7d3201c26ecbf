"""DeepSeek-V4's compressed cache layers <-> the spec layers that describe them.

One `DeepseekV4HCACache` / `DeepseekV4CSACache` is several spec layers (`models/compressed.py`):
the window's K=V rows (`keys`, which is `values`), each compressor's compressed rows
(`compressed_kv[name]`, one per complete window of `compress_rate` tokens), then one recurrent
layer of the open window: each compressor's `buffer_kv` / `buffer_gate` (the n mod C raw rows,
padded to C rows) and, with overlapping windows, `overlap_kv` / `overlap_gate` (C rows). What
transformers derives from these (`entry_count` = rows, the window's `cumulative_length` = n) is
rebuilt from the token count on import, so that the layer is what a prefill would have left.
"""

from __future__ import annotations

from typing import Any

import torch

from kvbridge.core.spec import LayerSpec
from kvbridge.errors import ConfigError, InvalidRequest

_PARTS = ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate")


def is_compressed(layer: Any) -> bool:
    """A cache layer keeping compressed rows per compressor beside its window."""
    return isinstance(getattr(layer, "compressed_kv", None), dict) and isinstance(getattr(layer, "compress_rate", None), int)


def compressed_parts(layer: Any) -> int:
    """Spec layers of one compressed cache layer: the window, one per compressor, the open window."""
    return 2 + len(layer.compressed_kv)


def _component(name: str) -> tuple[str, str]:
    """(compressor, part) of a state component name such as 'indexer_overlap_kv'."""
    for part in _PARTS:
        if name.endswith("_" + part):
            return name[: -len(part) - 1], part
    raise ConfigError(f"state component {name!r} is no part of a compressed cache layer")


def part_rows(layer: Any, part: int, lspec: LayerSpec, li: int, num_tokens: int) -> torch.Tensor:
    """Rows `[1 head, rows held, dim]` of spec part `part` (0: the window's K=V rows, then each
    compressor's compressed rows), after checking them against the spec."""
    if not getattr(layer, "is_initialized", False) or layer.keys is None:
        raise InvalidRequest(f"layer {li} of the cache is empty; run a prefill with use_cache=True first")
    if int(layer.cumulative_length) != num_tokens:
        raise InvalidRequest(f"layer {li} has seen {int(layer.cumulative_length)} tokens, the request says {num_tokens}")
    if part == 0:
        rows, want = layer.keys[0], num_tokens - lspec.tokens_kept(num_tokens)
    else:
        name = list(layer.compressed_kv)[part - 1]
        rows, want = layer.compressed_kv[name], lspec.rows(num_tokens)
        if rows is None or layer.entry_count[name] != rows.shape[1]:
            raise InvalidRequest(f"layer {li}: compressor {name!r} holds no rows or not its entry count")
    if rows.dim() != 3 or tuple(rows.shape) != (1, want, lspec.key_dim):
        raise ConfigError(f"layer {li}: compressed cache part {part} holds {tuple(rows.shape)}, the spec keeps "
                          f"[1, {want}, {lspec.key_dim}]")
    return rows


def state_tensors(layer: Any, lspec: LayerSpec) -> list[torch.Tensor]:
    """The open window's state, one `[1 unit, dim]` per spec component (rows padded to C with zeros)."""
    rate, out = layer.compress_rate, []
    for comp in lspec.state:
        name, part = _component(comp.name)
        held = getattr(layer, part, {}).get(name)
        full = torch.zeros(rate, comp.dim // rate, dtype=held.dtype if held is not None else torch.float32,
                           device=held.device if held is not None else None)
        if held is not None:
            if held.dim() != 3 or held.shape[0] != 1 or held.shape[1] > rate or held.shape[2] != comp.dim // rate:
                raise ConfigError(f"{comp.name}: {tuple(held.shape)}, the spec keeps up to {rate} rows of "
                                  f"{comp.dim // rate}")
            full[: held.shape[1]] = held[0]
        out.append(full.reshape(1, -1))
    return out


def restore(layer: Any, window: torch.Tensor, compressed: list[torch.Tensor], states: list[torch.Tensor],
            lspec: LayerSpec, num_tokens: int) -> None:
    """Fill an empty compressed cache layer: the window's K=V `[1, N, D]` (zeros before the window:
    the layer keeps its last rows and counts N tokens), each compressor's rows `[1, rows, dim]`, and
    the open window (`num_tokens mod C` buffer rows; overlaps once a window closed)."""
    layer.update(window[None], window[None])
    for name, rows in zip(layer.compressed_kv, compressed):
        layer.compressed_kv[name] = rows.contiguous()
        layer.entry_count[name] = int(rows.shape[1])
    rate, open_rows = layer.compress_rate, num_tokens % layer.compress_rate
    for comp, t in zip(lspec.state, states):
        name, part = _component(comp.name)
        rows = t.reshape(rate, comp.dim // rate)[None]
        if part.startswith("buffer"):
            getattr(layer, part)[name] = rows[:, :open_rows].clone()
        else:
            getattr(layer, part)[name] = rows.clone() if layer.entry_count[name] else None
