"""Models whose recurrent state lives in no transformers `Cache`: moved when kvbridge knows the
state's layout (RWKV's `state` list, xLSTM's `xLSTMCache`, `moved_outside_cache`), else refused
with what they keep.

transformers lays every layer of a config without `layer_types` out as attention, so a model whose
mixer is recurrent but keeps its state outside the cache machinery (RWKV's `state`, five tensors
`[batch, channels, layers]`; xLSTM's `xLSTMCache`, a plain class with per-layer mLSTM states) looks
like an attention model that lacks its head count. The signal transformers gives is the model
class: `generate` gives it no `DynamicCache` (`_supports_default_dynamic_cache()` is False) and its
modeling module defines no `Cache` subclass (MiniMax's own `Cache` class is handled by
`proofs.own_cache`). What it keeps is read from a one-token forward on the meta device (no memory,
no weights), so the refusal names the state's real per-layer shapes instead of a missing field.
"""

from __future__ import annotations

import sys
from typing import Any

_OUTPUT_FIELDS_NOT_STATE = ("loss", "logits", "hidden_states", "attentions", "last_hidden_state")


def causal_lm_class(config: Any) -> type | None:
    """The architecture's causal-LM class in the installed transformers, None when it has none."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # noqa: BLE001 - no causal LM, or its modeling module cannot be imported here
        return None


def keeps_state_outside_cache(cls: type) -> bool:
    """`generate` gives the class no `DynamicCache` and its module defines no `Cache` of its own."""
    from transformers.cache_utils import Cache

    supports = getattr(cls, "_supports_default_dynamic_cache", None)
    if supports is None or supports():
        return False
    module = sys.modules[cls.__module__]
    return not any(isinstance(c, type) and issubclass(c, Cache) and c.__module__ == module.__name__
                   for c in vars(module).values())


# Mixer kinds (recurrent.py) whose state transformers keeps outside any Cache as a list of tensors
# stacked over the layers on their last axis, each layer's slice one spec component in list order;
# `proofs.own_cache` views that list as a `DynamicCache` of recurrent layers and back.
STATE_LIST_KINDS = ("rwkv",)
# Mixer kinds whose state transformers keeps in an object of the model's own class (not a `Cache`)
# holding a dict layer index -> tuple of per-layer tensors `[batch, heads, ...]` (xLSTM's
# `xLSTMCache.rnn_state`: C, n, m), each tuple entry one spec component in tuple order.
STATE_DICT_KINDS = ("mlstm",)


def moved_outside_cache(config: Any) -> bool:
    """True for a model keeping its state outside any transformers `Cache` in a layout kvbridge
    moves: the class keeps it outside (see `keeps_state_outside_cache`) and the config names a
    mixer of `STATE_LIST_KINDS` or `STATE_DICT_KINDS`."""
    from kvbridge.models.recurrent import recurrent_kind

    if recurrent_kind(config.to_dict(), config) not in STATE_LIST_KINDS + STATE_DICT_KINDS:
        return False
    cls = causal_lm_class(config)
    return cls is not None and keeps_state_outside_cache(cls)


def _shape(t: Any) -> str:
    return f"[{', '.join(str(int(d)) for d in t.shape)}] {str(t.dtype).removeprefix('torch.')}"


def _shapes(tensors: list[Any]) -> str:
    """`5 x [96] float32` for repeated shapes, else each in turn."""
    shapes = [_shape(t) for t in tensors]
    return f"{len(shapes)} x {shapes[0]}" if len(set(shapes)) == 1 and len(shapes) > 1 else ", ".join(shapes)


def _per_layer(state: Any, num_layers: int) -> str:
    """What one layer of `state` holds: the tensors of a list stacked over the layers on their last
    axis (RWKV), or the per-layer tuple of a dict keyed by layer index inside an object (xLSTM)."""
    import torch

    if isinstance(state, (list, tuple)) and state and all(isinstance(t, torch.Tensor) for t in state):
        if all(t.shape[-1] == num_layers for t in state):
            return (f"{len(state)} tensors [batch, ..., {num_layers} layers]; per layer "
                    + _shapes([t[0, ..., 0] for t in state]))
        return f"{len(state)} tensors " + _shapes(list(state))
    for name, value in vars(state).items() if hasattr(state, "__dict__") else ():
        if isinstance(value, dict) and 0 in value and isinstance(value[0], (list, tuple)):
            tensors = [t for t in value[0] if isinstance(t, torch.Tensor)]
            return f"{type(state).__name__}.{name}; per layer " + _shapes([t[0] for t in tensors])
    return type(state).__name__


def _state_mixers(model: Any) -> str:
    """The modules of the first layer whose forward takes a state (RWKV's time mix and channel mix)."""
    import inspect

    first = next((m for n, m in model.named_modules() if n.endswith(".0")), None)
    names = [type(m).__name__ for m in (first.modules() if first is not None else ()) if m is not first
             if any("state" in p or "cache" in p for p in inspect.signature(m.forward).parameters)]
    return f" of {', '.join(dict.fromkeys(names))}" if names else ""


def outside_cache_refusal(config: Any, num_layers: int) -> str | None:
    """One line naming layer 0, the state kind and what transformers keeps per layer, for a model
    whose recurrent state is in no transformers `Cache`; None for every other model."""
    cls = causal_lm_class(config)
    if cls is None or not keeps_state_outside_cache(cls):
        return None
    import torch

    kept, field, model = "a state it builds itself", "state", None
    try:
        with torch.device("meta"):
            model = cls(config)
        with torch.inference_mode():
            out = model(torch.zeros(1, 1, dtype=torch.long, device="meta"), use_cache=True)
        field, state = next((k, v) for k, v in out.items() if k not in _OUTPUT_FIELDS_NOT_STATE and v is not None)
        kept = _per_layer(state, num_layers)
    except Exception as e:  # noqa: BLE001 - the shapes are a courtesy; the refusal stands without them
        kept = f"shapes unread: {type(e).__name__} on the meta device"
    mixers = _state_mixers(model) if model is not None else ""
    # short: the sweep's row keeps 240 characters
    return (f"layer 0 ({config.model_type} recurrent state{mixers}): {cls.__name__} keeps it in `{field}`, in no "
            f"transformers Cache ({kept}); kvbridge cannot move it yet")


__all__ = ["STATE_DICT_KINDS", "STATE_LIST_KINDS", "causal_lm_class", "keeps_state_outside_cache", "moved_outside_cache",
           "outside_cache_refusal"]
