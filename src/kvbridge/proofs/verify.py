"""Byte-exact verification of plans: fill sources with a pattern that encodes each element's
logical coordinates, execute, and check every destination byte.

The check is independent of the planner: expected contents are written through the layout's
strided views (`RankCache.write_tokens`) into a copy of the destination taken before the
transfer, then the whole destination is compared bytewise. So a run that lands in the wrong
place, carries the wrong element, or touches memory outside the request's rows all fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from kvbridge.core.layout import EngineLayout

from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Plan, Request, plan_request
from kvbridge.core.spec import Component, LayerSpec, ModelSpec
from kvbridge.transport.local import LocalExecutor

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pattern(spec: ModelSpec, layer: int, comp: int, positions: np.ndarray, head0: int, heads: int,
            dim: int) -> torch.Tensor:
    """Integer pattern `[tokens, heads, dim]` that hashes (layer, comp, token, head, dim)."""
    t = torch.as_tensor(positions, dtype=torch.int64)[:, None, None]
    h = torch.arange(head0, head0 + heads, dtype=torch.int64)[None, :, None]
    d = torch.arange(dim, dtype=torch.int64)[None, None, :]
    x = (layer + 1) * 0x9E3779B1 + (comp + 1) * 0x85EBCA77 + (t + 1) * 0xC2B2AE3D + (h + 1) * 0x27D4EB2F + d * 0x165667B1
    x = (x ^ (x >> 15)) * 0x2C1B3C6D
    x = (x ^ (x >> 12)) & ((1 << (8 * spec.itemsize - 1)) - 1)
    return x.to(_INT[spec.itemsize])


def moved_positions(spec: ModelSpec, group: int, request: Request) -> np.ndarray:
    first = max(request.num_cached_tokens, spec.group_layer(group).tokens_kept(request.num_tokens))
    return np.arange(first, request.num_tokens, dtype=np.int64)


def _state_pattern(cache: RankCache, li: int, ci: int, num_tokens: int) -> torch.Tensor:
    """Pattern of one recurrent state component (its 'token' is the request length)."""
    spec, a = cache.spec, cache.addr
    comp = spec.layers[li].components[ci]
    sub = ModelSpec(spec.layers, spec.component_dtype(comp))  # pattern width follows the component dtype
    return pattern(sub, li, ci, np.array([num_tokens]), int(a.first_head[li, ci]), int(a.heads[li, ci]), comp.dim)[0]


def fill_source(caches: list[RankCache], block_ids: tuple[tuple[int, ...], ...], num_tokens: int) -> None:
    """Write the pattern for tokens `[0, num_tokens)` of every layer into every source rank."""
    positions = np.arange(num_tokens, dtype=np.int64)
    for cache in caches:
        spec, a = cache.spec, cache.addr
        for li in range(spec.num_layers):
            ids = block_ids[spec.layer_group[li]]
            if spec.layers[li].is_recurrent:
                for ci in range(len(spec.layers[li].components)):
                    cache.write_state(li, ci, ids[-1], _state_pattern(cache, li, ci, num_tokens))
                continue
            first = spec.layers[li].tokens_kept(num_tokens)
            pos = positions[first:]
            for ci, comp in enumerate(spec.layers[li].components):
                vals = pattern(spec, li, ci, pos, int(a.first_head[li, ci]), int(a.heads[li, ci]), comp.dim)
                cache.write_tokens(li, ci, ids, pos, vals)


def expected_destination(before: list[RankCache], request: Request) -> None:
    """Write into `before` (a copy of the destination) what the transfer must produce."""
    for cache in before:
        spec, a = cache.spec, cache.addr
        for li in range(spec.num_layers):
            g = spec.layer_group[li]
            if spec.layers[li].is_recurrent:
                if request.num_cached_tokens < request.num_tokens:
                    for ci in range(len(spec.layers[li].components)):
                        cache.write_state(li, ci, request.dst_block_ids[g][-1],
                                          _state_pattern(cache, li, ci, request.num_tokens))
                continue
            pos = moved_positions(spec, g, request)
            if not len(pos):
                continue
            for ci, comp in enumerate(spec.layers[li].components):
                vals = pattern(spec, li, ci, pos, int(a.first_head[li, ci]), int(a.heads[li, ci]), comp.dim)
                cache.write_tokens(li, ci, request.dst_block_ids[g], pos, vals)


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
                   num_cached_tokens: int, rng: random.Random) -> Request:
    """Distinct random block ids per group on both sides (groups have their own tables)."""
    def ids(layout: EngineLayout) -> tuple[tuple[int, ...], ...]:
        need = -(-num_tokens // layout.block_size)
        return tuple(tuple(rng.sample(range(layout.num_blocks), need)) for _ in spec.groups)
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


def check_case(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, request: Request, seed: int = 0,
               backend: str = "auto", checksum: bool = False) -> CaseResult:
    """Plan and execute one request between fresh caches and compare every destination byte.

    With `checksum`, the end-to-end request checksum (`integrity`) must also agree.
    """
    src_caches = RankCache.allocate_engine(spec, src, fill=None)
    dst_caches = RankCache.allocate_engine(spec, dst, fill=None)
    random_bytes(src_caches, seed)
    random_bytes(dst_caches, seed + 1)
    fill_source(src_caches, request.src_block_ids, request.num_tokens)
    expected = clone_caches(dst_caches)
    expected_destination(expected, request)
    plan = plan_request(spec, src, dst, request)
    LocalExecutor(src_caches, dst_caches, backend=backend).execute(plan)  # type: ignore[arg-type]
    mismatches = mismatch_report(dst_caches, expected)
    if checksum:
        from kvbridge.core.integrity import verify_request
        mismatches += verify_request(src_caches, dst_caches, request)
    return CaseResult(spec, src, dst, request, plan, mismatches)


def _legal_tps(heads: int, limit: int = 8) -> list[int]:
    return [t for t in range(1, limit + 1) if heads % t == 0 or t % heads == 0]


def random_case(rng: random.Random) -> tuple[ModelSpec, EngineLayout, EngineLayout, Request]:
    """A random legal shape pair: heads, TP sizes, block and kernel sizes, layouts, groups."""
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
    max_tokens = min(src.block_size * src.num_blocks, dst.block_size * dst.num_blocks) // 2
    num_tokens = rng.randint(1, max(1, max_tokens))
    cached = rng.choice([0, 0, rng.randint(0, num_tokens)])
    return spec, src, dst, random_request(spec, src, dst, num_tokens, cached, rng)
