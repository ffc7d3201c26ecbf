"""K/V geometry from the attention modules transformers builds, where the config does not say it.

Some architectures size a layer's K/V in the modeling code rather than in the config (MiMo-V2's
sliding layers keep twice the KV heads of its full layers). The config cannot tell kvbridge that;
the module can: one decoder layer per distinct layer type is built on the `meta` device (no
memory, no weights) with the class transformers itself names as its decoder layer
(`_no_split_modules`), and its attention's `k_proj` / `v_proj` widths over `head_dim` give the
heads and dims the cache will hold. Architectures without that shape (fused QKV, MLA) keep the
config's numbers: this only corrects, it never refuses.

The same built layers say which sparse-attention layers keep an indexer key cache and how wide
its rows are (`module_indexer_dims`): the attention module's `indexer` is the module that writes
it (`cache.update_indexer`), or None where the layer reuses another layer's selection and keeps
no indexer keys of its own (HY-V4's and GLM-MoE-DSA's "shared" layers); its key width is the
indexer's own head dim, whatever the config calls it (`index_head_dim`, Qwen4-Exp's
`indexer_head_dim`).
"""

from __future__ import annotations

import sys
from typing import Any


def _decoder_layer_class(text: Any) -> Any:
    """The decoder layer class transformers builds for `text` (`_no_split_modules` of its causal-LM
    class, else of its base model class, where a wrapper leaves it to its text model), or None."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING
    except Exception:  # noqa: BLE001 - no modeling code installed: the config's numbers stand
        return None
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING):
        try:
            model_cls = mapping[type(text)]
            names = list(getattr(model_cls, "_no_split_modules", None) or ())
            layer_cls = getattr(sys.modules[model_cls.__module__], names[0], None) if names else None
        except Exception:  # noqa: BLE001 - no such class for this config
            continue
        if layer_cls is not None:
            return layer_cls
    return None


def _build(layer_cls: Any, text: Any, i: int) -> Any:
    """Decoder layer `i` on the meta device (no memory, no weights), or None when it cannot be built."""
    import torch
    try:
        with torch.device("meta"):
            return layer_cls(text, layer_idx=i)
    except Exception:  # noqa: BLE001 - a constructor of another shape: keep the config's numbers
        return None


def module_kv_geometry(text: Any, layer_types: tuple[str, ...]) -> dict[int, tuple[int, int, int]]:
    """{layer index: (kv_heads, key_dim, value_dim)} for the first layer of each distinct type,
    from the attention module transformers builds; empty when it cannot be read."""
    layer_cls = _decoder_layer_class(text)
    if layer_cls is None:
        return {}
    out: dict[int, tuple[int, int, int]] = {}
    for lt in dict.fromkeys(layer_types):
        i = layer_types.index(lt)
        layer = _build(layer_cls, text, i)
        geometry = None if layer is None else _attention_geometry(layer)
        if geometry is not None:
            for j, other in enumerate(layer_types):
                if other == lt:
                    out[j] = geometry
    return out


def module_indexer_dims(text: Any, layer_types: tuple[str, ...]) -> dict[int, int]:
    """{layer index: indexer key width, 0 for a layer whose attention has no indexer of its own}
    for each "indexed_attention" layer whose decoder layer transformers builds; layers it cannot
    build (or that have no `indexer` attribute) are left out and keep the config's numbers."""
    layer_cls = _decoder_layer_class(text)
    if layer_cls is None:
        return {}
    out: dict[int, int] = {}
    for i, lt in enumerate(layer_types):
        if lt != "indexed_attention":
            continue
        layer = _build(layer_cls, text, i)  # each layer: whether it has an indexer can depend on its index
        dim = None if layer is None else _indexer_dim(layer)
        if dim is not None:
            out[i] = dim
    return out


def _indexer_dim(layer: Any) -> int | None:
    for module in layer.modules():
        if not hasattr(module, "indexer"):
            continue
        indexer = module.indexer
        if indexer is None:
            return 0
        for key in ("index_head_dim", "head_dim"):
            dim = getattr(indexer, key, None)
            if isinstance(dim, int) and not isinstance(dim, bool) and dim > 0:
                return dim
        return None
    return None


def _attention_geometry(layer: Any) -> tuple[int, int, int] | None:
    for module in layer.modules():
        k, v, head_dim = getattr(module, "k_proj", None), getattr(module, "v_proj", None), getattr(module, "head_dim", None)
        if not (isinstance(head_dim, int) and head_dim > 0 and hasattr(k, "out_features") and hasattr(v, "out_features")):
            continue
        if k.out_features % head_dim:
            return None
        heads = k.out_features // head_dim
        if heads < 1 or v.out_features % heads:
            return None
        return heads, head_dim, v.out_features // heads
    return None

