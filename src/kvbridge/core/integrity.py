"""End-to-end integrity: a request checksum over *logical* content, independent of layouts and TP.

Each logical row — (layer, component, token, head) for attention (for a compressed layer, a row
of `tokens_per_row` tokens in place of the token), (layer, component, unit) for recurrent state —
contributes `hash(row bytes, coordinates)`; contributions are added modulo 2^64, so any partition
of the rows sums to the same value. The source computes, for each destination rank, the sum over the rows that rank must hold, each source rank adding only the rows it serves
to that rank (the rank the plan reads them from), so replicated source heads count once. Each destination rank
sums every row it holds, replicas included. Equal sums mean every row arrived intact and in its
place (a row in the wrong place changes its coordinates' weights); a mismatch names the rank.

A rank holds the layers of its PP stage and the tokens of its CP rank; which source rank serves
which (layer, head, token) to which destination rank is the planner's `source_slices`. Bytes are
hashed, so a transfer that converts the KV dtype has no checksum (its proof is element-wise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Request, full_block_ids, source_slices
from kvbridge.core.spec import ModelSpec

if TYPE_CHECKING:  # the caches are the engines' torch tensors; the core only reads their bytes
    from kvbridge.transport.cache import RankCache

_MASK = (1 << 64) - 1
_WORD = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 arithmetic wraps with."""
    c &= _MASK
    return c - (1 << 64) if c >> 63 else c


_K = [_i64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x2545F4914F6CDD1D,
                        0x5851F42D4C957F2D)]


def _weights(layer: int, comp: int, coords: np.ndarray, words: int) -> np.ndarray:
    """Pseudo-random odd int64 weights per (row coordinates, word index): `[rows, words]`."""
    x = coords[:, None] * np.int64(_K[0]) + np.arange(words, dtype=np.int64)[None, :] * np.int64(_K[1])
    x = x + np.int64(_i64(layer * _K[2] + comp * _K[3]))
    x = x ^ (x >> 31)
    x = x * np.int64(_K[4])
    x = x ^ (x >> 29)
    return x | 1


def _row_hashes(rows: np.ndarray, layer: int, comp: int, coords: np.ndarray) -> np.ndarray:
    """hash(row, coords) per row of `rows` `[n, bytes]` (uint8), int64 wrapping arithmetic."""
    if rows.size == 0:
        return np.zeros(rows.shape[0], dtype=np.int64)
    n = rows.shape[1]
    width = 8 if n % 8 == 0 else 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    words = np.ascontiguousarray(rows).view(_WORD[width]).astype(np.int64)
    with np.errstate(over="ignore"):
        return (words * _weights(layer, comp, coords, words.shape[1])).sum(axis=1)


def _bytes(t: Any, rows: int) -> np.ndarray:
    """A tensor read as integers (`as_int=True`), on any device, as `[rows, bytes]` uint8."""
    return np.ascontiguousarray(t.cpu().numpy()).view(np.uint8).reshape(rows, -1)


def _rank_rows(cache: RankCache, block_ids: tuple[tuple[int, ...], ...], request: Request):
    """Yield (layer, comp, global heads of each row, token of each row or None, row hashes) for
    the rows this rank holds (its stage's layers, its CP rank's tokens)."""
    spec, a, layout = cache.spec, cache.addr, cache.layout
    coords = layout.rank_coords(cache.rank)
    for li in range(*layout.stage_layers(spec.num_layers, coords.pp)):
        layer, g = spec.layers[li], spec.layer_group[li]
        if layer.is_stateless:
            continue
        ids = block_ids[g]
        for ci in range(len(layer.components)):
            h0, nh = int(a.first_head[li, ci]), int(a.heads[li, ci])
            heads = np.arange(h0, h0 + nh, dtype=np.int64)
            if layer.is_recurrent:
                if request.num_cached_tokens >= request.num_tokens:
                    continue
                data = _bytes(cache.read_state(li, ci, ids[-1], as_int=True), nh)
                where, row_heads, row_pos = heads, heads, None
            else:
                kept = layer.moved_positions(request.num_tokens, request.num_cached_tokens)
                pos = np.arange(kept.start, kept.stop, dtype=np.int64)
                pos = pos[layout.row_layout(spec).token_owner(pos, g) == coords.cp]  # rows of a rate layer
                if not len(pos):
                    continue
                full = full_block_ids(layout, g, ids, request.num_tokens)
                data = _bytes(cache.read_tokens(li, ci, full, pos, as_int=True), len(pos) * nh)  # [T*H, D bytes]
                where = (pos[:, None] * 65536 + heads[None, :]).reshape(-1)
                row_heads, row_pos = np.tile(heads, len(pos)), np.repeat(pos, nh)
            yield li, ci, row_heads, row_pos, _row_hashes(data, li, ci, where)


def _sum(x: np.ndarray) -> int:
    return int(x.sum()) & _MASK


def destination_checksums(caches: list[RankCache], request: Request) -> list[int]:
    """What each destination rank holds of the request, every replica included."""
    return [sum(_sum(h) for *_, h in _rank_rows(c, request.dst_block_ids, request)) & _MASK for c in caches]


def source_checksums(caches: list[RankCache], request: Request, dst: EngineLayout) -> list[int]:
    """What each rank of a destination engine shaped `dst` must hold, computed from the source.

    The sum over source ranks of their `contribution_checksums`: every row a destination rank
    holds counts once, on the source rank that serves it, replicated source heads included.
    """
    out = [0] * dst.world_size
    for cache in caches:
        out = [(a + b) & _MASK for a, b in zip(out, contribution_checksums(cache, request, dst))]
    return out


def contribution_checksums(cache: RankCache, request: Request, dst: EngineLayout) -> list[int]:
    """One source rank's share of each destination rank's expected checksum.

    A row counts on the source rank that *serves* it to that destination rank (`plan.source_slices`,
    the rank the transfer plan reads it from), so every destination rank's expectation is the sum of
    the contributions of exactly the source ranks it talks to, and each can be sent with that rank's
    announcement. Only `request.src_block_ids`, `num_tokens` and `num_cached_tokens` are used.
    """
    spec, src = cache.spec, cache.layout
    my_cp = src.rank_coords(cache.rank).cp
    rows = list(_rank_rows(cache, request.src_block_ids, request))
    out = [0] * dst.world_size
    for d in range(dst.world_size):
        d_cp = dst.rank_coords(d).cp
        # Tokens: what d reads from the CP rank holding them (ours); state: from CP rank d_cp % cp_size.
        served = {False: _served(spec, src, dst, d, my_cp, cache.rank),
                  True: _served(spec, src, dst, d, d_cp % src.cp_size, cache.rank)}
        for li, ci, row_heads, row_pos, hashes in rows:
            mask = served[row_pos is None].get((li, ci))
            if mask is None:
                continue
            sel = mask[row_heads]
            if row_pos is not None:
                sel &= dst.row_layout(spec).token_owner(row_pos, spec.layer_group[li]) == d_cp
            out[d] = (out[d] + _sum(hashes[sel])) & _MASK
    return out


def _served(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int, src_cp: int, rank: int) -> dict[tuple[int, int], np.ndarray]:
    """(layer, comp) -> heads that source `rank` serves to destination rank `d` for CP rank `src_cp`."""
    served: dict[tuple[int, int], np.ndarray] = {}
    for sl in source_slices(spec, src, dst, d, src_cp):
        if sl.src_rank == rank:
            heads = spec.layers[sl.layer].components[sl.comp].heads
            served.setdefault((sl.layer, sl.comp), np.zeros(heads, dtype=bool))[sl.start:sl.stop] = True
    return served


def verify_request(src: list[RankCache], dst: list[RankCache], request: Request) -> list[str]:
    """Reasons the landed request differs from the source (empty when intact)."""
    expected = source_checksums(src, request, dst[0].layout)
    actual = destination_checksums(dst, request)
    return [f"destination rank {d}: checksum {a:#018x}, source sent {e:#018x}"
            for d, (e, a) in enumerate(zip(expected, actual)) if e != a]
