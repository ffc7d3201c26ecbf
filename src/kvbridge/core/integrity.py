"""End-to-end integrity: a request checksum over *logical* content, independent of layouts and TP.

Each logical row — (layer, component, token, head) for attention, (layer, component, unit) for
recurrent state — contributes `hash(row bytes, coordinates)`; contributions are added modulo
2^64, so any partition of the rows sums to the same value. The source computes, for each destination
rank, the sum over the rows that rank must hold, each source rank adding only the rows it serves
to that rank (the rank the plan reads them from), so replicated source heads count once. Each destination rank
sums every row it holds, replicas included. Equal sums mean every row arrived intact and in its
place (a row in the wrong place changes its coordinates' weights); a mismatch names the rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Request
from kvbridge.core.shard import head_range, preferred_holder

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
    """Yield (layer, comp, global heads of each row, row hashes) for the rows this rank holds."""
    spec, a = cache.spec, cache.addr
    for li, layer in enumerate(spec.layers):
        ids = block_ids[spec.layer_group[li]]
        for ci in range(len(layer.components)):
            h0, nh = int(a.first_head[li, ci]), int(a.heads[li, ci])
            heads = np.arange(h0, h0 + nh, dtype=np.int64)
            if layer.is_recurrent:
                if request.num_cached_tokens >= request.num_tokens:
                    continue
                data = _bytes(cache.read_state(li, ci, ids[-1], as_int=True), nh)
                coords, row_heads = heads, heads
            else:
                start = max(request.num_cached_tokens, layer.tokens_kept(request.num_tokens))
                pos = np.arange(start, request.num_tokens, dtype=np.int64)
                if not len(pos):
                    continue
                data = _bytes(cache.read_tokens(li, ci, ids, pos, as_int=True), len(pos) * nh)  # [T*H, D bytes]
                coords = (pos[:, None] * 65536 + heads[None, :]).reshape(-1)
                row_heads = np.tile(heads, len(pos))
            yield li, ci, row_heads, _row_hashes(data, li, ci, coords)


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
    out = [0] * dst.tp_size
    for cache in caches:
        out = [(a + b) & _MASK for a, b in zip(out, contribution_checksums(cache, request, dst))]
    return out


def contribution_checksums(cache: RankCache, request: Request, dst: EngineLayout) -> list[int]:
    """One source rank's share of each destination rank's expected checksum.

    A row counts on the source rank that *serves* it to that destination rank (`shard.preferred_holder`, the rank the transfer plan
    reads it from), so every destination rank's expectation is the sum of the contributions of
    exactly the source ranks it talks to, and each can be sent with that rank's announcement.
    Only `request.src_block_ids`, `num_tokens` and `num_cached_tokens` are used.
    """
    spec = cache.spec
    src_tp = cache.layout.tp_size
    out = [0] * dst.tp_size
    for li, ci, row_heads, hashes in _rank_rows(cache, request.src_block_ids, request):
        layer, comp = spec.layers[li], spec.layers[li].components[ci]
        for d in range(dst.tp_size):
            d0, d1 = head_range(comp.heads, dst.tp_size, d, layer.replicated)
            served = np.zeros(comp.heads, dtype=bool)
            for h in range(d0, d1):
                served[h] = preferred_holder(comp.heads, src_tp, dst.tp_size, d, h, layer.replicated) == cache.rank
            sel = served[row_heads]
            out[d] = (out[d] + _sum(hashes[sel])) & _MASK
    return out


def verify_request(src: list[RankCache], dst: list[RankCache], request: Request) -> list[str]:
    """Reasons the landed request differs from the source (empty when intact)."""
    expected = source_checksums(src, request, dst[0].layout)
    actual = destination_checksums(dst, request)
    return [f"destination rank {d}: checksum {a:#018x}, source sent {e:#018x}"
            for d, (e, a) in enumerate(zip(expected, actual)) if e != a]
