"""A stateful model's recurrent state kept on its modules <-> the standard `DynamicCache` the bridge moves.

transformers marks a few models `_is_stateful`: RecurrentGemma's recurrent blocks keep their conv
inputs (`conv1d_state`, `[1, lru_width, conv1d_width - 1]`) and the RG-LRU's float32 state
(`rg_lru.recurrent_states`, `[1, lru_width]`) as module attributes between forwards, and its
forward returns no cache. Its attention layers do use a `DynamicCache` they are given (otherwise
they build one and drop it), whose layers for the recurrent blocks stay empty. So a prefill is run
with a cache, the modules' state is copied into those empty layers (one conv state and one
recurrent state, as `hf_states` reads them), and before decoding on the other side the imported
state is written back onto the modules; the attention K/V stay in the cache `generate` continues.

transformers says which modules hold state (each layer's block with a `_setup_cache`, the method
its model calls to zero them), not what the attributes are called: `_STATE_ATTRIBUTES` names them
per block class, and a stateful block not in it is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from kvbridge.errors import ConfigError

# block class -> (conv state attribute, recurrent state attribute), dotted from the block
_STATE_ATTRIBUTES: dict[str, tuple[str, str]] = {
    "RecurrentGemmaRecurrentBlock": ("conv1d_state", "rg_lru.recurrent_states"),
}


def keeps_state_on_modules(model: Any) -> bool:
    """True for a model whose forward keeps state on its modules: transformers marks it stateful
    (`_is_stateful`, also set on Mamba, Bamba, Jamba and others, which return their state in a
    cache) and a decoder layer has a block its model zeroes with `_setup_cache`."""
    if not getattr(model, "_is_stateful", False):
        return False
    layers = getattr(getattr(model, "model", model), "layers", None)
    return layers is not None and any(callable(getattr(m, "_setup_cache", None)) for m in layers.modules())


def _state_blocks(model: Any) -> dict[int, tuple[Any, tuple[str, str]]]:
    """Decoder layer index -> (the block holding its state, that block's attribute names)."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ConfigError(f"layer 0: {type(model).__name__} keeps state on its modules, but has no decoder `layers`")
    out = {}
    for i, layer in enumerate(layers):
        blocks = [m for m in layer.modules() if m is not layer and callable(getattr(m, "_setup_cache", None))]
        for block in blocks:
            names = _STATE_ATTRIBUTES.get(type(block).__name__)
            if names is None:
                raise ConfigError(f"layer {i}: {type(model).__name__} keeps its state on a {type(block).__name__} "
                                  "whose attributes kvbridge does not know")
            out[i] = (block, names)
    if not out:
        raise ConfigError(f"layer 0: {type(model).__name__} is stateful but no layer has a block with `_setup_cache`")
    return out


def _get(block: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        block = getattr(block, part)
    return block


def _set(block: Any, dotted: str, value: torch.Tensor) -> None:
    *path, last = dotted.split(".")
    for part in path:
        block = getattr(block, part)
    setattr(block, last, value)


def empty_cache(config: PretrainedConfig) -> DynamicCache:
    """The cache a stateful model's prefill is given, so that its attention layers keep their K/V."""
    return DynamicCache(config=config.get_text_config(decoder=True))


def read_module_state(model: Any, cache: DynamicCache) -> DynamicCache:
    """Copy each state block's conv and recurrent state (after a forward) into `cache`'s layer of that
    index, marked as continuing, as a prefill leaves a cached recurrent layer."""
    for i, (block, (conv_name, rec_name)) in _state_blocks(model).items():
        layer = cache.layers[i]
        conv, rec = _get(block, conv_name), _get(block, rec_name)
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            raise ConfigError(f"layer {i}: the model keeps recurrent state there, the config makes it "
                              f"{type(layer).__name__}")
        if conv is None or rec is None:
            raise ConfigError(f"layer {i}: {type(block).__name__} holds no state after the forward")
        cache.update_conv_state(conv.clone(), i, conv_kernel_size=conv.shape[-1])
        cache.update_recurrent_state(rec.clone(), i)
        layer.has_previous_state[0] = True
    return cache


def write_module_state(model: Any, cache: DynamicCache) -> None:
    """Put `cache`'s recurrent layers' state onto the model's blocks (inverse of `read_module_state`),
    so that its next forward continues from it as from its own prefill."""
    for i, (block, (conv_name, rec_name)) in _state_blocks(model).items():
        layer = cache.layers[i] if i < len(cache.layers) else None
        if not (isinstance(layer, LinearAttentionCacheLayerMixin) and layer.is_conv_states_initialized.get(0)
                and layer.is_recurrent_states_initialized.get(0)):
            raise ConfigError(f"layer {i}: the cache holds no recurrent state to put on {type(block).__name__}")
        _set(block, conv_name, layer.conv_states[0].clone())
        _set(block, rec_name, layer.recurrent_states[0].clone())


__all__ = ["empty_cache", "keeps_state_on_modules", "read_module_state", "write_module_state"]
