"""A model's cache of a class of its own <-> the standard `DynamicCache` the bridge reads and writes.

transformers lets a few models keep a cache that is not a `DynamicCache` of per-layer cache
layers: `generate` gives them none (`_supports_default_dynamic_cache()` is False) and their
forward builds and demands its own class. MiniMax-Text-01's `MiniMaxCache` is one: its attention
K/V are ordinary `DynamicLayer`s, but each lightning-attention layer's state `[batch, heads,
head_dim, head_dim]` sits in a `linear_cache` list beside them (and `layers` may stop at the last
attention layer). `hf_cache` moves standard caches only, so a prefill's cache is viewed as the
`DynamicCache` its config describes, that state as the layer's recurrent state, and a rebuilt cache
goes back to the model in its own class. transformers describes such a class in no general way, so
the one layout known here is recognized by that list; another own class is refused by name.

RWKV keeps its state in no `Cache` at all: its forward takes and returns `state`, a list of
tensors `[batch, channels, layers]` (`models.own_state.STATE_LIST_KINDS`). The bridge views it as
a `DynamicCache` of one `LinearAttentionLayer` per layer whose recurrent state `s` is list entry
`s` at that layer (`[batch, channels]`), and stacks it back into the list for the model.

xLSTM keeps its state in an object of its own class (`xLSTMCache`, no `Cache` subclass) whose
`rnn_state` dict holds per layer a tuple (C, n, m) of `[batch, heads, ...]` tensors
(`models.own_state.STATE_DICT_KINDS`). The bridge views tuple entry `s` of layer `l` as recurrent
state `s` of a `LinearAttentionLayer`, flattened to `[batch, heads * ...]` (head-major, the spec's
components), and goes back through the class the model's forward annotates its cache parameter
with, built for the config and filled with those tensors in their own shapes.
"""

from __future__ import annotations

import copy
import inspect
import sys
import typing
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from kvbridge.core.spec import ModelSpec
from kvbridge.errors import ConfigError
from kvbridge.models.looped import loop_copies
from kvbridge.models.own_state import STATE_DICT_KINDS, moved_outside_cache
from kvbridge.models.recurrent import recurrent_kind


def _state_list_cache(layers: int, states: int) -> DynamicCache:
    """An empty `DynamicCache` of `layers` recurrent layers of `states` recurrent states each."""
    cache = DynamicCache()
    cache.layers = [LinearAttentionLayer(number_of_states=states) for _ in range(layers)]
    return cache


def empty_cache(config: PretrainedConfig, spec: ModelSpec) -> DynamicCache:
    """The empty `DynamicCache` that `spec`'s layers go into: the one `config` describes, or for a
    model keeping a state list (RWKV), which transformers lays out as attention, one recurrent
    layer per spec layer with one state per component; a looped model's (Dory) with the copies of its
    looped layers that its forward appends (`models.looped`)."""
    text = config.get_text_config(decoder=True)
    if not moved_outside_cache(text):
        cache = DynamicCache(config=config)
        copies = loop_copies(text, len(cache.layers)) if cache.layers else None
        if copies is not None:  # a looped model's per-loop copies, appended as its forward appends them
            looped, extra = copies
            cache.layers += [copy.deepcopy(cache.layers[i]) for _ in range(extra) for i in looped]
        return cache
    return _state_list_cache(spec.num_layers, max(len(layer.state) for layer in spec.layers))


def _is_state_list(cache: Any) -> bool:
    return isinstance(cache, (list, tuple)) and bool(cache) and all(isinstance(t, torch.Tensor) for t in cache)


def _from_state_list(state: Any) -> DynamicCache:
    layers = state[0].shape[-1]
    if any(t.dim() != 3 or t.shape[-1] != layers for t in state):
        raise ConfigError(f"state list {[tuple(t.shape) for t in state]}: expected [batch, channels, layers] each")
    cache = _state_list_cache(layers, len(state))
    for li, layer in enumerate(cache.layers):
        for si, t in enumerate(state):
            layer.update_recurrent_state(t[..., li], state_idx=si)
            layer.has_previous_state[si] = True
    return cache


def _to_state_list(cache: DynamicCache) -> list[torch.Tensor]:
    states = cache.layers[0].number_of_states
    return [torch.stack([layer.recurrent_states[si] for layer in cache.layers], dim=-1).contiguous()
            for si in range(states)]


def _layer_dict(state: Any) -> dict[int, tuple[torch.Tensor, ...]] | None:
    """The one attribute of an object of a model's own class holding a dict layer index 0..L-1 ->
    tuple of tensors (xLSTM's `rnn_state`); None when it holds no such dict (or several)."""
    if isinstance(state, (Cache, list, tuple, dict, torch.Tensor)) or not hasattr(state, "__dict__"):
        return None
    found = [v for v in vars(state).values()
             if isinstance(v, dict) and v and sorted(v) == list(range(len(v)))
             and all(isinstance(t, (tuple, list)) and t and all(isinstance(x, torch.Tensor) for x in t)
                     for t in v.values())]
    return found[0] if len(found) == 1 else None


def _from_layer_dict(states: dict[int, tuple[torch.Tensor, ...]]) -> DynamicCache:
    held = {len(t) for t in states.values()}
    if len(held) != 1:
        raise ConfigError(f"per-layer state tuples of {sorted(held)} tensors: expected the same for every layer")
    cache = _state_list_cache(len(states), held.pop())
    for li, layer in enumerate(cache.layers):
        for si, t in enumerate(states[li]):
            layer.update_recurrent_state(t.reshape(t.shape[0], -1), state_idx=si)
            layer.has_previous_state[si] = True
    return cache


def own_state_class(model: Any) -> type:
    """The class of the state object the model's forward takes (its cache parameter's annotation,
    `xLSTMCache | None`): transformers names it nowhere else."""
    params = inspect.signature(model.forward).parameters
    name = next((n for n in ("cache", "cache_params", "past_key_values") if n in params), None)
    try:
        hint = typing.get_type_hints(type(model).forward).get(name) if name else None
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: refused below
        hint = None
    found = [c for c in typing.get_args(hint) or (hint,) if isinstance(c, type) and c is not type(None)]
    if len(found) != 1:
        raise ConfigError(f"{type(model).__name__}'s forward names no state class for its `{name}` argument; kvbridge "
                          "cannot rebuild the state object it takes")
    return found[0]


def _to_layer_dict(cache: DynamicCache, model: Any, tokens: int | None) -> Any:
    """A state object of the model's own class holding the standard `cache`'s recurrent states in the
    shapes the class gives them. transformers 5.24's `generate` reads `is_compileable` and
    `is_linear` from any cache it is given, which such a class lacks (generate only continues one the
    model built itself): it is told the cache cannot be compiled and that every layer is recurrent,
    so generate passes the new tokens unsliced (the caller gives only those, as to RWKV)."""
    first = cache.layers[0].recurrent_states[0]
    own = own_state_class(model)(model.config, max_batch_size=first.shape[0], dtype=first.dtype, device=first.device)
    states = _layer_dict(own)
    if states is None or len(states) != len(cache.layers):
        raise ConfigError(f"{type(own).__name__} holds no per-layer state dict of {len(cache.layers)} layers")
    for li, layer in enumerate(cache.layers):
        if len(states[li]) != layer.number_of_states:
            raise ConfigError(f"layer {li}: {type(own).__name__} keeps {len(states[li])} tensors, the cache "
                              f"{layer.number_of_states}")
        states[li] = tuple(layer.recurrent_states[si].reshape(t.shape).clone() for si, t in enumerate(states[li]))
    if tokens is not None and isinstance(getattr(own, "seqlen_offset", None), torch.Tensor):
        own.seqlen_offset.fill_(tokens)  # the tokens the state has seen (xLSTM counts them; nothing reads it)
    own.is_compileable, own.is_linear = False, [True] * len(cache.layers)
    return own


def _holds_linear_list(cache: Any) -> bool:
    return isinstance(getattr(cache, "linear_cache", None), list)


def standard_cache(cache: Any, config: PretrainedConfig) -> Any:
    """`cache` itself when it is standard; a cache of the MiniMax layout as the `DynamicCache` that
    `config` describes, holding the same tensors (attention K/V; each linear layer's state as its
    recurrent state, marked as continuing, as a prefill leaves a layer with state)."""
    if _is_state_list(cache):
        return _from_state_list(cache)
    states = _layer_dict(cache)
    if states is not None:
        return _from_layer_dict(states)
    if not _holds_linear_list(cache):
        return cache
    std = DynamicCache(config=config.get_text_config(decoder=True))
    states = cache.linear_cache
    for i, layer in enumerate(std.layers):
        state = states[i] if i < len(states) else []
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if isinstance(state, torch.Tensor):
                std.update_recurrent_state(state, i)
                layer.has_previous_state[0] = True
            continue
        if isinstance(state, torch.Tensor):
            raise ConfigError(f"cache layer {i}: {type(cache).__name__} holds a linear-attention state there, the "
                              f"config makes it {type(layer).__name__}")
        held = cache.layers[i] if i < len(cache.layers) else None
        if held is not None and getattr(held, "is_initialized", False):
            std.update(held.keys, held.values, i)
    return std


def own_cache_class(model: Any) -> type | None:
    """The cache class the model's forward demands, or None when a `DynamicCache` will do: the `Cache`
    subclass its modeling module defines, for a model `generate` gives no `DynamicCache`."""
    if model._supports_default_dynamic_cache():
        return None
    module = sys.modules[type(model).__module__]
    found = [c for c in vars(module).values()
             if isinstance(c, type) and issubclass(c, Cache) and c.__module__ == module.__name__]
    if len(found) != 1 or not hasattr(found[0], "set_linear_cache"):
        raise ConfigError(f"{type(model).__name__} keeps a cache of its own ({[c.__name__ for c in found]}) whose layout "
                          "kvbridge does not know")
    return found[0]


def model_cache(cache: DynamicCache, model: Any, tokens: int | None = None) -> Any:
    """The standard `cache` in the class the model's forward takes (inverse of `standard_cache`);
    `tokens`: how many tokens it holds, for a state object that counts them."""
    if moved_outside_cache(model.config):
        if recurrent_kind(model.config.to_dict(), model.config) in STATE_DICT_KINDS:
            return _to_layer_dict(cache, model, tokens)
        return _to_state_list(cache)
    cls = own_cache_class(model)
    if cls is None:
        return cache
    own = cls()
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if layer.is_recurrent_states_initialized.get(0):
                own.set_linear_cache(i, layer.recurrent_states[0])
        elif getattr(layer, "is_initialized", False):
            own.update(layer.keys, layer.values, i)
    return own


__all__ = ["empty_cache", "model_cache", "own_cache_class", "own_state_class", "standard_cache"]
