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
    same fingerprint: the subclass only changes how components are addressed)."""
    layers = []
    for i, layer in enumerate(spec.layers):
        if layer.kind not in ("full", "sliding"):
            raise IncompatibleEngines(f"layer {i} is {layer.kind!r}: the vLLM CPU connector moves K/V attention "
                                      f"layers only")
        layers.append(layer if isinstance(layer, VllmCpuLayerSpec) else VllmCpuLayerSpec(**msgspec.structs.asdict(layer)))
    return ModelSpec(tuple(layers), spec.dtype, spec.name)


class VllmCpuLayout(EngineLayout, frozen=True):
    """vLLM CPU attention's cache: per layer `[kernel block, head, K|V, token, dim]`.

    Always HND-like (tokens contiguous per head and K/V), one region per layer. The
    `kv_order`/`kv_placement` fields keep their nearest `EngineLayout` values (HND,
    blocks_first) so that a peer without this class still reads a valid layout; `addressing`
    is what counts.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.kv_order, self.kv_placement, self.layer_placement) != ("HND", "blocks_first", "per_layer"):
            raise IncompatibleEngines(
                f"a vLLM CPU cache is HND, blocks_first, per_layer; got {self.kv_order}, {self.kv_placement}, "
                f"{self.layer_placement}")

    def addressing(self, spec: ModelSpec, rank: int) -> Addressing:
        return _cpu_addressing(spec, self, rank)

    def describe(self) -> str:
        kb = f", kernel {self.kernel_size}" if self.kernel_size != self.block_size else ""
        return f"TP={self.tp_size} block {self.block_size}{kb} vLLM-CPU [B,H,K|V,N,D]"


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
    if not 0 <= rank < layout.tp_size:
        raise InvalidRequest(f"rank {rank} outside TP size {layout.tp_size}")
    layout.check_model(spec)
    L, C, kbs, nkb = spec.num_layers, spec.max_components, layout.kernel_size, layout.num_kernel_blocks
    arrays = {k: np.zeros((L, C), dtype=np.int64) for k in
              ("region", "base", "block_stride", "token_stride", "head_stride", "row_bytes", "heads", "first_head")}
    ncomp = np.zeros(L, dtype=np.int64)
    region_nbytes: list[int] = []
    for li, layer in enumerate(spec.layers):
        if not isinstance(layer, VllmCpuLayerSpec):
            raise IncompatibleEngines(
                f"layer {li} ({layer.kind}) is not a VllmCpuLayerSpec: describe the model with vllm_cpu_spec()")
        comps = layer.components
        ncomp[li] = len(comps)
        h0, h1 = head_range(comps[0].heads, layout.tp_size, rank)
        rows = [c.dim * spec.component_itemsize(c) for c in comps]
        head_chunk = kbs * sum(rows)  # one head of one kernel block: K^T, then V rows
        base = 0
        for ci, row in enumerate(rows):
            for key, value in (("region", li), ("base", base), ("block_stride", (h1 - h0) * head_chunk),
                               ("token_stride", row), ("head_stride", head_chunk), ("row_bytes", row),
                               ("heads", h1 - h0), ("first_head", h0)):
                arrays[key][li, ci] = value
            base += kbs * row
        region_nbytes.append(nkb * (h1 - h0) * head_chunk)
    for a in arrays.values():
        a.setflags(write=False)
    return Addressing(num_components=ncomp, region_nbytes=tuple(region_nbytes), **arrays)


__all__ = ["VllmCpuLayerSpec", "VllmCpuLayout", "VllmTopology", "as_vllm_cpu", "vllm_cpu_layout", "vllm_cpu_spec"]
