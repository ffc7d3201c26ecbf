"""transformers' recurrent state tensors <-> kvbridge's state components.

Hybrid models (Mamba2, gated delta net, short conv, lightning attention) keep per-request recurrent state next to
their attention layers. transformers holds it per layer as `conv_states[0]` `[1, conv_dim, kernel]`
(channel-major: Mamba2 `[x | B | C]`, GDN `[Q | K | V]`, LFM2 `[hidden]`, `kernel` values per
channel) and `recurrent_states[0]` (Mamba2 `[1, heads, head_dim, d_state]`, GDN
`[1, v_heads, k_head_dim, v_head_dim]`, MiniMax `[1, heads, head_dim, head_dim]`; LFM2 has none,
MiniMax no conv state). kvbridge's spec describes each conv segment
and the recurrent state as its own component of `units x dim` (`spec_from_hf_config(...,
view="transformers")`), so a segment of `units * dim / kernel` channels is exactly
`conv[channels].reshape(units, dim)`: unit u holds its channels' `kernel` values back to back, and a
recurrent state is `state.reshape(units, a * b)`. This module is that mapping and nothing else;
`hf_cache` decides where in the paged rank caches the components go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kvbridge.core.spec import LayerSpec, ModelSpec, normalize_dtype
from kvbridge.errors import ConfigError, InvalidRequest


def _conv_components(lspec: LayerSpec) -> list[int]:
    return [ci for ci, c in enumerate(lspec.state) if c.name.startswith("conv")]


def hf_state_shapes(lspec: LayerSpec) -> tuple[tuple[int, int, int] | None, tuple[int, ...] | None]:
    """Shapes transformers gives a recurrent layer's `conv_states[0]` and `recurrent_states[0]` (batch 1).

    conv: `[1, sum of segment channels, conv_rows]`. Recurrent: Mamba2 and multi-head Mamba1 (Zamba)
    `[1, heads, head_dim, d_state]` (head_dim = conv_x's channels per head), Mamba1 `[1, intermediate, d_state]`, GDN `[1, v_heads, k_head_dim, v_head_dim]` (k_head_dim =
    conv_q's channels per head); short conv (LFM2) keeps no recurrent state, lightning attention
    (MiniMax) no conv state and `[1, heads, head_dim, head_dim]` (its per-head `K^T V`).
    """
    if lspec.recurrent_type == "lightning":
        if len(lspec.state) != 1 or lspec.conv_rows:
            raise ConfigError(f"lightning layer: expected one state and no conv, got {[c.name for c in lspec.state]}")
        s = lspec.state[0]
        a = math.isqrt(s.dim)
        if a * a != s.dim:
            raise ConfigError(f"lightning state {s.name!r}: dim {s.dim} is not head_dim * head_dim")
        return None, (1, s.heads, a, a)
    rows = lspec.conv_rows
    convs = _conv_components(lspec)
    others = [ci for ci in range(len(lspec.state)) if ci not in convs]
    if rows < 1 or not convs:
        raise ConfigError(f"recurrent layer ({lspec.recurrent_type}) needs conv components and conv_rows >= 1")
    for ci in convs:
        c = lspec.state[ci]
        if c.dim % rows:
            raise ConfigError(f"conv component {c.name!r}: dim {c.dim} is not a multiple of conv_rows {rows}")
    conv_shape = (1, sum(lspec.state[ci].heads * lspec.state[ci].dim // rows for ci in convs), rows)
    if not others:
        return conv_shape, None
    if len(others) != 1 or others[0] != len(lspec.state) - 1:
        raise ConfigError(f"recurrent layer: expected conv components then one state, got "
                          f"{[c.name for c in lspec.state]}")
    if lspec.recurrent_type == "mamba1":  # [1, intermediate, d_state]: one row per conv channel
        s = lspec.state[others[0]]
        return conv_shape, (1, s.heads, s.dim)
    if lspec.recurrent_type not in ("mamba2", "mamba1_heads", "gdn", "kda"):
        raise ConfigError(f"transformers recurrent-state layout of {lspec.recurrent_type!r} layers is not known")
    s = lspec.state[others[0]]
    # mamba2 and multi-head mamba1 (Zamba): conv_x per head = head_dim; gdn, kda: conv_q per head = k_head_dim
    a = lspec.state[convs[0]].dim // rows
    if s.dim % a:
        raise ConfigError(f"state {s.name!r} dim {s.dim} does not split into {a} x {s.dim / a}")
    return conv_shape, (1, s.heads, a, s.dim // a)


def state_components(layer: Any, spec: ModelSpec, li: int) -> list[torch.Tensor]:
    """A recurrent cache layer's state as spec components `[units, dim]`, after
    checking it against the spec; the caller has checked that the layer is a recurrent one."""
    lspec = spec.layers[li]
    if getattr(layer, "number_of_states", 1) != 1:
        raise ConfigError(f"layer {li} keeps {layer.number_of_states} conv/recurrent states; kvbridge moves one")
    conv_shape, rec_shape = hf_state_shapes(lspec)
    first = layer.is_conv_states_initialized if conv_shape else layer.is_recurrent_states_initialized
    if not (first.get(0) and layer.has_previous_state.get(0)):
        raise InvalidRequest(f"layer {li} has no state yet; run a prefill with use_cache=True first")
    conv = layer.conv_states[0] if layer.is_conv_states_initialized.get(0) else None
    rec = layer.recurrent_states[0] if layer.is_recurrent_states_initialized.get(0) else None
    convs = _conv_components(lspec)
    if (conv is None) != (conv_shape is None) or (conv is not None and tuple(conv.shape) != conv_shape):
        raise ConfigError(
            f"layer {li}: transformers caches conv state {None if conv is None else tuple(conv.shape)}, kvbridge's "
            f"spec says {conv_shape} "
            f"({' | '.join(f'{lspec.state[ci].name} {lspec.state[ci].heads}x{lspec.state[ci].dim}' for ci in convs)}, "
            f"{lspec.conv_rows} rows)")
    if (rec is None) != (rec_shape is None) or (rec is not None and tuple(rec.shape) != rec_shape):
        raise ConfigError(f"layer {li}: transformers caches recurrent state "
                          f"{None if rec is None else tuple(rec.shape)}, kvbridge's spec says {rec_shape}")
    out = []
    offset = 0
    for ci in convs:
        c = lspec.state[ci]
        channels = c.heads * c.dim // lspec.conv_rows
        out.append(conv[0, offset:offset + channels].reshape(c.heads, c.dim))
        offset += channels
    if rec is not None:
        s = lspec.state[-1]
        out.append(rec[0].reshape(s.heads, s.dim))
    for c, t in zip(lspec.state, out):
        if normalize_dtype(str(t.dtype)) != spec.component_dtype(c):
            raise ConfigError(f"layer {li}: transformers keeps {c.name!r} as {t.dtype}, kvbridge's spec says "
                              f"{spec.component_dtype(c)} (set the state dtype to match)")
    return out


def hf_state_tensors(lspec: LayerSpec,
                     comps: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Inverse of `state_components`: transformers' conv and recurrent state tensors from components."""
    conv_shape, rec_shape = hf_state_shapes(lspec)
    if conv_shape is None:
        return None, comps[-1].reshape(rec_shape)
    convs = _conv_components(lspec)
    conv = torch.cat([comps[ci].reshape(-1, lspec.conv_rows) for ci in convs])[None]
    if tuple(conv.shape) != conv_shape:  # pragma: no cover - guarded by hf_state_shapes
        raise ConfigError(f"rebuilt conv state {tuple(conv.shape)} != {conv_shape}")
    rec = comps[-1].reshape(rec_shape) if rec_shape is not None else None
    return conv, rec



__all__ = ["hf_state_shapes", "hf_state_tensors", "state_components"]
