"""Runs in .venv-vllm: what vLLM 0.32's own code says about its GPU attention KV cache layouts.

Prints JSON: per backend, whether its module imports without CUDA and the layouts it declares
(`supported_kv_cache_layouts`); per combo, the byte strides of the logical [L, B, H, N, C] cache
from `compute_layout_strides`, for K/V and MLA (latent-only) specs, and the page from `compute_layer_kv_cache_shape_bytes`.
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys

BACKENDS = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", "FlexAttentionBackend"),
    "FLASHMLA": ("vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend"),
    "TRITON_MLA": ("vllm.v1.attention.backends.mla.triton_mla", "TritonMLABackend"),
    "CUTLASS_MLA": ("vllm.v1.attention.backends.mla.cutlass_mla", "CutlassMLABackend"),
    "FLASHINFER_MLA": ("vllm.v1.attention.backends.mla.flashinfer_mla", "FlashInferMLABackend"),
}


def backends() -> dict:
    out = {}
    for name, (module, cls) in BACKENDS.items():
        try:
            backend = getattr(importlib.import_module(module), cls)
            layouts = backend.supported_kv_cache_layouts()
            out[name] = {"imported": True, "layouts": None if layouts is None else [x.name for x in layouts]}
        except Exception as exc:  # noqa: BLE001 - the reason is the answer
            out[name] = {"imported": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return out


def combos() -> list[dict]:
    import torch
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        compute_layer_kv_cache_shape_bytes,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
              "float8_e4m3fn": torch.float8_e4m3fn}
    rows = []
    grid = itertools.product((1, 7), (16, 32, 64), (1, 2, 8), (64, 128, 256), dtypes, (1, 3), (False, True))
    for num_blocks, block_size, heads, head_size, dtype, layers, padded in grid:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtypes[dtype])
        pad = None
        if padded:  # as the hybrid allocator does: attention page raised to a larger (mamba) page
            pad = spec.page_size_bytes + 4096
            spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                                     dtype=dtypes[dtype], page_size_padded=pad)
        for layout in KVCacheLayout:
            try:
                strides = compute_layout_strides(spec, num_blocks, layers, layout)
            except AssertionError as exc:
                strides = f"refused: {exc}"
            rows.append({"num_blocks": num_blocks, "block_size": block_size, "heads": heads, "head_size": head_size,
                         "dtype": dtype, "layers": layers, "page_size_padded": pad, "layout": layout.name,
                         "shape": list(compute_layer_kv_cache_shape_bytes(spec, num_blocks)), "strides": strides})
    for num_blocks, block_size, latent, dtype, layers in itertools.product((1, 5), (16, 64), (320, 576), dtypes, (1, 3)):
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=latent, dtype=dtypes[dtype])
        for layout in KVCacheLayout:
            rows.append({"mla": True, "num_blocks": num_blocks, "block_size": block_size, "heads": 1,
                         "head_size": latent, "dtype": dtype, "layers": layers, "page_size_padded": None,
                         "layout": layout.name, "shape": list(compute_layer_kv_cache_shape_bytes(spec, num_blocks)),
                         "strides": compute_layout_strides(spec, num_blocks, layers, layout)})
    return rows, [x.name for x in _DEFAULT_LAYOUT_PREFERENCE]


def main() -> None:
    import vllm
    rows, default = combos()
    json.dump({"vllm_version": vllm.__version__, "backends": backends(), "default_preference": default,
               "rows": rows}, sys.stdout)


if __name__ == "__main__":
    main()
