"""K/V geometry from the attention modules transformers builds, where the config does not say it.

Some architectures size a layer's K/V in the modeling code rather than in the config (MiMo-V2's
sliding layers keep twice the KV heads of its full layers). The config cannot tell kvbridge that;
the module can: one decoder layer per distinct layer type is built on the `meta` device (no
memory, no weights) with the class transformers itself names as its decoder layer
(`_no_split_modules`), and its attention's `k_proj` / `v_proj` widths over `head_dim` give the
heads and dims the cache will hold. Architectures without that shape (fused QKV, MLA) keep the
config's numbers: this only corrects, it never refuses.
"""

from __future__ import annotations

import sys
from typing import Any


def module_kv_geometry(text: Any, layer_types: tuple[str, ...]) -> dict[int, tuple[int, int, int]]:
    """{layer index: (kv_heads, key_dim, value_dim)} for the first layer of each distinct type,
    from the attention module transformers builds; empty when it cannot be read."""
    try:
        import torch
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
        names = list(getattr(model_cls, "_no_split_modules", None) or ())
        layer_cls = getattr(sys.modules[model_cls.__module__], names[0], None) if names else None
    except Exception:  # noqa: BLE001 - no causal-LM class or modeling module: the config's numbers stand
        return {}
    if layer_cls is None:
        return {}
    out: dict[int, tuple[int, int, int]] = {}
    for lt in dict.fromkeys(layer_types):
        i = layer_types.index(lt)
        try:
            with torch.device("meta"):
                layer = layer_cls(text, layer_idx=i)
        except Exception:  # noqa: BLE001 - a constructor of another shape: keep the config's numbers
            continue
        geometry = _attention_geometry(layer)
        if geometry is not None:
            for j, other in enumerate(layer_types):
                if other == lt:
                    out[j] = geometry
    return out


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

