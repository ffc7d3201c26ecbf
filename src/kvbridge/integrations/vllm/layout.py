"""vLLM CPU's paged KV cache as a kvbridge layout (no vLLM import here).

vLLM 0.32 allocates one flat buffer per engine rank and views it per layer as `[B, H, N, C]`
(`KVCacheLayout.LBHNC`, the only layout the CPU attention backend takes): B kernel blocks, H
local KV heads, N tokens per kernel block, C = K|V content (2 x head_size elements). The CPU
backend (`cpu_attn.py`) views every `[N, C]` (block, head) chunk as `[2N, head_size]` and hands
its halves to its kernels as key and value cache; its `vec` kernels (x86 fp32, N a multiple of
32) store K *transposed* in the first half. Inside a block, per head (measured: the bytes of a
prefilled vLLM cache equal transformers' keys and values exactly this way):

    K[dim 0][tokens 0..N-1] ... K[dim D-1][tokens 0..N-1]  V[token 0][D dims] ... V[token N-1]

kvbridge addresses rows of contiguous bytes per (token, head), and no `EngineLayout` places K/V
inside the head, so two pieces describe it exactly:

* `VllmCpuLayerSpec`: K as D one-element components `k0..k{D-1}` (each sharded by head like K,
  so every TP rule holds) and V as one component;
* `VllmCpuLayout`: an `EngineLayout` whose `addressing` puts each component's rows per head:
  component c of head h at `h * head_chunk + sum(N * row of earlier components)`.

MLA layers (vLLM CPU's `CPU_MLA` and `AMX_MLA` backends) keep `[kernel blocks, tokens, latent]`:
a token's latent (kv_lora_rank values, then the rope part) is one row, every rank holding all of
it, so a plain `LayerSpec` of kind "mla" addresses it as it is.

Planner, executors and transports use nothing else. Where both sides have the same kernel
block size, consecutive runs coalesce into whole blocks; otherwise K moves in runs of one
dimension's tokens (N x itemsize bytes).

Until `kvbridge.core.layout` grows the placement (proposed: `kv_placement="per_head"`, with the
addressing below), a `VllmCpuLayout` crosses the side channel as a plain `EngineLayout` (a
msgspec subclass encodes the same fields), and the vLLM connector turns every peer layout it
registers back into a `VllmCpuLayout` (`as_vllm_cpu`): peers of a kvbridge connector inside vLLM
CPU are vLLM CPU engines.
"""

from __future__ import annotations

from functools import lru_cache

import msgspec
import numpy as np

from kvbridge.errors import IncompatibleEngines, InvalidRequest
from kvbridge.core.layout import Addressing, EngineLayout
from kvbridge.core.shard import head_range
from kvbridge.core.spec import Component, LayerSpec, ModelSpec
from kvbridge.core.topology import EngineTransferInfo, TransferTopology


class VllmCpuLayerSpec(LayerSpec, frozen=True):
    """A K/V attention layer as vLLM CPU attention stores it: K transposed (see module doc)."""

    @property
    def components(self) -> tuple[Component, ...]:
        return _cpu_components(self.num_kv_heads, self.key_dim, self.value_dim)


@lru_cache(maxsize=64)
def _cpu_components(heads: int, key_dim: int, value_dim: int) -> tuple[Component, ...]:
    return tuple(Component(f"k{d}", heads, 1) for d in range(key_dim)) + (Component("v", heads, value_dim),)


def vllm_cpu_spec(spec: ModelSpec) -> ModelSpec:
    """`spec` with every full/sliding attention layer as a `VllmCpuLayerSpec` (same geometry,
    same fingerprint: the subclass only changes how components are addressed). MLA, recurrent and
    stateless layers stay as they are (see `vllm_conv_rows` for the conv state's row order)."""
    layers = []
    for i, layer in enumerate(spec.layers):
        if layer.kind not in ("full", "sliding", "mla", "recurrent", "stateless"):
            raise IncompatibleEngines(f"layer {i} is {layer.kind!r}: the vLLM CPU connector moves K/V attention, "
                                      f"MLA latents and recurrent (Mamba-style) layers only")
        if layer.kind in ("full", "sliding") and not isinstance(layer, VllmCpuLayerSpec):
            layer = VllmCpuLayerSpec(**msgspec.structs.asdict(layer))
        layers.append(layer)
    return ModelSpec(tuple(layers), spec.dtype, spec.name)


def vllm_conv_rows(spec: ModelSpec) -> ModelSpec:
    """Recurrent layers with their conv state as vLLM keeps it by default ("SD": `[kernel - 1,
    conv_dim]`, `mamba_utils.get_conv_state_layout`): row r holds every local channel's r-th
    value, segments x|B|C (or q|k|v) one after the other. kvbridge's components keep a channel's
    values together (the "DS" order), so each conv component `c` becomes one component per row,
    `c@r`, of the same units with `dim / rows` elements: back to back they are exactly vLLM's
    rows, and every TP rule of `c` still holds."""
    layers = []
    for layer in spec.layers:
        if layer.is_recurrent and layer.conv_rows > 0 and not any("@" in c.name for c in layer.state):
            rows = layer.conv_rows
            conv = [c for c in layer.state if c.name.startswith("conv")]
            rest = [c for c in layer.state if not c.name.startswith("conv")]
            if any(c.dim % rows for c in conv):
                raise IncompatibleEngines(f"a conv component of {layer.recurrent_type or 'a recurrent layer'} does not "
                                          f"hold {rows} values per channel")
            sizes = layer.conv_states or (len(conv),)  # rows go round within each conv state (its own tensor)
            starts = [sum(sizes[:g]) for g in range(len(sizes))]
            split = [msgspec.structs.replace(c, name=f"{c.name}@{r}", dim=c.dim // rows)
                     for g, n in zip(starts, sizes) for r in range(rows) for c in conv[g:g + n]]
            layer = msgspec.structs.replace(layer, state=tuple(split + rest),
                                            conv_states=tuple(n * rows for n in layer.conv_states))
        layers.append(layer)
    return ModelSpec(tuple(layers), spec.dtype, spec.name)


class VllmCpuLayout(EngineLayout, frozen=True):
    """vLLM CPU attention's cache: per layer `[kernel block, head, K|V, token, dim]`.

    Always HND-like (tokens contiguous per head and K/V), one region per layer. The
    `kv_order`/`kv_placement` fields keep their nearest `EngineLayout` values (HND,
    blocks_first) so that a peer without this class still reads a valid layout; `addressing`
    is what counts.

    `page_bytes` is the bytes per block id of every layer: -1 (default) vLLM's hybrid-allocator
    page derived from the whole model (`unified_page`), 0 none (each layer's blocks dense, a state
    one state's bytes), else that page. A given page keeps a layer's addresses independent of the
    other layers, so one group's layers can be planned as a model of their own (offload jobs).
    """

    page_bytes: int = -1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_bytes < -1:
            raise IncompatibleEngines(f"page_bytes must be -1 (derived), 0 (none) or a page size, got "
                                      f"{self.page_bytes}")
        if (self.kv_order, self.kv_placement, self.layer_placement) != ("HND", "blocks_first", "per_layer"):
            raise IncompatibleEngines(
                f"a vLLM CPU cache is HND, blocks_first, per_layer; got {self.kv_order}, {self.kv_placement}, "
                f"{self.layer_placement}")

    def addressing(self, spec: ModelSpec, rank: int) -> Addressing:
        return _cpu_addressing(spec, self, rank)

    def describe(self) -> str:
        kb = f", kernel {self.kernel_size}" if self.kernel_size != self.block_size else ""
        return f"TP={self.tp_size} block {self.block_size}{kb} vLLM-CPU [B,H,K|V,N,D]"

    def plain(self) -> EngineLayout:
        """The `EngineLayout` of the same shape (what a peer's Hello carries; `as_vllm_cpu` reads it
        back with the page derived, as vLLM's hybrid allocator pads)."""
        return EngineLayout(**{f: getattr(self, f) for f in EngineLayout.__struct_fields__})


def vllm_cpu_layout(tp_size: int, block_size: int, num_blocks: int, kernel_block_size: int | None = None
                    ) -> VllmCpuLayout:
    return VllmCpuLayout(tp_size=tp_size, block_size=block_size, num_blocks=num_blocks,
                         kernel_block_size=kernel_block_size if kernel_block_size != block_size else None,
                         kv_order="HND", kv_placement="blocks_first", layer_placement="per_layer")


def as_vllm_cpu(layout: EngineLayout) -> VllmCpuLayout:
    """The same engine shape as a `VllmCpuLayout` (what a peer's Hello decodes to)."""
    if isinstance(layout, VllmCpuLayout):
        return layout
    if (layout.kv_order, layout.kv_placement, layout.layer_placement) != ("HND", "blocks_first", "per_layer"):
        raise IncompatibleEngines(
            f"peer layout {layout.describe()} is not a vLLM CPU cache (HND, blocks_first, per_layer); the vLLM "
            f"connector peers only with vLLM CPU engines")
    return VllmCpuLayout(**msgspec.structs.asdict(layout))


class VllmTopology(TransferTopology):
    """A topology whose peers are vLLM CPU caches: registered layouts become `VllmCpuLayout`."""

    def register_remote_engine(self, engine_id: str, layout: EngineLayout,
                               spec: ModelSpec | None = None) -> EngineTransferInfo:
        return super().register_remote_engine(engine_id, as_vllm_cpu(layout), spec)

    @classmethod
    def of(cls, side) -> VllmTopology:
        """The topology for a `Producer` or `Consumer` (which builds a plain one)."""
        return cls(side.engine_id, side.cache.spec, side.cache.layout, side.rank)


@lru_cache(maxsize=256)
def _cpu_addressing(spec: ModelSpec, layout: VllmCpuLayout, rank: int) -> Addressing:
    """Attention layers as in the module doc. Recurrent layers (vLLM's `MambaSpec`): one state
    page per block id, its components back to back with no padding (vLLM's `shapes` in order).
    With both kinds (the hybrid allocator) every layer's block stride is one unified page: the
    larger of an attention block and a state (vLLM pads the smaller to it: `page_size_padded`),
    and a layer's region spans its pages up to the last state's end (groups overlay the same
    allocation; a block id belongs to one group at a time)."""
    if not 0 <= rank < layout.tp_size:
        raise InvalidRequest(f"rank {rank} outside TP size {layout.tp_size}")
    layout.check_model(spec)
    L, C = spec.num_layers, spec.max_components
    arrays = {k: np.zeros((L, C), dtype=np.int64) for k in
              ("region", "base", "block_stride", "token_stride", "head_stride", "row_bytes", "heads", "first_head")}
    ncomp = np.zeros(L, dtype=np.int64)
    region_nbytes: list[int] = []
    derived = unified_page(spec, layout, rank)
    page = derived if layout.page_bytes < 0 else layout.page_bytes
    if page and page < derived:
        raise IncompatibleEngines(f"a {page}-byte page cannot hold this model's largest block or state "
                                  f"({derived} B on rank {rank})")
    for li, layer in enumerate(spec.layers):
        comps = layer.components
        ncomp[li] = len(comps)
        if layer.is_stateless:
            continue
        if not isinstance(layer, VllmCpuLayerSpec) and not layer.is_recurrent and layer.kind != "mla":
            raise IncompatibleEngines(
                f"layer {li} ({layer.kind}) is not a VllmCpuLayerSpec: describe the model with vllm_cpu_spec()")
        g = spec.layer_group[li]
        rows = [c.dim * spec.component_itemsize(c) for c in comps]
        if layer.is_recurrent:
            own = page or unified_page(ModelSpec((layer,), spec.dtype), layout, rank)  # no page: one state each
            region_nbytes.append(put_state_page(arrays, spec, li, layout, rank, own, len(region_nbytes)))
            continue
        kbs, nkb = layout.group_kernel_size(g), layout.group_num_kernel_blocks(g)
        if layer.kind == "mla":  # [kernel block, token, latent]: one row per token, every rank all of it
            if len(rows) != 1 or layer.tokens_per_row != 1:
                raise IncompatibleEngines(f"layer {li}: vLLM CPU keeps one latent row per token; this MLA layer has "
                                          f"{len(rows)} component(s) and {layer.tokens_per_row} token(s) per row")
            bstride = page or kbs * rows[0]
            _put(arrays, li, 0, region=len(region_nbytes), base=0, block_stride=bstride, token_stride=rows[0],
                 head_stride=kbs * rows[0], row_bytes=rows[0], heads=1, first_head=0)
            region_nbytes.append((nkb - 1) * bstride + kbs * rows[0])
            continue
        h0, h1 = head_range(comps[0].heads, layout.tp_size, rank)
        head_chunk = kbs * sum(rows)  # one head of one kernel block: K^T, then V rows
        bstride = page or (h1 - h0) * head_chunk
        base = 0
        for ci, row in enumerate(rows):
            _put(arrays, li, ci, region=len(region_nbytes), base=base, block_stride=bstride, token_stride=row,
                 head_stride=head_chunk, row_bytes=row, heads=h1 - h0, first_head=h0)
            base += kbs * row
        region_nbytes.append((nkb - 1) * bstride + (h1 - h0) * head_chunk)
    for a in arrays.values():
        a.setflags(write=False)
    return Addressing(num_components=ncomp, region_nbytes=tuple(region_nbytes), **arrays)


def _put(arrays: dict[str, np.ndarray], li: int, ci: int, **values: int) -> None:
    for key, value in values.items():
        arrays[key][li, ci] = value


def put_state_page(arrays: dict[str, np.ndarray], spec: ModelSpec, li: int, layout: EngineLayout, rank: int,
                   page: int, region: int) -> int:
    """Address recurrent layer `li` as vLLM's `MambaSpec` page (`rank`'s share of each component,
    back to back, unpadded; one page of `page` bytes per block id) in `region`; returns the
    region's bytes, from the first page to the last state's end. Shared with `gpu_layouts`: the
    state page does not depend on the device."""
    layer, base = spec.layers[li], 0
    for ci, c in enumerate(layer.components):
        row = c.dim * spec.component_itemsize(c)
        h0, h1 = head_range(c.heads, layout.tp_size, rank, layer.replicated)
        _put(arrays, li, ci, region=region, base=base, block_stride=page, token_stride=0, head_stride=row,
             row_bytes=row, heads=h1 - h0, first_head=h0)
        base += (h1 - h0) * row
    return (layout.num_blocks - 1) * page + base


def unified_page(spec: ModelSpec, layout: EngineLayout, rank: int) -> int:
    """The hybrid allocator's page (bytes per block id, every layer) for `rank`: the largest of
    any layer's block or state, which vLLM pads the others to; 0 without recurrent layers
    (attention blocks are then dense). Shared with `gpu_layouts`."""
    if not spec.has_recurrent:
        return 0
    page = 0
    for li, layer in enumerate(spec.layers):
        if layer.is_recurrent:
            page = max(page, sum((lambda r: r[1] - r[0])(head_range(c.heads, layout.tp_size, rank, layer.replicated))
                                 * c.dim * spec.component_itemsize(c) for c in layer.components))
        elif layer.is_attention:
            h0, h1 = head_range(layer.components[0].heads, layout.tp_size, rank, layer.replicated)
            page = max(page, (h1 - h0) * layout.group_block_size(spec.layer_group[li])
                       * sum(c.dim * spec.component_itemsize(c) for c in layer.components))
    return page


__all__ = ["VllmCpuLayerSpec", "VllmCpuLayout", "VllmTopology", "as_vllm_cpu", "put_state_page", "unified_page",
           "vllm_conv_rows", "vllm_cpu_layout", "vllm_cpu_spec"]
