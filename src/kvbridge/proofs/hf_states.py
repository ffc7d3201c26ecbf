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
recurrent state is `state.reshape(units, a * b)`. A layer may keep several conv states
(`conv_states[s]`, Inkling: its K conv, its V conv, two residual-stream convs): the spec's
`conv_states` says how many conv components each holds, in `state_idx` order, and each is mapped
as above. A state-only layer of several components (RWKV: two token shifts and the WKV
numerator, denominator and maximum) keeps component `s` as its own `recurrent_states[s]`
`[1, units * dim]` (`per_component_states`). This module is that mapping and nothing else;
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


def conv_groups(lspec: LayerSpec) -> list[list[int]]:
    """The conv components of each of the layer's conv states (transformers' `state_idx` order)."""
    convs = _conv_components(lspec)
    if not lspec.conv_states:
        return [convs]
    out, at = [], 0
    for n in lspec.conv_states:
        out.append(convs[at:at + n])
        at += n
    return out


ConvShapes = tuple[tuple[int, int, int], ...]


def per_component_states(lspec: LayerSpec) -> bool:
    """A layer with no conv and several state components keeps one recurrent state per component."""
    return lspec.is_recurrent and not _conv_components(lspec) and len(lspec.state) > 1


def _component_states(layer: Any, spec: ModelSpec, li: int) -> list[torch.Tensor]:
    """`recurrent_states[s]` `[1, units * dim]` of each component s, checked against the spec."""
    lspec = spec.layers[li]
    held = getattr(layer, "number_of_states", 1)
    if held != len(lspec.state):
        raise ConfigError(f"layer {li} keeps {held} recurrent states; kvbridge's spec has {len(lspec.state)} "
                          f"({lspec.recurrent_type}: {', '.join(c.name for c in lspec.state)})")
    out = []
    for si, c in enumerate(lspec.state):
        if not (layer.is_recurrent_states_initialized.get(si) and layer.has_previous_state.get(si)):
            raise InvalidRequest(f"layer {li} has no state {si} ({c.name}) yet; run a prefill with use_cache=True first")
        t = layer.recurrent_states[si]
        if tuple(t.shape) != (1, c.heads * c.dim):
            raise ConfigError(f"layer {li}: transformers keeps {c.name!r} as {tuple(t.shape)}, kvbridge's spec says "
                              f"{(1, c.heads * c.dim)}")
        if normalize_dtype(str(t.dtype)) != spec.component_dtype(c):
            raise ConfigError(f"layer {li}: transformers keeps {c.name!r} as {t.dtype}, kvbridge's spec says "
                              f"{spec.component_dtype(c)} (set the state dtype to match)")
        out.append(t[0].reshape(c.heads, c.dim))
    return out


def hf_state_shapes(lspec: LayerSpec) -> tuple[ConvShapes, tuple[int, ...] | None]:
    """Shapes transformers gives a recurrent layer's conv states (one per `state_idx`) and its
    `recurrent_states[0]` (batch 1).

    Each conv state: `[1, sum of its segments' channels, conv_rows]`. Recurrent: Mamba2 and multi-head
    Mamba1 (Zamba) `[1, heads, head_dim, d_state]` (head_dim = conv_x's channels per head), Mamba1
    `[1, intermediate, d_state]`, GDN `[1, v_heads, k_head_dim, v_head_dim]` (k_head_dim = conv_q's
    channels per head), CCA (ZAYA) `[1, channels]` (the delayed value projection of the last token),
    RG-LRU (RecurrentGemma, read from its modules by `module_state`) `[1, lru_width]` float32,
    lightning attention (MiniMax, no conv state) `[1, heads, head_dim, head_dim]` (its per-head
    `K^T V`); short convs (LFM2, Inkling's K/V convs) keep none.
    """
    if lspec.recurrent_type == "lightning":
        if len(lspec.state) != 1 or lspec.conv_rows:
            raise ConfigError(f"lightning layer: expected one state and no conv, got {[c.name for c in lspec.state]}")
        s = lspec.state[0]
        a = math.isqrt(s.dim)
        if a * a != s.dim:
            raise ConfigError(f"lightning state {s.name!r}: dim {s.dim} is not head_dim * head_dim")
        return (), (1, s.heads, a, a)
    rows = lspec.conv_rows
    convs = _conv_components(lspec)
    others = [ci for ci in range(len(lspec.state)) if ci not in convs]
    if rows < 1 or not convs:
        raise ConfigError(f"recurrent layer ({lspec.recurrent_type}) needs conv components and conv_rows >= 1")
    for ci in convs:
        c = lspec.state[ci]
        if c.dim % rows:
            raise ConfigError(f"conv component {c.name!r}: dim {c.dim} is not a multiple of conv_rows {rows}")
    conv_shapes = tuple((1, sum(lspec.state[ci].heads * lspec.state[ci].dim // rows for ci in group), rows)
                        for group in conv_groups(lspec))
    if not others:
        return conv_shapes, None
    if len(others) != 1 or others[0] != len(lspec.state) - 1:
        raise ConfigError(f"recurrent layer: expected conv components then one state, got "
                          f"{[c.name for c in lspec.state]}")
    s = lspec.state[others[0]]
    if lspec.recurrent_type == "mamba1":  # [1, intermediate, d_state]: one row per conv channel
        return conv_shapes, (1, s.heads, s.dim)
    if lspec.recurrent_type in ("cca", "rglru"):  # one value per channel: [1, kv_heads * head_dim / 2], [1, lru_width]
        return conv_shapes, (1, s.heads * s.dim)
    if lspec.recurrent_type not in ("mamba2", "mamba1_heads", "gdn", "kda"):
        raise ConfigError(f"transformers recurrent-state layout of {lspec.recurrent_type!r} layers is not known")
    # mamba2 and multi-head mamba1 (Zamba): conv_x per head = head_dim; gdn, kda: conv_q per head = k_head_dim
    a = lspec.state[convs[0]].dim // rows
    if s.dim % a:
        raise ConfigError(f"state {s.name!r} dim {s.dim} does not split into {a} x {s.dim / a}")
    return conv_shapes, (1, s.heads, a, s.dim // a)


def state_components(layer: Any, spec: ModelSpec, li: int) -> list[torch.Tensor]:
    """A recurrent cache layer's state as spec components `[units, dim]`, after
    checking it against the spec; the caller has checked that the layer is a recurrent one."""
    lspec = spec.layers[li]
    if per_component_states(lspec):
        return _component_states(layer, spec, li)
    conv_shapes, rec_shape = hf_state_shapes(lspec)
    held = getattr(layer, "number_of_states", 1)
    if held != max(1, len(conv_shapes)):
        raise ConfigError(f"layer {li} keeps {held} conv/recurrent states; kvbridge's spec has {len(conv_shapes)} "
                          f"({lspec.recurrent_type})")
    groups = conv_groups(lspec)
    out: list[torch.Tensor] = []
    for si, (group, shape) in enumerate(zip(groups, conv_shapes)):
        if not (layer.is_conv_states_initialized.get(si) and layer.has_previous_state.get(si)):
            raise InvalidRequest(f"layer {li} has no conv state {si} yet; run a prefill with use_cache=True first")
        conv = layer.conv_states[si]
        if tuple(conv.shape) != shape:
            raise ConfigError(
                f"layer {li}: transformers caches conv state{f' {si}' if len(groups) > 1 else ''} {tuple(conv.shape)}, "
                f"kvbridge's spec says {shape} "
                f"({' | '.join(f'{lspec.state[ci].name} {lspec.state[ci].heads}x{lspec.state[ci].dim}' for ci in group)}"
                f", {lspec.conv_rows} rows)")
        offset = 0
        for ci in group:
            c = lspec.state[ci]
            channels = c.heads * c.dim // lspec.conv_rows
            out.append(conv[0, offset:offset + channels].reshape(c.heads, c.dim))
            offset += channels
    if not conv_shapes and not (layer.is_recurrent_states_initialized.get(0) and layer.has_previous_state.get(0)):
        raise InvalidRequest(f"layer {li} has no state yet; run a prefill with use_cache=True first")
    rec = layer.recurrent_states[0] if layer.is_recurrent_states_initialized.get(0) else None
    if (rec is None) != (rec_shape is None) or (rec is not None and tuple(rec.shape) != rec_shape):
        raise ConfigError(f"layer {li}: transformers caches recurrent state "
                          f"{None if rec is None else tuple(rec.shape)}, kvbridge's spec says {rec_shape}")
    extra = [si for si in range(1, held) if layer.is_recurrent_states_initialized.get(si)]
    if extra:
        raise ConfigError(f"layer {li} keeps recurrent state in states {extra}; kvbridge moves state 0's only")
    if rec is not None:
        s = lspec.state[-1]
        out.append(rec[0].reshape(s.heads, s.dim))
    for c, t in zip(lspec.state, out):
        if normalize_dtype(str(t.dtype)) != spec.component_dtype(c):
            raise ConfigError(f"layer {li}: transformers keeps {c.name!r} as {t.dtype}, kvbridge's spec says "
                              f"{spec.component_dtype(c)} (set the state dtype to match)")
    return out


def hf_state_tensors(lspec: LayerSpec, comps: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Inverse of `state_components`: transformers' conv states (by `state_idx`) and recurrent state."""
    conv_shapes, rec_shape = hf_state_shapes(lspec)
    convs = []
    for group, shape in zip(conv_groups(lspec), conv_shapes):
        conv = torch.cat([comps[ci].reshape(-1, lspec.conv_rows) for ci in group])[None]
        if tuple(conv.shape) != shape:  # pragma: no cover - guarded by hf_state_shapes
            raise ConfigError(f"rebuilt conv state {tuple(conv.shape)} != {shape}")
        convs.append(conv)
    rec = comps[-1].reshape(rec_shape) if rec_shape is not None else None
    return convs, rec


__all__ = ["conv_groups", "hf_state_shapes", "hf_state_tensors", "per_component_states", "state_components"]
