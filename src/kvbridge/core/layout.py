"""Physical layouts: where each (layer, component, block, token, head) row lives in memory.

An `EngineLayout` is what every rank of one engine shares: its parallel shape (TP x PP x PCP,
with DCP inside TP), block size (one per KV-cache group if they differ), kernel blocks per
logical block, order inside a block (NHD token-major, HND head-major), K/V placement (K/V-first:
every block's K, then every block's V; blocks-first: each block's K then its V; per-head: each
head's K then its V inside a block, where a layer's components have the same heads, else
blocks-first: what makes a pool object one run of bytes), whether
regions are per layer or one cross-layer region, and the KV dtype with its scales. For one rank
it resolves to an `Addressing` table: for every (layer, component) a region and the byte strides
of block, token and head. Everything downstream (planner, executors, the transformers bridge,
verification) addresses memory through that table and nothing else, so a layout is described
exactly once.

Ranks. An engine's ranks are numbered flat, as vLLM numbers its world (TP fastest, then PCP,
then PP): `rank = (pp_rank * pcp_size + pcp_rank) * tp_size + tp_rank`; the DCP rank is
`tp_rank % dcp_size` and the CP rank (which tokens a rank holds) `pcp_rank * dcp_size + dcp_rank`.
With PP = PCP = 1 the flat rank is the TP rank, so executors that index caches by rank, and
every plan of a TP-only pair, are unchanged. A rank holds the layers of its PP stage only: its
regions are those layers' regions, numbered from 0 in layer order.

Rows per block. A layer keeping one row per `tokens_per_row` (r) tokens (DeepSeek-V4's compressed
caches, vLLM's `tokens_per_state`) keeps its block table in tokens: one block id per `block_size`
tokens, holding `block_size // r` rows. `row_layout(spec)` is the layout as such a group sees it
(its block and kernel sizes in rows), and everything that turns positions into slots (the planner,
rank caches) reads rows through it. Block sizes not divisible by r and a kernel block size of its own
are refused with such a layer. Under context parallel a row lives on the CP rank of its tokens (the
interleave must hold whole rows), at that rank's local row (vLLM's later PCP): in rows, the
compact-local rule with an interleave of I / r, which the row layout keeps per group
(`group_cp_interleaves`).

Context parallel. A token's CP rank and its page follow vLLM's compact-local rule (`shard.cp_slots`):
each CP rank keeps its own tokens in order, `block_size` per page, so pages may be smaller than the
interleave (DeepSeek-V4's 64-token pages under a 256-token interleave); a request then needs the ids
the rank holding the most tokens fills (`block_ids_needed`).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal, NamedTuple

import msgspec
import numpy as np

from kvbridge.errors import InvalidRequest, IncompatibleEngines, KVBridgeError
from kvbridge.core.shard import check_dcp, check_shardable, cp_block_span, cp_slots, head_range, pp_layer_range
from kvbridge.core.spec import ModelSpec, normalize_dtype

KVOrder = Literal["NHD", "HND"]
KVPlacement = Literal["kv_first", "blocks_first", "per_head"]
LayerPlacement = Literal["per_layer", "cross_layer"]

class RankCoords(NamedTuple):
    """Where a flat rank sits in its engine."""

    tp: int
    pp: int
    pcp: int
    dcp: int
    cp: int  # pcp * dcp_size + dcp: which tokens it holds


class EngineLayout(msgspec.Struct, frozen=True):
    """How one engine (all its ranks) lays out its paged KV cache.

    `layer_split` is vLLM's `VLLM_PP_LAYER_PARTITION` (empty: vLLM's even split).
    `group_block_sizes` gives each KV-cache group its own block size (empty: `block_size` for all).
    `kv_dtype` is the attention cache's element type (None: the model's); recurrent state keeps
    the model's. `kv_scales[layer][component]` holds one scale (per tensor, vLLM's k_scale /
    v_scale) or one per KV head; a stored element means `element * scale` (empty: all 1).
    `group_cp_interleaves` gives each group its own CP interleave (empty: `cp_interleave` for all):
    only a row layout (`row_layout`) sets it, in rows (`cp_interleave // tokens_per_row`); vLLM has
    one interleave per engine.
    """

    tp_size: int = 1
    block_size: int = 16
    num_blocks: int = 1024
    kernel_block_size: int | None = None
    kv_order: KVOrder = "HND"
    kv_placement: KVPlacement = "kv_first"
    layer_placement: LayerPlacement = "per_layer"
    pp_size: int = 1
    layer_split: tuple[int, ...] = ()
    dcp_size: int = 1
    pcp_size: int = 1
    cp_interleave: int = 1
    group_block_sizes: tuple[int, ...] = ()
    kv_dtype: str | None = None
    kv_scales: tuple[tuple[tuple[float, ...], ...], ...] = ()
    group_cp_interleaves: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.block_size < 1 or self.num_blocks < 1:
            raise IncompatibleEngines(
                f"TP size, block size and block count must be >= 1, got {self.tp_size}, "
                f"{self.block_size}, {self.num_blocks}")
        if min(self.pp_size, self.dcp_size, self.pcp_size, self.cp_interleave) < 1:
            raise IncompatibleEngines(
                f"PP, DCP, PCP sizes and the CP interleave must be >= 1, got {self.pp_size}, {self.dcp_size}, "
                f"{self.pcp_size}, {self.cp_interleave}")
        if self.tp_size % self.dcp_size:
            raise IncompatibleEngines(f"DCP size {self.dcp_size} must divide TP size {self.tp_size} (DCP reuses TP ranks)")
        if self.layer_split and len(self.layer_split) != self.pp_size:
            raise IncompatibleEngines(f"layer split {list(self.layer_split)} needs one entry per PP stage ({self.pp_size})")
        if any(b < 1 for b in self.group_block_sizes):
            raise IncompatibleEngines(f"group block sizes must be >= 1, got {list(self.group_block_sizes)}")
        if any(i < 1 for i in self.group_cp_interleaves):
            raise IncompatibleEngines(f"group CP interleaves must be >= 1, got {list(self.group_cp_interleaves)}")
        if self.kv_dtype is not None:
            try:
                msgspec.structs.force_setattr(self, "kv_dtype", normalize_dtype(self.kv_dtype))
            except KVBridgeError as exc:
                raise IncompatibleEngines(str(exc)) from None
        if self.layer_placement == "cross_layer" and len(set(self.group_block_sizes)) > 1:
            raise IncompatibleEngines("a cross_layer region needs one block size for every group")
        if self.kernel_block_size is not None and self.kernel_block_size < 1:
            raise IncompatibleEngines(
                f"kernel block size must be >= 1 (block size {self.block_size}), got {self.kernel_block_size}")
        for size in (self.block_size, *self.group_block_sizes):
            kbs = self.kernel_block_size or size
            if size % kbs:
                raise IncompatibleEngines(f"kernel block size {kbs} must divide the logical block size {size}")
        if self.kv_order not in ("NHD", "HND"):
            raise IncompatibleEngines(f"kv_order must be NHD or HND, got {self.kv_order!r}")
        if self.kv_placement not in ("kv_first", "blocks_first", "per_head"):
            raise IncompatibleEngines(f"kv_placement must be kv_first, blocks_first or per_head, got {self.kv_placement!r}")
        if self.kv_placement == "per_head" and self.kv_order != "HND":
            raise IncompatibleEngines("per_head keeps each head's tokens back to back: it needs kv_order HND")
        if self.layer_placement not in ("per_layer", "cross_layer"):
            raise IncompatibleEngines(f"layer_placement must be per_layer or cross_layer, got {self.layer_placement!r}")
        if self.layer_placement == "cross_layer" and self.kv_placement == "kv_first":
            raise IncompatibleEngines("a cross_layer region keeps K and V inside each block: use blocks_first or per_head")

    # -- ranks ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks of the engine: TP x PCP x PP (DCP reuses TP ranks)."""
        return self.tp_size * self.pcp_size * self.pp_size

    @property
    def cp_size(self) -> int:
        """Ranks a token's KV is spread over (PCP x DCP); each holds every cp_size-th chunk."""
        return self.pcp_size * self.dcp_size

    def describe_ranks(self) -> str:
        """'TP size 4', or 'the engine's 8 ranks (TP 2 x PCP 1 x PP 4)' (for error messages)."""
        if self.world_size == self.tp_size:
            return f"TP size {self.tp_size}"
        return f"the engine's {self.world_size} ranks (TP {self.tp_size} x PCP {self.pcp_size} x PP {self.pp_size})"

    def rank_coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise InvalidRequest(f"rank {rank} outside {self.describe_ranks()}")
        tp, rest = rank % self.tp_size, rank // self.tp_size
        pcp, pp = rest % self.pcp_size, rest // self.pcp_size
        dcp = tp % self.dcp_size
        return RankCoords(tp, pp, pcp, dcp, pcp * self.dcp_size + dcp)

    def flat_rank(self, tp: int, pp: int = 0, pcp: int = 0) -> int:
        return (pp * self.pcp_size + pcp) * self.tp_size + tp

    def stage_layers(self, num_layers: int, pp_rank: int) -> tuple[int, int]:
        """Layers `[start, stop)` held by PP stage `pp_rank`."""
        return pp_layer_range(num_layers, self.pp_size, pp_rank, self.layer_split)

    def layer_stage(self, num_layers: int) -> np.ndarray:
        """PP stage of every layer."""
        return _layer_stage(num_layers, self.pp_size, self.layer_split)

    # -- blocks -----------------------------------------------------------------------------------
    def group_block_size(self, group: int) -> int:
        return self.group_block_sizes[group] if self.group_block_sizes else self.block_size

    def group_kernel_size(self, group: int) -> int:
        return self.kernel_block_size or self.group_block_size(group)

    def group_num_kernel_blocks(self, group: int) -> int:
        return self.num_blocks * (self.group_block_size(group) // self.group_kernel_size(group))

    def tokens_per_block_id(self, group: int) -> int:
        """Tokens one block id of `group` covers across the CP ranks (vLLM's virtual block): as
        many on every id only when the block size is a multiple of the CP interleave
        (`whole_chunks`); count ids with `block_ids_needed` / `block_span`."""
        return self.group_block_size(group) * self.cp_size

    def whole_chunks(self, group: int) -> bool:
        """Whether each block id of `group` names `tokens_per_block_id` consecutive tokens (no CP,
        or blocks holding whole interleave chunks); False for pages smaller than the interleave."""
        return self.cp_size == 1 or self.group_block_size(group) % self.group_interleave(group) == 0

    def group_interleave(self, group: int) -> int:
        """CP interleave of `group`: tokens, or rows in a row layout."""
        return self.group_cp_interleaves[group] if self.group_cp_interleaves else self.cp_interleave

    def block_span(self, group: int, first: int, stop: int) -> tuple[int, int]:
        """Block-table indices `[lo, hi)` of `group` holding some token of positions `[first, stop)`
        on some CP rank (`shard.cp_block_span`)."""
        return cp_block_span(first, stop, self.group_block_size(group), self.cp_size, self.group_interleave(group))

    def block_ids_needed(self, group: int, num_tokens: int) -> int:
        """Block ids a request of `num_tokens` tokens needs in `group`: the most any CP rank's
        tokens fill (with pages smaller than the interleave, more than `num_tokens / (B * CP)`)."""
        return self.block_span(group, 0, num_tokens)[1]

    @property
    def kernel_size(self) -> int:
        """Tokens per kernel (physical) block of group 0."""
        return self.group_kernel_size(0)

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_size

    @property
    def num_kernel_blocks(self) -> int:
        return self.group_num_kernel_blocks(0)

    def check_model(self, spec: ModelSpec, what: str = "engine") -> None:
        for layer in spec.layers:
            for comp in layer.components:
                if not layer.replicated:
                    check_shardable(comp.heads, self.tp_size,
                                    what if comp.name in ("k", "v") else f"{what} ({comp.name} units)")
                if not layer.is_recurrent:
                    check_dcp(comp.heads, self.tp_size, self.dcp_size, layer.replicated, what)
        if self.pp_size > 1 or self.layer_split:
            try:
                self.stage_layers(spec.num_layers, 0)
            except KVBridgeError as exc:
                raise IncompatibleEngines(f"{what}: {exc}") from None
        if self.group_block_sizes and len(self.group_block_sizes) != len(spec.groups):
            raise IncompatibleEngines(
                f"{what}: {len(self.group_block_sizes)} group block sizes for a model with {len(spec.groups)} "
                f"KV-cache groups")
        _check_rows(spec, self, what)
        if self.kv_scales:
            if len(self.kv_scales) != spec.num_layers:
                raise IncompatibleEngines(f"{what}: KV scales for {len(self.kv_scales)} layers, the model has "
                                          f"{spec.num_layers}")
            for li, (layer, scales) in enumerate(zip(spec.layers, self.kv_scales)):
                comps = layer.components
                if len(scales) not in (0, len(comps)) or any(len(x) not in (1, c.heads) or min(x) <= 0
                                                             for x, c in zip(scales, comps)):
                    raise IncompatibleEngines(
                        f"{what}: layer {li} KV scales need one positive scale per component, or one per head")

    def scales(self, layer: int, comp: int) -> tuple[float, ...]:
        """Scales of one component: one (per tensor) or one per global head; (1.0,) without scales."""
        if not self.kv_scales or not self.kv_scales[layer]:
            return (1.0,)
        return self.kv_scales[layer][comp]

    def engine_spec(self, spec: ModelSpec) -> ModelSpec:
        """The model as this engine stores it: attention components in `kv_dtype`."""
        return spec if self.kv_dtype is None or self.kv_dtype == spec.dtype else _engine_spec(spec, self.kv_dtype)

    def kernel_slots(self, block_ids: np.ndarray, positions: np.ndarray,
                     group: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Kernel block id and offset inside it of each token position, given logical block ids,
        on the CP rank that holds the token (`token_owner`)."""
        vb, _, off = cp_slots(positions, self.group_block_size(group), self.cp_size, self.group_interleave(group))
        logical = np.asarray(block_ids, dtype=np.int64)[vb]
        kbs = self.group_kernel_size(group)
        return logical * (self.group_block_size(group) // kbs) + off // kbs, off % kbs

    def token_owner(self, positions: np.ndarray, group: int = 0) -> np.ndarray:
        """CP rank holding each token position."""
        return cp_slots(positions, self.group_block_size(group), self.cp_size, self.group_interleave(group))[1]

    def row_layout(self, spec: ModelSpec) -> EngineLayout:
        """This layout with each group's block size in rows (itself when every layer keeps one row
        per token): what the planner and rank caches turn row positions into slots with."""
        if not spec.row_rates:
            return self
        return _row_layout(spec, self)

    def addressing(self, spec: ModelSpec, rank: int) -> Addressing:
        return _addressing(spec, self, rank)

    def describe(self) -> str:
        kb = f", kernel {self.kernel_size}" if self.kernel_size != self.block_size else ""
        shape = f"TP={self.tp_size}"
        if self.pp_size > 1:
            shape += f" PP={self.pp_size}" + (f" split {','.join(map(str, self.layer_split))}" if self.layer_split else "")
        if self.pcp_size > 1:
            shape += f" PCP={self.pcp_size}"
        if self.dcp_size > 1:
            shape += f" DCP={self.dcp_size}"
        if self.cp_size > 1 and self.cp_interleave > 1:
            shape += f" interleave {self.cp_interleave}"
        block = (f"blocks {'/'.join(map(str, self.group_block_sizes))}" if len(set(self.group_block_sizes)) > 1
                 else f"block {self.group_block_size(0)}")
        dtype = f" {self.kv_dtype}" if self.kv_dtype else ""
        return (f"{shape} {block}{kb} {self.kv_order} {self.kv_placement}"
                f"{' cross-layer' if self.layer_placement == 'cross_layer' else ''}{dtype}")


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


def _check_rows(spec: ModelSpec, layout: EngineLayout, what: str) -> None:
    """A layer keeping one row per r tokens needs blocks of whole rows in its group, no kernel block
    size of its own in any group (the row layout has none) and, with context parallel, an interleave
    of whole rows (a row lives on the CP rank of its tokens, vLLM's rule) (one line each)."""
    if not spec.row_rates:
        return
    most = spec.row_rates[-1]
    if layout.cp_size > 1 and layout.cp_interleave % math.lcm(*spec.row_rates):
        rate = next(r for r in spec.row_rates if layout.cp_interleave % r)
        raise IncompatibleEngines(f"{what}: context parallel (CP {layout.cp_size}) interleave {layout.cp_interleave} is "
                                  f"not a multiple of the {rate} tokens per row of a compressed layer: one row's tokens "
                                  f"would lie on two CP ranks")
    if layout.layer_placement == "cross_layer":
        raise IncompatibleEngines(f"{what}: a cross_layer region with a layer keeping one row per {most} tokens")
    for g in range(len(spec.groups)):
        size, rate = layout.group_block_size(g), spec.group_layer(g).tokens_per_row
        if size % rate:
            raise IncompatibleEngines(f"{what}: block size {size} of group {g} is not a multiple of its "
                                      f"{rate} tokens per row")
        if layout.group_kernel_size(g) != size:
            raise IncompatibleEngines(f"{what}: kernel block size {layout.group_kernel_size(g)} with a layer keeping "
                                      f"one row per {most} tokens (only whole blocks are supported)")


@lru_cache(maxsize=64)
def _row_layout(spec: ModelSpec, layout: EngineLayout) -> EngineLayout:
    _check_rows(spec, layout, "engine")  # every group's kernel block is its whole block: none left to keep
    rates = [spec.group_layer(g).tokens_per_row for g in range(len(spec.groups))]
    sizes = tuple(layout.group_block_size(g) // rate for g, rate in enumerate(rates))
    # A row of r tokens lives on the CP rank of its tokens (one chunk: the interleave is a multiple
    # of r), at that rank's local row: in rows, the compact-local rule with an interleave of I / r.
    interleaves = tuple(layout.cp_interleave // rate for rate in rates) if layout.cp_size > 1 else ()
    return msgspec.structs.replace(layout, group_block_sizes=sizes, kernel_block_size=None, cp_interleave=1,
                                   group_cp_interleaves=interleaves)


@lru_cache(maxsize=64)
def _layer_stage(num_layers: int, pp_size: int, split: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(num_layers, dtype=np.int64)
    for p in range(pp_size):
        out[slice(*pp_layer_range(num_layers, pp_size, p, split))] = p
    out.setflags(write=False)
    return out


@lru_cache(maxsize=64)
def _engine_spec(spec: ModelSpec, kv_dtype: str) -> ModelSpec:
    """Attention in `kv_dtype`; recurrent components pinned to the model dtype (vLLM's
    `kv_cache_dtype` does not apply to Mamba state)."""
    layers = tuple(msgspec.structs.replace(layer, state=tuple(
        c if c.dtype else msgspec.structs.replace(c, dtype=spec.dtype) for c in layer.state))
        if layer.is_recurrent else layer for layer in spec.layers)
    return ModelSpec(layers, kv_dtype, spec.name)


@lru_cache(maxsize=256)
def _addressing(spec: ModelSpec, layout: EngineLayout, rank: int) -> Addressing:
    if not 0 <= rank < layout.world_size:
        raise InvalidRequest(f"rank {rank} outside {layout.describe_ranks()}")
    layout.check_model(spec)
    spec = layout.engine_spec(spec)
    coords = layout.rank_coords(rank)
    tp_rank = coords.tp
    first_layer, stop_layer = layout.stage_layers(spec.num_layers, coords.pp)
    if spec.has_recurrent and layout.layer_placement == "cross_layer":
        raise IncompatibleEngines("recurrent state needs per-layer regions; cross_layer holds attention layers only")
    L, C = spec.num_layers, spec.max_components
    rows_layout = layout.row_layout(spec)  # a rate group's kernel blocks hold rows, not tokens
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
        if not first_layer <= li < stop_layer:
            arrays["region"][li, :] = -1  # another PP stage's layer: no region, no heads here
            continue
        if not comps:  # a stateless layer: no region (vLLM allocates none), regions stay in layer order
            continue
        g = spec.layer_group[li]
        kbs, nkb = rows_layout.group_kernel_size(g), rows_layout.group_num_kernel_blocks(g)
        ranges = [head_range(c.heads, layout.tp_size, tp_rank, layer.replicated) for c in comps]
        rows = [c.dim * spec.component_itemsize(c) for c in comps]
        if layer.is_recurrent:
            # One state slot per logical block id; components back to back, each aligned to 16 B.
            base = 0
            for ci, ((h0, h1), row) in enumerate(zip(ranges, rows)):
                put(li, ci, region=len(region_nbytes), base=base, token_stride=0, head_stride=row, row_bytes=row,
                    heads=h1 - h0, first_head=h0)
                base += _align((h1 - h0) * row)
            arrays["block_stride"][li, : len(comps)] = base
            region_nbytes.append(layout.num_blocks * base)
            continue
        comp_block = [(h1 - h0) * kbs * row for (h0, h1), row in zip(ranges, rows)]
        layer_block = sum(comp_block)
        per_head = layout.kv_placement == "per_head" and len(set(ranges)) == 1
        for ci, ((h0, h1), row) in enumerate(zip(ranges, rows)):
            nheads = h1 - h0
            if per_head:  # a head's components back to back, each its kernel block's tokens in order
                base, bstride = kbs * sum(rows[:ci]), layer_block
            elif layout.kv_placement == "kv_first":
                base, bstride = nkb * sum(comp_block[:ci]), comp_block[ci]
            else:
                base, bstride = sum(comp_block[:ci]), layer_block
            if per_head:
                tstride, hstride = row, kbs * sum(rows)
            elif layout.kv_order == "NHD":
                tstride, hstride = nheads * row, row
            else:
                tstride, hstride = row, kbs * row
            if layout.layer_placement == "cross_layer":
                base, region = cross_offset + base, 0
            else:
                region = len(region_nbytes)  # this layer's, appended below (stateless layers have none)
            put(li, ci, region=region, base=base, block_stride=bstride, token_stride=tstride, head_stride=hstride,
                row_bytes=row, heads=nheads, first_head=h0)
        slot_bytes.append(layer_block)
        cross_offset += layer_block
        if layout.layer_placement == "per_layer":
            region_nbytes.append(nkb * layer_block)
    if layout.layer_placement == "cross_layer":
        arrays["block_stride"][first_layer:stop_layer, :] = sum(slot_bytes)
        region_nbytes = [layout.num_kernel_blocks * sum(slot_bytes)]
    for a in arrays.values():
        a.setflags(write=False)
    return Addressing(num_components=ncomp, region_nbytes=tuple(region_nbytes), **arrays)


def _align(nbytes: int, to: int = 16) -> int:
    return -(-nbytes // to) * to
