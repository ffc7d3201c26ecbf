"""Recurrent-state geometry of hybrid models (Mamba2, gated delta net, short conv) from configs.

Each recurrent layer's state is described as components sharded on their own:

* Mamba2 conv state `[x | B | C]` (DS layout: channel-major, `rows` values per channel):
  x has `n_heads` units of `head_dim * rows`, B and C have `n_groups` units of
  `d_state * rows` (replicated when TP exceeds the groups). The SSM state has `n_heads` units
  of `head_dim * d_state`.
* Gated delta net conv `[Q | K | V]`: Q and K have `num_k_heads` units of `head_k_dim * rows`,
  V has `num_v_heads` units of `head_v_dim * rows`; the recurrent state has `num_v_heads` units
  of `head_k_dim * head_v_dim`.
* Short conv (LFM2): one conv segment of `hidden_size` channels of `rows` values.

`rows` is the conv kernel minus one as serving engines keep it, or the kernel as
`transformers` keeps it. Sharding each segment separately is what makes a TP change exact; a
flat split of the concatenation would hand rank 0 all of x and none of B or C.
"""

from __future__ import annotations

from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.core.spec import Component, LayerSpec


def _get(cfg: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None and value != "auto":
            return int(value)
    raise ConfigError(f"config lacks {' / '.join(keys)}")


def mamba2_state(cfg: dict[str, Any], rows: int, state_dtype: str | None) -> tuple[Component, ...]:
    n_heads = _get(cfg, "mamba_n_heads", "mamba_num_heads")
    if cfg.get("mamba_d_head") in (None, "auto") and cfg.get("mamba_head_dim") is None:
        head_dim = int(cfg.get("mamba_expand", 2)) * _get(cfg, "hidden_size") // n_heads
    else:
        head_dim = _get(cfg, "mamba_d_head", "mamba_head_dim")
    groups = _get(cfg, "mamba_n_groups", "n_groups")
    d_state = _get(cfg, "mamba_d_state", "ssm_state_size")
    return (Component("conv_x", n_heads, head_dim * rows), Component("conv_b", groups, d_state * rows),
            Component("conv_c", groups, d_state * rows), Component("ssm", n_heads, head_dim * d_state, state_dtype))


def gdn_state(cfg: dict[str, Any], rows: int, state_dtype: str | None) -> tuple[Component, ...]:
    k_heads, v_heads = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_num_value_heads")
    k_dim, v_dim = _get(cfg, "linear_key_head_dim"), _get(cfg, "linear_value_head_dim")
    return (Component("conv_q", k_heads, k_dim * rows), Component("conv_k", k_heads, k_dim * rows),
            Component("conv_v", v_heads, v_dim * rows), Component("recurrent", v_heads, k_dim * v_dim, state_dtype))


def short_conv_state(cfg: dict[str, Any], rows: int) -> tuple[Component, ...]:
    return (Component("conv", _get(cfg, "hidden_size"), rows),)


def _attention(cfg: dict[str, Any]) -> LayerSpec:
    q_heads = _get(cfg, "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or q_heads)
    head_dim = int(cfg.get("head_dim") or _get(cfg, "hidden_size") // q_heads)
    return LayerSpec("full", kv_heads, head_dim, head_dim)


def hybrid_layers(cfg: dict[str, Any], arch: str, num_layers: int, conv_rows_extra: int,
                  state_dtype: str | None) -> tuple[LayerSpec, ...]:
    """Per-layer specs of a hybrid model; `conv_rows_extra` is -1 (engine view) or 0 (transformers)."""
    if arch in ("bamba", "granitemoehybrid"):
        rows = _get(cfg, "mamba_d_conv", "conv_kernel") + conv_rows_extra
        if cfg.get("layer_types"):
            is_attn = [t in ("attention", "full_attention") for t in cfg["layer_types"]]
        elif cfg.get("layers_block_type"):
            is_attn = [t == "attention" for t in cfg["layers_block_type"]]
        else:
            attn = set(cfg.get("attn_layer_indices") or ())
            is_attn = [i in attn for i in range(num_layers)]
        state = mamba2_state(cfg, rows, state_dtype)
        kind = "mamba2"
    elif arch == "qwen3_next":
        rows = _get(cfg, "linear_conv_kernel_dim") + conv_rows_extra
        is_attn = [t == "full_attention" for t in cfg.get("layer_types") or
                   ["full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0
                    else "linear_attention" for i in range(num_layers)]]
        state = gdn_state(cfg, rows, state_dtype)
        kind = "gdn"
    elif arch == "lfm2":
        rows = _get(cfg, "conv_L_cache") + conv_rows_extra
        if cfg.get("layer_types"):
            is_attn = [t == "full_attention" for t in cfg["layer_types"]]
        else:
            attn = set(cfg.get("full_attn_idxs") or ())
            is_attn = [i in attn for i in range(num_layers)]
        state = short_conv_state(cfg, rows)
        kind = "short_conv"
    else:  # pragma: no cover - guarded by the caller
        raise ConfigError(f"no recurrent-state rules for {arch!r}")
    if len(is_attn) != num_layers:
        raise ConfigError(f"{arch}: {len(is_attn)} layer types for {num_layers} layers")
    if rows < 1:
        raise ConfigError(f"{arch}: conv kernel too small ({rows - conv_rows_extra})")
    attention = _attention(cfg) if any(is_attn) else None
    recurrent = LayerSpec("recurrent", state=state, recurrent_type=kind, conv_rows=rows)  # type: ignore[arg-type]
    return tuple(attention if a else recurrent for a in is_attn)  # type: ignore[misc]
