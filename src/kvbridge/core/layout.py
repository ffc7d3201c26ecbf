"""Physical layouts: where each (layer, component, block, token, head) row lives in memory.

An `EngineLayout` is what every rank of one engine shares: TP size, block size, kernel blocks
per logical block, order inside a block (NHD token-major, HND head-major), K/V placement and
whether regions are per layer or one cross-layer region. For one rank it resolves to an
`Addressing` table: for every (layer, component) a region and the byte strides of
block, token and head. Everything downstream (planner, executors, the transformers bridge,
verification) addresses memory through that table and nothing else, so a layout is described
exactly once.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import msgspec
import numpy as np

from kvbridge.errors import InvalidRequest, IncompatibleEngines
from kvbridge.core.shard import check_shardable, head_range
from kvbridge.core.spec import ModelSpec

KVOrder = Literal["NHD", "HND"]
KVPlacement = Literal["kv_first", "blocks_first"]
LayerPlacement = Literal["per_layer", "cross_layer"]

class EngineLayout(msgspec.Struct, frozen=True):
    """How one engine (all its TP ranks) lays out its paged KV cache."""

    tp_size: int = 1
    block_size: int = 16
    num_blocks: int = 1024
    kernel_block_size: int | None = None
    kv_order: KVOrder = "HND"
    kv_placement: KVPlacement = "kv_first"
    layer_placement: LayerPlacement = "per_layer"

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.block_size < 1 or self.num_blocks < 1:
            raise IncompatibleEngines(
                f"TP size, block size and block count must be >= 1, got {self.tp_size}, "
                f"{self.block_size}, {self.num_blocks}")
        if self.kernel_block_size is not None and self.kernel_block_size < 1:
            raise IncompatibleEngines(
                f"kernel block size must be >= 1 (block size {self.block_size}), got {self.kernel_block_size}")
        kbs = self.kernel_block_size or self.block_size
        if self.block_size % kbs:
            raise IncompatibleEngines(
                f"kernel block size {kbs} must divide the logical block size {self.block_size}")
        if self.kv_order not in ("NHD", "HND"):
            raise IncompatibleEngines(f"kv_order must be NHD or HND, got {self.kv_order!r}")
        if self.kv_placement not in ("kv_first", "blocks_first"):
            raise IncompatibleEngines(f"kv_placement must be kv_first or blocks_first, got {self.kv_placement!r}")
        if self.layer_placement not in ("per_layer", "cross_layer"):
            raise IncompatibleEngines(f"layer_placement must be per_layer or cross_layer, got {self.layer_placement!r}")
        if self.layer_placement == "cross_layer" and self.kv_placement != "blocks_first":
            raise IncompatibleEngines("a cross_layer region keeps K and V inside each block: use blocks_first")

    @property
    def kernel_size(self) -> int:
        """Tokens per kernel (physical) block."""
        return self.kernel_block_size or self.block_size

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_size

    @property
    def num_kernel_blocks(self) -> int:
        return self.num_blocks * self.kernel_blocks_per_block

    def check_model(self, spec: ModelSpec, what: str = "engine") -> None:
        for layer in spec.layers:
            if not layer.replicated:
                for comp in layer.components:
                    check_shardable(comp.heads, self.tp_size,
                                    what if comp.name in ("k", "v") else f"{what} ({comp.name} units)")

    def kernel_slots(self, block_ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kernel block id and offset inside it of each token position, given logical block ids."""
        logical = np.asarray(block_ids, dtype=np.int64)[positions // self.block_size]
        within = positions % self.block_size
        return logical * self.kernel_blocks_per_block + within // self.kernel_size, within % self.kernel_size

    def addressing(self, spec: ModelSpec, rank: int) -> Addressing:
        return _addressing(spec, self, rank)

    def describe(self) -> str:
        kb = f", kernel {self.kernel_size}" if self.kernel_size != self.block_size else ""
        return (f"TP={self.tp_size} block {self.block_size}{kb} {self.kv_order} {self.kv_placement}"
                f"{' cross-layer' if self.layer_placement == 'cross_layer' else ''}")


class Addressing(msgspec.Struct, frozen=True):
    """Byte addressing of one rank: arrays indexed [layer, component] (component 1 unused for MLA).

    Row (l, c, kernel block b, token n, local head h) starts at byte
    `base + b*block_stride + n*token_stride + h*head_stride` of region `region`, and is
    `row_bytes` contiguous bytes.
    """

    region: np.ndarray
    base: np.ndarray
    block_stride: np.ndarray
    token_stride: np.ndarray
    head_stride: np.ndarray
    row_bytes: np.ndarray
    heads: np.ndarray
    first_head: np.ndarray
    num_components: np.ndarray
    region_nbytes: tuple[int, ...]


@lru_cache(maxsize=256)
def _addressing(spec: ModelSpec, layout: EngineLayout, rank: int) -> Addressing:
    if not 0 <= rank < layout.tp_size:
        raise InvalidRequest(f"rank {rank} outside TP size {layout.tp_size}")
    layout.check_model(spec)
    if spec.has_recurrent and layout.layer_placement == "cross_layer":
        raise IncompatibleEngines("recurrent state needs per-layer regions; cross_layer holds attention layers only")
    L, C, kbs, nkb = spec.num_layers, spec.max_components, layout.kernel_size, layout.num_kernel_blocks
    arrays = {k: np.zeros((L, C), dtype=np.int64) for k in
              ("region", "base", "block_stride", "token_stride", "head_stride", "row_bytes", "heads", "first_head")}
    ncomp = np.zeros(L, dtype=np.int64)
    region_nbytes: list[int] = []
    cross_offset = 0  # byte offset of the layer's slot inside a cross-layer block
    slot_bytes: list[int] = []

    def put(li: int, ci: int, **values: int) -> None:
        for key, value in values.items():
            arrays[key][li, ci] = value

    for li, layer in enumerate(spec.layers):
        comps = layer.components
        ncomp[li] = len(comps)
        ranges = [head_range(c.heads, layout.tp_size, rank, layer.replicated) for c in comps]
        rows = [c.dim * spec.component_itemsize(c) for c in comps]
        if layer.is_recurrent:
            # One state slot per logical block id; components back to back, each aligned to 16 B.
            base = 0
            for ci, ((h0, h1), row) in enumerate(zip(ranges, rows)):
                put(li, ci, region=li, base=base, token_stride=0, head_stride=row, row_bytes=row,
                    heads=h1 - h0, first_head=h0)
                base += _align((h1 - h0) * row)
            arrays["block_stride"][li, : len(comps)] = base
            region_nbytes.append(layout.num_blocks * base)
            continue
        comp_block = [(h1 - h0) * kbs * row for (h0, h1), row in zip(ranges, rows)]
        layer_block = sum(comp_block)
        for ci, ((h0, h1), row) in enumerate(zip(ranges, rows)):
            nheads = h1 - h0
            if layout.kv_placement == "kv_first":
                base, bstride = nkb * sum(comp_block[:ci]), comp_block[ci]
            else:
                base, bstride = sum(comp_block[:ci]), layer_block
            if layout.kv_order == "NHD":
                tstride, hstride = nheads * row, row
            else:
                tstride, hstride = row, kbs * row
            if layout.layer_placement == "cross_layer":
                base, region = cross_offset + base, 0
            else:
                region = li
            put(li, ci, region=region, base=base, block_stride=bstride, token_stride=tstride, head_stride=hstride,
                row_bytes=row, heads=nheads, first_head=h0)
        slot_bytes.append(layer_block)
        cross_offset += layer_block
        if layout.layer_placement == "per_layer":
            region_nbytes.append(nkb * layer_block)
    if layout.layer_placement == "cross_layer":
        arrays["block_stride"][:, :] = sum(slot_bytes)
        region_nbytes = [nkb * sum(slot_bytes)]
    for a in arrays.values():
        a.setflags(write=False)
    return Addressing(num_components=ncomp, region_nbytes=tuple(region_nbytes), **arrays)


def _align(nbytes: int, to: int = 16) -> int:
    return -(-nbytes // to) * to
