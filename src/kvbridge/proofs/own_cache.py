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
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from kvbridge.core.spec import ModelSpec
from kvbridge.errors import ConfigError
from kvbridge.models.own_state import moved_outside_cache


def _state_list_cache(layers: int, states: int) -> DynamicCache:
    """An empty `DynamicCache` of `layers` recurrent layers of `states` recurrent states each."""
    cache = DynamicCache()
    cache.layers = [LinearAttentionLayer(number_of_states=states) for _ in range(layers)]
    return cache


def empty_cache(config: PretrainedConfig, spec: ModelSpec) -> DynamicCache:
    """The empty `DynamicCache` that `spec`'s layers go into: the one `config` describes, or for a
    model keeping a state list (RWKV), which transformers lays out as attention, one recurrent
    layer per spec layer with one state per component."""
    if not moved_outside_cache(config.get_text_config(decoder=True)):
        return DynamicCache(config=config)
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


def _holds_linear_list(cache: Any) -> bool:
    return isinstance(getattr(cache, "linear_cache", None), list)


def standard_cache(cache: Any, config: PretrainedConfig) -> Any:
    """`cache` itself when it is standard; a cache of the MiniMax layout as the `DynamicCache` that
    `config` describes, holding the same tensors (attention K/V; each linear layer's state as its
    recurrent state, marked as continuing, as a prefill leaves a layer with state)."""
    if _is_state_list(cache):
        return _from_state_list(cache)
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


def model_cache(cache: DynamicCache, model: Any) -> Any:
    """The standard `cache` in the class the model's forward takes (inverse of `standard_cache`)."""
    if moved_outside_cache(model.config):
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


__all__ = ["empty_cache", "model_cache", "own_cache_class", "standard_cache"]
