"""Byte-exact verification of plans: fill sources with a pattern that encodes each element's
logical coordinates, execute, and check every destination byte.

The check is independent of the planner: expected contents are written through the layout's
strided views (`RankCache.write_tokens`) into a copy of the destination taken before the
transfer, then the whole destination is compared bytewise. So a run that lands in the wrong
place, carries the wrong element, or touches memory outside the request's rows all fail.

Each rank is filled and checked only where it holds state: the layers of its PP stage and the
tokens of its CP rank. A component whose KV dtype or scale differs between the sides is filled
with finite values instead of bit patterns, and its expected destination elements are the
reference conversion of the source elements (`(x * src_scale) / dst_scale`, fp8 saturated, torch's
cast): element-wise equal to that, not bit-exact with a model run in the destination dtype.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.core.layout import EngineLayout

from kvbridge.transport.cache import TORCH_DTYPES, RankCache
from kvbridge.core.plan import Plan, Request, full_block_ids, plan_request
from kvbridge.core.spec import Component, LayerSpec, ModelSpec
from kvbridge.transport.local import LocalExecutor

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _hash(layer: int, comp: int, positions: np.ndarray, head0: int, heads: int, dim: int) -> torch.Tensor:
    t = torch.as_tensor(positions, dtype=torch.int64)[:, None, None]
    h = torch.arange(head0, head0 + heads, dtype=torch.int64)[None, :, None]
    d = torch.arange(dim, dtype=torch.int64)[None, None, :]
    x = (layer + 1) * 0x9E3779B1 + (comp + 1) * 0x85EBCA77 + (t + 1) * 0xC2B2AE3D + (h + 1) * 0x27D4EB2F + d * 0x165667B1
    x = (x ^ (x >> 15)) * 0x2C1B3C6D
    return x ^ (x >> 12)


def pattern(spec: ModelSpec, layer: int, comp: int, positions: np.ndarray, head0: int, heads: int,
            dim: int) -> torch.Tensor:
    """Integer pattern `[tokens, heads, dim]` that hashes (layer, comp, token, head, dim)."""
    x = _hash(layer, comp, positions, head0, heads, dim) & ((1 << (8 * spec.itemsize - 1)) - 1)
    return x.to(_INT[spec.itemsize])


def value_pattern(dtype: str, layer: int, comp: int, positions: np.ndarray, head0: int, heads: int,
                  dim: int) -> torch.Tensor:
    """Finite values `[tokens, heads, dim]` in `dtype` (for components that convert), same coordinates."""
    x = (_hash(layer, comp, positions, head0, heads, dim) % 2001 - 1000).to(torch.float32) / 64
    return x.to(TORCH_DTYPES[dtype])


def converted_components(spec: ModelSpec, src: EngineLayout, dst: EngineLayout) -> set[tuple[int, int]]:
    """(layer, component) whose element type or scales differ between the two engines."""
    s_spec, d_spec = src.engine_spec(spec), dst.engine_spec(spec)
    return {(li, ci) for li, layer in enumerate(spec.layers) for ci in range(len(layer.components))
            if s_spec.component_dtype(s_spec.layers[li].components[ci])
            != d_spec.component_dtype(d_spec.layers[li].components[ci])
            or src.scales(li, ci) != dst.scales(li, ci)}


def _reference_conversion(x: torch.Tensor, src_scales: torch.Tensor, dst_scales: torch.Tensor,
                          dtype: str) -> torch.Tensor:
    """What a destination element must be: scales broadcast over `[tokens, heads, 1]`."""
    out = TORCH_DTYPES[dtype]
    v = (x.to(torch.float32) * src_scales) / dst_scales
    if out in (torch.float8_e4m3fn, torch.float8_e5m2):
        v = v.clamp(-torch.finfo(out).max, torch.finfo(out).max)
    return v.to(out)


def _held(cache: RankCache, group: int, positions: np.ndarray) -> tuple[range, np.ndarray]:
    """Layers of this rank's PP stage, and which of `positions` its CP rank holds."""
    layout, coords = cache.layout, cache.layout.rank_coords(cache.rank)
    layers = range(*layout.stage_layers(cache.spec.num_layers, coords.pp))
    return layers, positions[layout.row_layout(cache.spec).token_owner(positions, group) == coords.cp]


def moved_positions(spec: ModelSpec, group: int, request: Request) -> np.ndarray:
    """Positions a group moves: tokens, or rows of complete windows for a layer keeping one row
    per several tokens."""
    kept = spec.group_layer(group).moved_positions(request.num_tokens, request.num_cached_tokens)
    return np.arange(kept.start, kept.stop, dtype=np.int64)


def _state_pattern(cache: RankCache, li: int, ci: int, num_tokens: int) -> torch.Tensor:
    """Pattern of one recurrent state component (its 'token' is the request length)."""
    spec, a = cache.spec, cache.addr
    comp = spec.layers[li].components[ci]
    sub = ModelSpec(spec.layers, spec.component_dtype(comp))  # pattern width follows the component dtype
    return pattern(sub, li, ci, np.array([num_tokens]), int(a.first_head[li, ci]), int(a.heads[li, ci]), comp.dim)[0]


def _scale_grid(layout: EngineLayout, li: int, ci: int, h0: int, nh: int) -> torch.Tensor:
    sc = layout.scales(li, ci)
    return torch.tensor([sc[h % len(sc)] for h in range(h0, h0 + nh)], dtype=torch.float32)[None, :, None]


def _fill_rows(cache: RankCache, li: int, ci: int, pos: np.ndarray, converted: bool) -> torch.Tensor:
    spec, a = cache.spec, cache.addr
    comp = spec.layers[li].components[ci]
    h0, nh = int(a.first_head[li, ci]), int(a.heads[li, ci])
    if converted:
        return value_pattern(spec.component_dtype(comp), li, ci, pos, h0, nh, comp.dim)
    return pattern(spec, li, ci, pos, h0, nh, comp.dim)


def fill_source(caches: list[RankCache], block_ids: tuple[tuple[int, ...], ...], num_tokens: int,
                converted: set[tuple[int, int]] = frozenset()) -> None:
    """Write the pattern for tokens `[0, num_tokens)` of every layer into every source rank
    (the layers and tokens each rank holds); `converted` components get finite values."""
    positions = np.arange(num_tokens, dtype=np.int64)
    for cache in caches:
        spec = cache.spec
        for li in _held(cache, 0, positions[:0])[0]:
            if spec.layers[li].is_stateless:
                continue
            g = spec.layer_group[li]
            ids = block_ids[g]
            if spec.layers[li].is_recurrent:
                for ci in range(len(spec.layers[li].components)):
                    cache.write_state(li, ci, ids[-1], _state_pattern(cache, li, ci, num_tokens))
                continue
            rows = spec.layers[li].rows(num_tokens)  # tokens, or rows of complete windows
            _, pos = _held(cache, g, positions[spec.layers[li].tokens_kept(rows):rows])
            ids = _padded(cache.layout, g, ids, num_tokens)
            for ci in range(len(spec.layers[li].components)):
                cache.write_tokens(li, ci, ids, pos, _fill_rows(cache, li, ci, pos, (li, ci) in converted))


def _padded(layout: EngineLayout, group: int, ids: tuple[int, ...], num_tokens: int) -> np.ndarray:
    """A clipped id list put back in place (the dropped leading blocks hold no moved token)."""
    return full_block_ids(layout, group, ids, num_tokens)


def expected_destination(before: list[RankCache], request: Request, src: EngineLayout | None = None,
                         model: ModelSpec | None = None) -> None:
    """Write into `before` (a copy of the destination) what the transfer must produce.

    `src` and `model`: the source engine and the model, when the source's KV dtype or scales may
    differ (conversion expected).
    """
    for cache in before:
        spec, a = cache.spec, cache.addr
        converted = converted_components(model, src, cache.layout) if src and model else set()
        src_spec = src.engine_spec(model) if src and model else spec
        for li in _held(cache, 0, np.zeros(0, np.int64))[0]:
            if spec.layers[li].is_stateless:
                continue
            g = spec.layer_group[li]
            if spec.layers[li].is_recurrent:
                if request.num_cached_tokens < request.num_tokens:
                    for ci in range(len(spec.layers[li].components)):
                        cache.write_state(li, ci, request.dst_block_ids[g][-1],
                                          _state_pattern(cache, li, ci, request.num_tokens))
                continue
            _, pos = _held(cache, g, moved_positions(spec, g, request))
            if not len(pos):
                continue
            ids = _padded(cache.layout, g, request.dst_block_ids[g], request.num_tokens)
            for ci, comp in enumerate(spec.layers[li].components):
                h0, nh = int(a.first_head[li, ci]), int(a.heads[li, ci])
                if (li, ci) in converted:
                    x = value_pattern(src_spec.component_dtype(src_spec.layers[li].components[ci]), li, ci, pos,
                                      h0, nh, comp.dim)
                    vals = _reference_conversion(x, _scale_grid(src, li, ci, h0, nh),  # type: ignore[arg-type]
                                                 _scale_grid(cache.layout, li, ci, h0, nh), spec.component_dtype(comp))
                else:
                    vals = pattern(spec, li, ci, pos, h0, nh, comp.dim)
                cache.write_tokens(li, ci, ids, pos, vals)


def clone_caches(caches: list[RankCache]) -> list[RankCache]:
    return [RankCache(c.spec, c.layout, c.rank, [r.clone() for r in c.regions]) for c in caches]


def random_bytes(caches: list[RankCache], seed: int) -> None:
    """Every byte random from `seed`: what a hosted rank starts with (`rank_host.random_fill`)."""
    from kvbridge.connector.rank_host import random_fill
    random_fill(caches, seed)


def mismatch_report(actual: list[RankCache], expected: list[RankCache]) -> list[str]:
    """Human-readable list of differing (rank, region, first byte offset, count)."""
    out = []
    for a, e in zip(actual, expected):
        for i, (ra, re) in enumerate(zip(a.byte_regions(), e.byte_regions())):
            diff = torch.nonzero(ra != re).flatten()
            if diff.numel():
                out.append(f"rank {a.rank} region {i}: {diff.numel()} bytes differ, first at {int(diff[0])}")
    return out


def random_request(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, num_tokens: int,
                   num_cached_tokens: int, rng: random.Random, clip_windows: bool = False) -> Request:
    """Distinct random block ids per group on both sides (groups have their own tables).

    `clip_windows`: sliding-window lists may drop their leading blocks that hold no kept token,
    as vLLM sends them.
    """
    def ids(layout: EngineLayout) -> tuple[tuple[int, ...], ...]:
        out = []
        for g in range(len(spec.groups)):
            need = layout.block_ids_needed(g, num_tokens)
            chosen = tuple(rng.sample(range(layout.num_blocks), need))
            layer = spec.group_layer(g)
            if clip_windows and layer.window is not None and rng.random() < 0.5:
                chosen = chosen[layout.block_span(g, layer.tokens_kept(num_tokens), num_tokens)[0]:]
            out.append(chosen)
        return tuple(out)
    return Request(ids(src), ids(dst), num_tokens, num_cached_tokens)


@dataclass
class CaseResult:
    spec: ModelSpec
    src: EngineLayout
    dst: EngineLayout
    request: Request
    plan: Plan
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


def prepare_case(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, request: Request, seed: int = 0
                 ) -> tuple[list[RankCache], list[RankCache], list[RankCache], Plan]:
    """(source caches, destination caches, expected destination, plan) of one case: random bytes
    everywhere (seeds `seed`, `seed + 1`), the pattern in the request's source rows, and what
    every destination byte must be after the plan runs."""
    src_caches = RankCache.allocate_engine(spec, src, fill=None)
    dst_caches = RankCache.allocate_engine(spec, dst, fill=None)
    random_bytes(src_caches, seed)
    random_bytes(dst_caches, seed + 1)
    fill_source(src_caches, request.src_block_ids, request.num_tokens, converted_components(spec, src, dst))
    expected = clone_caches(dst_caches)
    expected_destination(expected, request, src, spec)
    return src_caches, dst_caches, expected, plan_request(spec, src, dst, request)


def check_case(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, request: Request, seed: int = 0,
               backend: str = "auto", checksum: bool = False) -> CaseResult:
    """Plan and execute one request between fresh caches and compare every destination byte.

    With `checksum`, the end-to-end request checksum (`integrity`) must also agree.
    """
    src_caches, dst_caches, expected, plan = prepare_case(spec, src, dst, request, seed)
    LocalExecutor(src_caches, dst_caches, backend=backend).execute(plan)  # type: ignore[arg-type]
    mismatches = mismatch_report(dst_caches, expected)
    # The request checksum hashes bytes: it has no meaning across a conversion.
    checksum = checksum and not plan.needs_conversion
    if checksum:
        from kvbridge.core.integrity import verify_request
        mismatches += verify_request(src_caches, dst_caches, request)
    return CaseResult(spec, src, dst, request, plan, mismatches)


def _legal_tps(heads: int, limit: int = 8) -> list[int]:
    return [t for t in range(1, limit + 1) if heads % t == 0 or t % heads == 0]


def random_case(rng: random.Random, all_axes: bool = False) -> tuple[ModelSpec, EngineLayout, EngineLayout, Request]:
    """A random legal shape pair: heads, TP sizes, block and kernel sizes, layouts, groups.

    `all_axes` also draws PP (even or uneven splits), DCP/PCP with interleaves, per-group block
    sizes, KV dtypes with per-tensor or per-head scales, and clipped sliding-window lists (the
    TP-only draw stays the default here; `kvbridge verify` draws every axis, request checksums included).
    """
    kind = rng.choice(["gqa", "gqa", "mqa", "mla", "hybrid-window", "mixed-dims", "hybrid-state"])
    heads = 1 if kind in ("mqa", "mla") else rng.choice([2, 3, 4, 6, 8])
    dim = rng.choice([4, 8, 16])
    dtype = rng.choice(["bfloat16", "float32", "float16", "float8_e4m3fn"])
    layers_n = rng.randint(1, 4)
    if kind == "mla":
        spec = ModelSpec.uniform(layers_n, 1, dim, dtype, "random-mla", kinds=("mla",))
    elif kind == "hybrid-window":
        spec = ModelSpec.uniform(max(2, layers_n), heads, dim, dtype, "random-swa", kinds=("sliding", "full"),
                                 window=rng.randint(2, 40))
    elif kind == "hybrid-state":
        units = rng.choice([1, 2, 4])
        state = (Component("conv_x", units * 2, 3 * rng.choice([1, 2])), Component("conv_b", units, 3),
                 Component("conv_c", units, 3), Component("ssm", units * 2, rng.choice([4, 8]),
                                                          rng.choice([None, "float32"])))
        rec = LayerSpec("recurrent", state=state, recurrent_type="mamba2", conv_rows=3)
        attn = LayerSpec("full", heads, dim, dim)
        spec = ModelSpec(tuple(rec if i % 2 == 0 else attn for i in range(max(2, layers_n))), dtype, "random-hybrid")
    elif kind == "mixed-dims":
        spec = ModelSpec(tuple(LayerSpec("full", heads, dim * (1 + i % 2), dim) for i in range(layers_n)), dtype,
                         "random-dims")
    else:
        spec = ModelSpec.uniform(layers_n, heads, dim, dtype, f"random-{kind}")

    def layout(tp_choices: list[int]) -> EngineLayout:
        kbs = rng.choice([1, 2, 4, 8, 16])
        block = kbs * rng.choice([1, 1, 2, 3, 4])
        placement = rng.choice(["kv_first", "blocks_first", "cross"])
        return EngineLayout(
            tp_size=rng.choice(tp_choices), block_size=block, num_blocks=rng.randint(8, 24),
            kernel_block_size=kbs, kv_order=rng.choice(["NHD", "HND"]),
            kv_placement="blocks_first" if placement != "kv_first" else "kv_first",
            layer_placement="cross_layer" if placement == "cross" else "per_layer")

    tps = [1, 2, 3, 4] if kind == "mla" else _legal_tps(heads)
    if kind == "hybrid-state":
        tps = [t for t in tps if all(c.heads % t == 0 or t % c.heads == 0 for c in state)]
    src, dst = layout(tps), layout(tps)
    if kind == "hybrid-state":  # state needs per-layer regions
        import msgspec
        src, dst = (msgspec.structs.replace(x, layer_placement="per_layer") for x in (src, dst))
    if all_axes:
        src, dst = _more_axes(rng, spec, src, True), _more_axes(rng, spec, dst, False)
    max_tokens = min(x.tokens_per_block_id(g) * x.num_blocks for x in (src, dst) for g in range(len(spec.groups))) // 2
    # Pages smaller than the interleave fill one CP rank's blocks first: keep to what both sides hold.
    while max_tokens > 1 and any(x.block_ids_needed(g, max_tokens) > x.num_blocks
                                 for x in (src, dst) for g in range(len(spec.groups))):
        max_tokens //= 2
    num_tokens = rng.randint(1, max(1, max_tokens))
    cached = rng.choice([0, 0, rng.randint(0, num_tokens)])
    return spec, src, dst, random_request(spec, src, dst, num_tokens, cached, rng, clip_windows=all_axes)


def _more_axes(rng: random.Random, spec: ModelSpec, layout: EngineLayout, prefill: bool) -> EngineLayout:
    """PP, CP, per-group block sizes and a KV dtype with scales, drawn legal for `layout`'s TP."""
    import msgspec
    n = spec.num_layers
    pp = rng.choice([1, 1, 2, 3]) if n > 1 else 1
    pp = min(pp, n)
    split: tuple[int, ...] = ()
    if pp > 1 and rng.random() < 0.5:
        cuts = sorted(rng.sample(range(1, n), pp - 1))
        split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n]))
    tp = layout.tp_size
    token_comps = [(c.heads, layer.replicated) for layer in spec.layers if not layer.is_recurrent for c in layer.components]
    dcps = [d for d in range(1, tp + 1) if tp % d == 0 and all(
        (tp if rep else tp // h if tp > h else 1) % d == 0 for h, rep in token_comps)]
    dcp = rng.choice(dcps)
    pcp = rng.choice([1, 1, 2]) if prefill else 1
    kbs = layout.kernel_block_size or layout.block_size
    groups = len(spec.groups)
    sizes: tuple[int, ...] = ()
    if groups > 1 and layout.layer_placement == "per_layer" and rng.random() < 0.5:
        sizes = tuple(kbs * rng.choice([1, 2, 3, 4]) for _ in range(groups))
    blocks = sizes or (layout.block_size,)
    # An interleave dividing the blocks (vLLM's virtual blocks) or larger (pages smaller than the
    # interleave, vLLM's compact-local pages).
    interleave = rng.choice([i for i in (1, 2, 4, 8, 16) if all(b % i == 0 for b in blocks)] + [32, 64])
    kv_dtype, scales = None, ()
    if rng.random() < 0.4:
        kv_dtype = rng.choice(["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"])
        if kv_dtype.startswith("float8") and rng.random() < 0.7:
            per_head = rng.random() < 0.5
            scales = tuple(() if layer.is_recurrent else tuple(
                tuple(rng.choice([0.01, 0.03, 0.05, 0.25, 1.0]) for _ in range(c.heads if per_head else 1))
                for c in layer.components) for layer in spec.layers)
    return msgspec.structs.replace(layout, pp_size=pp, layer_split=split, dcp_size=dcp, pcp_size=pcp,
                                   cp_interleave=interleave, group_block_sizes=sizes, kv_dtype=kv_dtype,
                                   kv_scales=scales)
