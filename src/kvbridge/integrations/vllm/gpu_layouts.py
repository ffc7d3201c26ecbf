"""vLLM 0.32's GPU attention KV caches as kvbridge layouts (no vLLM import; checked against vLLM).

vLLM 0.32 no longer has per-backend `get_kv_cache_shape` / `get_kv_cache_stride_order`: every
backend's cache is one logical `[L, B, H, N, C]` byte tensor (`vllm.v1.kv_cache_interface`:
`compute_layer_kv_cache_shape_bytes`, `compute_layout_strides`) whose physical order is a
`KVCacheLayout` (`vllm.v1.kv_cache_layout`: LBNHC, LBHNC, LHBNC, BLNHC, BLHNC, BHLNC). A backend
declares the layouts its kernels take (`supported_kv_cache_layouts()`, None = any, then vLLM's
default preference, NHD first). C is one (head, token) cell: K (head_size) then V (head_size_v),
which the dense backends split with `kv_cache.split(head_size, dim=-1)`. A padded page
(`page_size_padded`, the hybrid allocator raising attention pages to the mamba page size) widens
the stride of the innermost of the L/B axes.

kvbridge's `kv_placement` (kv_first, blocks_first) cannot place V *inside* the cell next to K, nor
pad pages, so `VllmGpuLayout` keeps the `EngineLayout` fields and overrides `addressing` with the
strides of the chosen `KVCacheLayout` (same approach as `layout.VllmCpuLayout`). Proposed for
core: `kv_placement="per_cell"` plus a `page_bytes` field. MLA (FlashMLA, Triton MLA) is the same
cell with one latent component. A hybrid model (attention and Mamba/GDN/short-conv state under
vLLM's hybrid allocator) has one tensor per layer of unified pages: `_hybrid_addressing`.
"""

from __future__ import annotations

import numpy as np

from kvbridge.core.layout import Addressing, EngineLayout
from kvbridge.core.shard import head_range
from kvbridge.core.spec import ModelSpec
from kvbridge.errors import InvalidRequest
from kvbridge.integrations.vllm.layout import put_state_page, unified_page

# Physical order of the logical axes (0 L, 1 B, 2 H, 3 N, 4 C), outermost first.
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
DEFAULT_PREFERENCE = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")
# Backend -> layouts its kernels take, most preferred first (vLLM's `supported_kv_cache_layouts`
# on a non-Blackwell GPU; FlashInfer on capability 10.x takes LBHNC/BLHNC only).
BACKEND_LAYOUTS: dict[str, tuple[str, ...]] = {
    "FLASH_ATTN": DEFAULT_PREFERENCE,
    "TRITON_ATTN": DEFAULT_PREFERENCE,
    "FLASHINFER": DEFAULT_PREFERENCE,
    "FLEX_ATTENTION": ("LBNHC",),
    # MLA: one replicated latent head per token (kv_lora_rank + rope dims), no V.
    "FLASHMLA": DEFAULT_PREFERENCE,
    "TRITON_MLA": DEFAULT_PREFERENCE,
}
# Packed MLA caches (`fp8_ds_mla`: quantized latent + scales + rope in one 656 B cell) are not
# element-addressable K/V rows; refused rather than described wrongly.
PACKED_CACHE_DTYPES = ("fp8_ds_mla",)


class VllmGpuLayout(EngineLayout, frozen=True):
    """An `EngineLayout` whose addressing is vLLM's `[L, B, H, N, C]` in `cache_layout` order."""

    cache_layout: str = "LBNHC"
    page_size_padded: int | None = None

    def addressing(self, spec: ModelSpec, rank: int) -> Addressing:
        return _gpu_addressing(spec, self, rank)


def gpu_layout(backend: str, block_size: int, num_blocks: int, kv_cache_dtype: str | None = None, *,
               cache_layout: str | None = None, tp_size: int = 1,
               page_size_padded: int | None = None) -> VllmGpuLayout:
    """The layout vLLM's `backend` gives the cache (its preferred `KVCacheLayout` unless named)."""
    if kv_cache_dtype in PACKED_CACHE_DTYPES:
        raise InvalidRequest(f"vLLM KV cache dtype {kv_cache_dtype} packs scales into the cell; not described")
    if kv_cache_dtype == "auto":  # vLLM's default: the model's dtype
        kv_cache_dtype = None
    layouts = BACKEND_LAYOUTS.get(backend.upper())
    if layouts is None:
        raise InvalidRequest(f"unknown vLLM GPU attention backend {backend!r}; known: {', '.join(BACKEND_LAYOUTS)}")
    chosen = cache_layout or layouts[0]
    if chosen not in layouts:
        raise InvalidRequest(f"vLLM backend {backend} does not take KV cache layout {chosen}; it takes {', '.join(layouts)}")
    order = KV_CACHE_LAYOUTS[chosen]
    return VllmGpuLayout(
        tp_size=tp_size, block_size=block_size, num_blocks=num_blocks, kv_dtype=kv_cache_dtype,
        kv_order="NHD" if order.index(3) < order.index(2) else "HND",
        kv_placement="blocks_first", layer_placement="per_layer" if order[0] == 0 else "cross_layer",
        cache_layout=chosen, page_size_padded=page_size_padded)


def layout_strides(order: tuple[int, ...], shape: tuple[int, ...], page_size_padded: int | None) -> tuple[int, ...]:
    """Byte strides of the logical `[L, B, H, N, C]` axes, innermost axis densest; a padded page
    rounds the stride of the innermost of L and B up to `page_size_padded`."""
    grid_end = max(order.index(0), order.index(1))  # physical position of the inner L/B axis
    if page_size_padded is not None and int(np.prod([shape[d] for d in order[:grid_end + 1]])) != shape[0] * shape[1]:
        raise InvalidRequest(f"a padded page needs L and B outside the page (or the axes between them of size 1); "
                             f"KV cache layout {_name(order)} has shape {shape}")
    strides = [0] * 5
    step = 1
    for pos in range(4, -1, -1):
        dim = order[pos]
        if page_size_padded is not None and pos == grid_end:
            if step > page_size_padded:
                raise InvalidRequest(f"page of {step} B exceeds page_size_padded {page_size_padded}")
            step = page_size_padded
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def _name(order: tuple[int, ...]) -> str:
    return next(name for name, value in KV_CACHE_LAYOUTS.items() if value == order)


def _gpu_addressing(spec: ModelSpec, layout: VllmGpuLayout, rank: int) -> Addressing:
    if layout.pp_size != 1 or layout.cp_size != 1 or layout.kernel_block_size not in (None, layout.block_size):
        raise InvalidRequest("VllmGpuLayout describes TP only, with kernel blocks equal to blocks")
    if not 0 <= rank < layout.world_size:
        raise InvalidRequest(f"rank {rank} outside {layout.describe_ranks()}")
    spec = layout.engine_spec(spec)
    layers = spec.layers
    if any(layer.is_recurrent for layer in layers):
        return _hybrid_addressing(spec, layout, rank)
    itemsize = spec.itemsize
    geo = {(layer.kind == "mla", tuple((c.heads, c.dim) for c in layer.components), layer.replicated)
           for layer in layers}
    if len(geo) != 1:
        raise InvalidRequest("one vLLM KV cache tensor holds layers of one geometry; split the model per group")
    _, comps, replicated = geo.pop()
    h0, h1 = head_range(comps[0][0], layout.tp_size, rank, replicated)
    # The cell C holds the components back to back: K then V, or the MLA latent alone.
    offsets = np.cumsum([0] + [dim * itemsize for _, dim in comps])
    L = len(layers)
    shape = (L, layout.num_blocks, h1 - h0, layout.block_size, int(offsets[-1]))
    sL, sB, sH, sN, _ = layout_strides(KV_CACHE_LAYOUTS[layout.cache_layout], shape, layout.page_size_padded)
    arr = {k: np.zeros((L, len(comps)), dtype=np.int64) for k in
           ("region", "base", "block_stride", "token_stride", "head_stride", "row_bytes", "heads", "first_head")}
    for li in range(L):
        for ci, (_, dim) in enumerate(comps):
            for key, value in (("base", li * sL + offsets[ci]), ("block_stride", sB), ("token_stride", sN),
                               ("head_stride", sH), ("row_bytes", dim * itemsize), ("heads", h1 - h0),
                               ("first_head", h0)):
                arr[key][li, ci] = value
    for a in arr.values():
        a.setflags(write=False)
    total = sum(s * (n - 1) for s, n in zip((sL, sB, sH, sN), shape)) + shape[4]  # last byte + 1
    if layout.page_size_padded is not None:
        total = max(total, shape[0] * shape[1] * layout.page_size_padded)
    return Addressing(num_components=np.full(L, len(comps), dtype=np.int64), region_nbytes=(total,), **arr)


def _hybrid_addressing(spec: ModelSpec, layout: VllmGpuLayout, rank: int) -> Addressing:
    """A hybrid model under vLLM's hybrid allocator: every layer its own tensor of `num_blocks`
    unified pages (`page_size_padded`, else the largest page of any layer on this rank, which is
    what vLLM pads the others to). An attention layer's page is its `[B, H, N, C]` block in the
    `cache_layout` order without the L axis (a per-layer layout: L outermost); a recurrent layer's
    page is vLLM's `MambaSpec` state, its components back to back, conv rows first, unpadded
    (`layout.vllm_conv_rows` gives vLLM's row order). Each layer's region runs from its first page
    to the end of its last block's bytes."""
    order = KV_CACHE_LAYOUTS[layout.cache_layout]
    if order[0] != 0:
        raise InvalidRequest(f"hybrid pages are per layer: KV cache layout {layout.cache_layout} puts blocks outside "
                             f"layers; use one with L outermost (LBNHC, LBHNC, LHBNC)")
    L = spec.num_layers
    attention = {tuple((c.heads, c.dim) for c in layer.components) for layer in spec.layers if layer.is_attention}
    if len(attention) > 1:
        raise InvalidRequest("one vLLM KV cache tensor holds layers of one geometry; split the model per group")

    needed = unified_page(spec, layout, rank)
    page = layout.page_size_padded or needed
    if page < needed:
        raise InvalidRequest(f"page_size_padded {page} B is smaller than a layer's page of {needed} B")
    arr = {k: np.zeros((L, spec.max_components), dtype=np.int64) for k in
           ("region", "base", "block_stride", "token_stride", "head_stride", "row_bytes", "heads", "first_head")}
    ncomp = np.zeros(L, dtype=np.int64)
    regions: list[int] = []
    for li, layer in enumerate(spec.layers):
        ncomp[li] = len(layer.components)
        if layer.is_stateless:
            continue
        if layer.is_recurrent:
            regions.append(put_state_page(arr, spec, li, layout, rank, page, len(regions)))
            continue
        rows = [c.dim * spec.component_itemsize(c) for c in layer.components]
        h0, h1 = head_range(layer.components[0].heads, layout.tp_size, rank, layer.replicated)
        offsets = np.cumsum([0] + rows)
        shape = (1, layout.num_blocks, h1 - h0, layout.group_block_size(spec.layer_group[li]), int(offsets[-1]))
        _, sB, sH, sN, _ = layout_strides(order, shape, page)
        for ci, row in enumerate(rows):
            for key, value in (("region", len(regions)), ("base", offsets[ci]), ("block_stride", sB),
                               ("token_stride", sN), ("head_stride", sH), ("row_bytes", row), ("heads", h1 - h0),
                               ("first_head", h0)):
                arr[key][li, ci] = value
        regions.append(sum(st * (n - 1) for st, n in zip((sB, sH, sN), shape[1:4])) + shape[4])
    for a in arr.values():
        a.setflags(write=False)
    return Addressing(num_components=ncomp, region_nbytes=tuple(regions), **arr)
