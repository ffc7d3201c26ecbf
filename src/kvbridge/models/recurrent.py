"""Recurrent-state geometry of hybrid models (Mamba1/2, gated delta net, KDA, short conv, lightning, RG-LRU, CCA,
K/V convs, RWKV, mLSTM).

Each recurrent layer's state is described as components sharded on their own:

* Mamba2 conv state `[x | B | C]` (DS layout: channel-major, `rows` values per channel):
  x has `n_heads` units of `head_dim * rows`, B and C have `n_groups` units of
  `d_state * rows` (replicated when TP exceeds the groups). The SSM state has `n_heads` units
  of `head_dim * d_state`.
* Gated delta net conv `[Q | K | V]`: Q and K have `num_k_heads` units of `head_k_dim * rows`,
  V has `num_v_heads` units of `head_v_dim * rows`; the recurrent state has `num_v_heads` units
  of `head_k_dim * head_v_dim`.
* Kimi delta attention (Kimi-Linear, Bailing hybrid): the gated delta net layout with as many key
  as value heads (`linear_num_heads` of `linear_head_dim`): conv `[Q | K | V]` and a state of
  `heads` units of `head_dim * head_dim`, all by head (vLLM `kda_state_shape`).
* Mamba1 (Mamba, Falcon-Mamba, Jamba): conv `intermediate` units of `rows`, SSM `intermediate`
  units of `d_state` (one unit per expanded channel, vLLM's TP split).
* Multi-head Mamba1 (Zamba): the selective scan of Mamba1 with the expanded channels split into
  `n_heads` heads (x_proj, dt_proj per head) and no B/C groups: conv `n_heads` units of
  `head_dim * rows`, SSM `n_heads` units of `head_dim * d_state`. vLLM has no Zamba (v1) model;
  the unit is the head because the mixer's per-head projections put whole heads on a rank.
* Short conv (LFM2): one conv segment of `hidden_size` channels of `rows` values.
* Lightning attention (MiniMax-Text-01's linear-attention layers): no conv, one decayed `K^T V`
  state per head, `num_attention_heads` units of `head_dim * head_dim`; vLLM splits the heads
  over TP (`linear_attention_state_shape`: `heads / TP` of `head_dim x head_dim`, with each rank's
  slice of the per-head decay slopes), so the unit is the head.
* RG-LRU (RecurrentGemma / Griffin): a depthwise conv over `lru_width` channels and a real-gated
  linear recurrence of one value per channel. vLLM has no RecurrentGemma; the TP rule is derived
  from the mixer's weights: `linear_x` / `linear_y` split their `lru_width` outputs over ranks and
  `linear_out` its inputs (column then row parallel, as every gated MLP), the conv is per channel,
  but the RG-LRU's input and recurrence gates are block-diagonal, `num_attention_heads` blocks of
  `lru_width / heads` channels (`[heads, block, block]` weights), so a rank must hold whole blocks:
  conv `heads` units of `block * rows`, state `heads` units of `block` (float32: transformers always
  accumulates it in full precision). transformers' module keeps `conv1d_width - 1` conv columns in
  either view.
* Compressed convolutional attention (ZAYA's CCA, a "hybrid" cache layer: K/V, then this state):
  one conv state `[Q | K]` over the query and key projections, a depthwise conv of `cca_time0`
  taps then a conv grouped by head of `cca_time1` taps, so a step needs the last
  `(cca_time0 - 1) + (cca_time1 - 1)` inputs, which is what transformers keeps too (no extra
  column in either view). Q has `num_attention_heads` units of `head_dim * rows`, K has
  `num_key_value_heads` units of `head_dim * rows`: the grouped conv's groups are whole heads, so
  the conv splits with the Q and K heads of attention TP. The recurrent state is the previous
  token's delayed value projection (`v_proj_delayed`, half a value head per KV head): `num_kv_heads`
  units of `head_dim / 2`, the column-parallel split of that projection by KV head like
  `v_proj_current` (replicated when TP exceeds the KV heads). vLLM 0.32 has no ZAYA model, so this
  rule is derived from the mixer's weights, not taken from an engine.
* Short convs over K and V (Inkling, Inkling-2; "hybrid" / "hybrid_sliding" layers): the cache
  layer keeps `number_of_conv_states` conv states, each its own tensor of `kernel` values per
  channel: state 0 convolves the layer's keys and state 1 its values (`kv_heads` units of
  `key_dim * rows` / `value_dim * rows`, the K/V geometry of the attention part of the same layer,
  which differs between sliding and full layers), sharded by KV head like K/V since the conv is
  depthwise (Inkling-2's dynamic taps are shared within a KV head); any further state convolves
  the residual stream (`hidden_size` channels after the attention / MLP output projections), which
  every TP rank holds whole after the all-reduce: one replicated unit of `hidden_size * rows`.
  The model runs these convs in float32 whatever its dtype, so their states are float32. vLLM 0.32
  has no Inkling model; this too follows the weights.

* RWKV (v4, transformers' `RwkvForCausalLM`): no conv; five per-layer tensors in transformers'
  `state` order: `ffn_x` and `att_x` (the previous token's normalized hidden state, the token
  shift of the channel mix and of the time mix, model dtype) and the WKV numerator, denominator and
  running maximum (`att_num`, `att_den`, `att_max`, one float32 value per attention channel).
  vLLM has no RWKV, so the TP rule follows the weights: `key` / `value` / `receptance` project
  `hidden -> attention_hidden_size` column-parallel and the WKV recurrence is elementwise per
  channel (`time_decay`, `time_first` per channel), so num/den/max split by channel
  (`attention_hidden_size` units of one value); the token shifts feed those column-parallel
  projections their whole input, so every rank holds them whole (one replicated unit of
  `hidden_size`, as Inkling's residual-stream convs). transformers sizes every state tensor
  `hidden_size`, so an `attention_hidden_size` that differs is refused.
* mLSTM (xLSTM, transformers' `xLSTMForCausalLM`): no conv; three per-layer tensors in
  transformers' order: the matrix memory `C` `[heads, qk_head_dim, v_head_dim]`, the normalizer
  `n` `[heads, qk_head_dim]` and the stabilizer `m` `[heads, 1]` (the running maximum of the log
  gates), in the dtype of the model's embeddings (`xLSTMCache` allocates them so). The head dims are
  the config's `qk_head_dim` / `v_head_dim` (transformers sizes its cache by them; they round
  `hidden_size * qk_dim_factor` up to a multiple of 64, which the layers' projections must match
  for transformers to run at all). vLLM has no xLSTM, so the TP rule follows the weights: `q`, `k`,
  `v` and the output gate project `hidden -> heads * head_dim` and are reshaped head-major, the
  input and forget gates project to one value per head, so all five are column-parallel by head
  (the fused `qkv_opreact` / `ifgate_preact` of `weight_mode="fused"` are the same columns in one
  matrix); the recurrence and the multi-head layer norm are per head, and `out_proj` is
  row-parallel over the heads. So C, n and m each split by head (`num_heads` units): a rank
  holds whole heads. A TP size that exceeds the heads replicates them, the core's general rule for
  every unit (as KV heads under GQA); a TP size and head count neither of which divides the other
  (3 ranks, 4 heads) is refused, because a head's projections cannot be cut.

`rows` is the conv kernel minus one as serving engines keep it, or the kernel as
`transformers` keeps it. Sharding each segment separately is what makes a TP change exact; a
flat split of the concatenation would hand rank 0 all of x and none of B or C.
"""

from __future__ import annotations

import functools
from typing import Any

from kvbridge.core.spec import Component, LayerSpec
from kvbridge.errors import ConfigError


def _get(cfg: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None and value != "auto":
            if isinstance(cfg, _Noted):
                cfg.note(key, value)
            return int(value)
    raise ConfigError(f"config lacks {' / '.join(keys)}")


class _Noted(dict):  # type: ignore[type-arg]
    """A config dict that tells `note(key, value)` each size a rule reads from it (so that sizes
    config.json left to the class's defaults can be named)."""

    def __init__(self, cfg: dict[str, Any], note: Any) -> None:
        super().__init__(cfg)
        self.note = note


def mamba2_state(cfg: dict[str, Any], rows: int, state_dtype: str | None) -> tuple[Component, ...]:
    n_heads = _get(cfg, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
    if _given(cfg, "mamba_d_head", "mamba_head_dim", "mamba_headdim"):
        head_dim = _get(cfg, "mamba_d_head", "mamba_head_dim", "mamba_headdim")
    elif "state_size" in cfg and _given(cfg, "head_dim"):  # the Mamba2 architecture's own names
        head_dim = _get(cfg, "head_dim")
    else:  # "auto": the expanded hidden size split over the heads
        head_dim = _get(cfg, "mamba_expand", "expand") * _get(cfg, "hidden_size") // n_heads
    groups = _get(cfg, "mamba_n_groups", "mamba_ngroups", "n_groups")
    d_state = _get(cfg, "mamba_d_state", "ssm_state_size", "state_size")
    return (Component("conv_x", n_heads, head_dim * rows), Component("conv_b", groups, d_state * rows),
            Component("conv_c", groups, d_state * rows), Component("ssm", n_heads, head_dim * d_state, state_dtype))


def _given(cfg: dict[str, Any], *keys: str) -> bool:
    return any(cfg.get(k) not in (None, "auto") for k in keys)


def gdn_state(cfg: dict[str, Any], rows: int, state_dtype: str | None) -> tuple[Component, ...]:
    k_heads, v_heads = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_num_value_heads")
    k_dim, v_dim = _get(cfg, "linear_key_head_dim"), _get(cfg, "linear_value_head_dim")
    return (Component("conv_q", k_heads, k_dim * rows), Component("conv_k", k_heads, k_dim * rows),
            Component("conv_v", v_heads, v_dim * rows), Component("recurrent", v_heads, k_dim * v_dim, state_dtype))


def kda_state(cfg: dict[str, Any], rows: int, state_dtype: str | None) -> tuple[Component, ...]:
    heads, dim = _get(cfg, "linear_num_heads"), _get(cfg, "linear_head_dim")
    return (Component("conv_q", heads, dim * rows), Component("conv_k", heads, dim * rows),
            Component("conv_v", heads, dim * rows), Component("recurrent", heads, dim * dim, state_dtype))


def mamba1_state(cfg: dict[str, Any], rows: int, state_dtype: str | None) -> tuple[Component, ...]:
    """Mamba1 (selective scan): conv over the `intermediate` expanded channels and an SSM state of
    `d_state` per channel; vLLM shards both over TP by channel (`mamba1_state_shape`:
    `intermediate / TP` rows of `kernel - 1` and of `d_state`), so the channel is the unit."""
    if _given(cfg, "mamba_expand"):  # Jamba: the mixer's width is mamba_expand * hidden_size
        channels = _get(cfg, "mamba_expand") * _get(cfg, "hidden_size")
    else:  # Mamba / Falcon-Mamba: intermediate_size (= expand * hidden_size)
        channels = _get(cfg, "intermediate_size")
    d_state = _get(cfg, "mamba_d_state", "state_size")
    return (Component("conv_x", channels, rows), Component("ssm", channels, d_state, state_dtype))


def mamba1_heads_state(cfg: dict[str, Any], rows: int, state_dtype: str | None) -> tuple[Component, ...]:
    n_heads = _get(cfg, "n_mamba_heads", "mamba_n_heads", "mamba_num_heads")
    channels = _get(cfg, "mamba_expand") * _get(cfg, "hidden_size")
    if channels % n_heads:
        raise ConfigError(f"{n_heads} mamba heads do not split {channels} expanded channels")
    head_dim = channels // n_heads
    d_state = _get(cfg, "mamba_d_state", "state_size")
    return (Component("conv_x", n_heads, head_dim * rows), Component("ssm", n_heads, head_dim * d_state, state_dtype))


def rglru_state(cfg: dict[str, Any], rows: int, state_dtype: str | None) -> tuple[Component, ...]:
    blocks, width = _get(cfg, "num_attention_heads"), _get(cfg, "lru_width")
    if width % blocks:
        raise ConfigError(f"{blocks} RG-LRU blocks do not split lru_width {width}")
    block = width // blocks
    return (Component("conv_x", blocks, block * rows), Component("recurrent", blocks, block, state_dtype or "float32"))


def lightning_state(cfg: dict[str, Any], state_dtype: str | None) -> tuple[Component, ...]:
    heads = _get(cfg, "num_attention_heads")
    # the mixer's own rule: head_dim when the config sets one, else hidden_size / heads
    dim = _get(cfg, "head_dim") if _given(cfg, "head_dim") else _get(cfg, "hidden_size") // heads
    return (Component("recurrent", heads, dim * dim, state_dtype),)


def rwkv_state(cfg: dict[str, Any], state_dtype: str | None) -> tuple[Component, ...]:
    hidden = _get(cfg, "hidden_size")
    channels = _get(cfg, "attention_hidden_size") if _given(cfg, "attention_hidden_size") else hidden
    if channels != hidden:
        raise ConfigError(f"RWKV attention_hidden_size {channels} != hidden_size {hidden}: transformers' `state` "
                          f"tensors are hidden_size wide, so its cache cannot hold the WKV state")
    f32 = state_dtype or "float32"  # transformers keeps the WKV state in float32 whatever the model dtype
    return (Component("ffn_x", 1, hidden), Component("att_x", 1, hidden), Component("att_num", channels, 1, f32),
            Component("att_den", channels, 1, f32), Component("att_max", channels, 1, f32))


def mlstm_state(cfg: dict[str, Any], state_dtype: str | None) -> tuple[Component, ...]:
    """`cfg` must carry the config class's derived `qk_head_dim` / `v_head_dim` (properties of
    transformers' `xLSTMConfig`, not in its `to_dict()`; `models.config` adds them)."""
    heads, qk, v = _get(cfg, "num_heads"), _get(cfg, "qk_head_dim"), _get(cfg, "v_head_dim")
    return (Component("C", heads, qk * v, state_dtype), Component("n", heads, qk, state_dtype),
            Component("m", heads, 1, state_dtype))


def short_conv_state(cfg: dict[str, Any], rows: int) -> tuple[Component, ...]:
    return (Component("conv", _get(cfg, "hidden_size"), rows),)


def cca_state(cfg: dict[str, Any], rows: int) -> tuple[Component, ...]:
    q_heads, kv_heads = _get(cfg, "num_attention_heads"), _get(cfg, "num_key_value_heads")
    head_dim = _get(cfg, "head_dim")
    if head_dim % 2:
        raise ConfigError(f"CCA splits each value head in two halves; head_dim {head_dim} is odd")
    return (Component("conv_q", q_heads, head_dim * rows), Component("conv_k", kv_heads, head_dim * rows),
            Component("v_delayed", kv_heads, head_dim // 2))


def kv_conv_state(cfg: dict[str, Any], rows: int, attention: LayerSpec | None,
                  states: int) -> tuple[tuple[Component, ...], tuple[int, ...]]:
    """The K conv, the V conv, then `states - 2` residual-stream convs, one conv state each."""
    if attention is None or attention.kind not in ("full", "sliding"):
        raise ConfigError("short convs over K and V need the layer's attention part (a hybrid cache layer)")
    if states < 2:
        raise ConfigError(f"short convs over K and V keep two conv states at least, transformers gives {states}")
    heads, f32 = attention.num_kv_heads, "float32"
    out = [Component("conv_k", heads, attention.key_dim * rows, f32),
           Component("conv_v", heads, attention.value_dim * rows, f32)]
    out += [Component(f"conv_h{s}", 1, _get(cfg, "hidden_size") * rows, f32) for s in range(2, states)]
    return tuple(out), (1,) * states


# Which recurrent mixer a layer has, from the fields its config class defines. transformers gives
# every recurrent layer the same cache class (LinearAttentionLayer) and no description of what its
# conv and recurrent states hold, so this is the one place a table is needed: the first signal
# field present names the state layout, whose geometry the functions above read. A kind with no
# kernel fields keeps no conv state (conv_rows 0).
_SIGNALS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("gdn", ("linear_num_key_heads",), ("linear_conv_kernel_dim",)),
    ("kda", ("linear_num_heads",), ("linear_conv_kernel_dim",)),
    ("short_conv", ("conv_L_cache",), ("conv_L_cache",)),
    ("lightning", ("linear_attn_alpha_factor",), ()),  # MiniMax: its linear layers' residual scaling
    ("rglru", ("lru_width",), ("conv1d_width",)),  # RecurrentGemma
    ("rwkv", ("rescale_every",), ()),  # RWKV: its residual halving every n layers; no other config has it
    ("mlstm", ("qk_dim_factor",), ()),  # xLSTM: its query/key width factor; no other config has it
    ("mamba2", ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), ("mamba_d_conv", "conv_kernel")),
    ("mamba2", ("n_groups",), ("conv_kernel",)),  # Mamba2's own names: num_heads, head_dim, n_groups, state_size
    ("mamba1", ("mamba_d_state", "state_size"), ("mamba_d_conv", "conv_kernel")),  # no heads, no groups
    ("cca", ("cca_time0",), ("cca_time0", "cca_time1")),  # ZAYA: two stacked convs, see _kernel
    ("kv_conv", ("conv_kernel_size",), ("conv_kernel_size",)),  # Inkling: `sconv_kernel_size` is its alias
)


def recurrent_kind(cfg: dict[str, Any], config: Any = None) -> str | None:
    """The mixer kind the config's signal fields name, None when none does (`config`: the config
    object, whose class's own fields alone may name it: `without_stray_signals`)."""
    if config is not None:
        cfg = without_stray_signals(cfg, config)
    return next((kind for kind, signals, _ in _SIGNALS if _given(cfg, *signals)), None)


@functools.lru_cache(maxsize=128)
def _class_fields(cls: type) -> frozenset[str] | None:
    """The fields a config class defines: its defaults' keys, its attribute_map names and its own
    attributes and properties (None when the class cannot be built bare)."""
    try:
        fields = set(cls().to_dict())
    except Exception:  # noqa: BLE001 - classes whose defaults fail their own validation
        return None
    fields |= set(getattr(cls, "attribute_map", {}) or {})
    fields |= {name for klass in cls.__mro__ if klass.__module__.startswith("transformers.models.")
               for name in vars(klass)}
    return frozenset(fields)


def without_stray_signals(cfg: dict[str, Any], config: Any) -> dict[str, Any]:
    """`cfg` without the signal fields of `_SIGNALS` that `config`'s class does not define: a field
    copied from a sibling architecture's config.json (Qwen3-Next's `linear_num_key_heads` beside a
    Mamba2 mixer) is not read by this architecture, and would name another mixer."""
    known = _class_fields(type(config))
    if known is None:
        return cfg
    stray = {k for _, signals, _ in _SIGNALS for k in signals if k in cfg and k not in known}
    return {k: v for k, v in cfg.items() if k not in stray} if stray else cfg


def _kernel(cfg: dict[str, Any], kind: str, keys: tuple[str, ...]) -> int:
    """The conv's receptive field in tokens: CCA's two stacked convs see `t0 + t1 - 1` tokens."""
    if kind == "cca":
        return sum(_get(cfg, k) for k in keys) - 1
    return _get(cfg, *keys)


def recurrent_layer(cfg: dict[str, Any], conv_rows_extra: int, state_dtype: str | None, index: int,
                    layer_type: str, attention: LayerSpec | None = None, states: int = 1, *,
                    kind: str | None = None, reads: Any = None) -> LayerSpec:
    """The state of a recurrent layer (`cfg`: the text config with transformers' defaults);
    `conv_rows_extra` is -1 (engine view: kernel - 1 columns) or 0 (transformers: kernel).
    `attention`: the attention part of the same cache layer (hybrid layers), `states`: the conv
    states transformers gives the layer (`number_of_states`). `kind`: the mixer kind when the
    module transformers builds says it (`modules.mixer_geometry`), else the config's signal fields
    choose; `reads(key, value)` is told each size read from `cfg`."""
    if reads is not None:
        cfg = _Noted(cfg, reads)
    wanted = kind
    for kind, signals, kernel in _SIGNALS:
        if wanted is not None and kind != {"mamba1_heads": "mamba2"}.get(wanted, wanted):
            continue
        if wanted is not None or _given(cfg, *signals):
            if kind == "mamba2" and (wanted == "mamba1_heads" or wanted is None and not _given(
                    cfg, "mamba_n_groups", "mamba_ngroups", "n_groups")):
                kind = "mamba1_heads"  # heads but no B/C groups: Mamba1's scan split by heads (Zamba)
            if not kernel:  # no conv state
                state = (rwkv_state(cfg, state_dtype) if kind == "rwkv" else mlstm_state(cfg, state_dtype)
                         if kind == "mlstm" else lightning_state(cfg, state_dtype))
                return LayerSpec("recurrent", state=state, recurrent_type=kind)
            if kind in ("cca", "rglru"):  # transformers keeps exactly the inputs a step needs: no extra column
                conv_rows_extra = -1
            rows = _kernel(cfg, kind, kernel) + conv_rows_extra
            if rows < 1:
                raise ConfigError(f"layer {index}: conv kernel {rows - conv_rows_extra} too small")
            if kind == "kv_conv":
                state, split = kv_conv_state(cfg, rows, attention, states)
                return LayerSpec("recurrent", state=state, recurrent_type="kv_conv", conv_rows=rows,
                                 conv_states=split)
            if states != 1:
                raise ConfigError(f"layer {index}: transformers keeps {states} conv/recurrent states; kvbridge knows "
                                  f"one for a {kind} mixer")
            if kind == "cca":
                state = cca_state(cfg, rows)
            elif kind == "gdn":
                state = gdn_state(cfg, rows, state_dtype)
            elif kind == "short_conv":
                state = short_conv_state(cfg, rows)
            elif kind == "rglru":
                state = rglru_state(cfg, rows, state_dtype)
            elif kind == "kda":
                state = kda_state(cfg, rows, state_dtype)
            elif kind == "mamba1":
                state = mamba1_state(cfg, rows, state_dtype)
            elif kind == "mamba1_heads":
                state = mamba1_heads_state(cfg, rows, state_dtype)
            else:
                state = mamba2_state(cfg, rows, state_dtype)
            return LayerSpec("recurrent", state=state, recurrent_type=kind, conv_rows=rows)  # type: ignore[arg-type]
    raise ConfigError(f"layer {index} has type {layer_type!r} (recurrent state of a mixer whose state layout "
                      f"kvbridge does not know); kvbridge cannot move it yet")
