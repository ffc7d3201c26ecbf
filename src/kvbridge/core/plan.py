"""The planner: which bytes of which source rank land where on each destination rank.

For one request it intersects every destination rank's shard with the source ranks' shards
(`shard.assign_sources`), walks both layouts' `Addressing` over the tokens to move and emits
runs `(src_rank, src_region, src_offset, dst_region, dst_offset, length)` as numpy arrays.

It is pure (no I/O, no torch) and vectorized: tokens are cut into *segments* that stay inside
one kernel block on both sides; each (layer, component, head slice) x segment is a box of
tokens x heads x row bytes whose strides on both sides decide how many runs it needs (one when
the box is contiguous on both sides). Runs that touch on both sides are then merged. Any TP
pair whose sharding is legal on each side, any block sizes, NHD or HND on either side work the
same way, with no special case.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import cached_property, lru_cache

import msgspec
import numpy as np

from kvbridge.errors import InvalidRequest
from kvbridge.core.layout import EngineLayout
from kvbridge.core.shard import assign_sources
from kvbridge.core.spec import ModelSpec

TINY_RUN_BYTES = 2048
"""Mean run length below which a plan warns that copies will be slow."""

_RUN_FIELDS = ("dst_rank", "src_rank", "src_region", "src_offset", "dst_region", "dst_offset", "length")


class Request(msgspec.Struct, frozen=True):
    """One request's blocks: logical block ids per KV-cache group on each side.

    Each id list covers tokens `[0, num_tokens)` with that side's block size. The destination
    already holds the first `num_cached_tokens` tokens (prefix cache), which are not moved.
    Entries of blocks that hold no token to move (before a sliding window, or cached) are
    never read and may be any value (vLLM puts its null block there).
    """

    src_block_ids: tuple[tuple[int, ...], ...]
    dst_block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        """Accept lists, and a flat id list as the one group of a single-group model."""
        for name in ("src_block_ids", "dst_block_ids"):
            msgspec.structs.force_setattr(self, name, _groups_of(getattr(self, name), name))
        for name in ("num_tokens", "num_cached_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InvalidRequest(f"{name} must be an integer, got {value!r}")
            msgspec.structs.force_setattr(self, name, int(value))

    @classmethod
    def single_group(cls, src_ids: Sequence[int], dst_ids: Sequence[int], num_tokens: int,
                     num_cached_tokens: int = 0, num_groups: int = 1) -> Request:
        """A request whose groups all use the same block ids (a model with one block table)."""
        return cls(tuple(tuple(src_ids) for _ in range(num_groups)), tuple(tuple(dst_ids) for _ in range(num_groups)),
                   num_tokens, num_cached_tokens)


def _ints(ids: Sequence[object]) -> tuple[int, ...] | None:
    """`ids` as a tuple of Python ints, or None if one is not an integer (bools are not)."""
    kinds = set(map(type, ids))
    if kinds <= {int}:
        return ids if type(ids) is tuple else tuple(ids)  # type: ignore[return-value]
    if all(issubclass(k, (int, np.integer)) and k is not bool for k in kinds):
        return tuple(int(i) for i in ids)  # type: ignore[call-overload]
    return None


def _groups_of(ids: object, name: str) -> tuple[tuple[int, ...], ...]:
    """`ids` as one tuple of block ids per KV-cache group; a flat sequence is one group."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
        raise InvalidRequest(f"{name} must be a list of block ids per KV-cache group, got {type(ids).__name__}")
    if len(ids) and not isinstance(ids[0], (Sequence, np.ndarray)):  # a flat list: the one group
        flat = _ints(ids)
        if flat is None:
            raise InvalidRequest(f"{name} holds a value that is not an integer block id")
        return (flat,)
    groups = []
    for g, group in enumerate(ids):
        if isinstance(group, (str, bytes)) or not isinstance(group, (Sequence, np.ndarray)):
            raise InvalidRequest(f"{name}[{g}] must be a list of block ids, got {group!r}")
        ints = _ints(group)
        if ints is None:
            raise InvalidRequest(f"{name}[{g}] holds a value that is not an integer block id")
        groups.append(ints)
    return tuple(groups)


class PlanStats(msgspec.Struct):
    num_runs: int
    bytes_total: int
    mean_run_bytes: float
    min_run_bytes: int
    max_run_bytes: int
    pair_bytes: dict[str, int]  # "src->dst" -> bytes
    plan_seconds: float
    warnings: list[str]


class Plan:
    """Runs for every destination rank of one request, sorted by destination rank."""

    def __init__(self, spec: ModelSpec, src: EngineLayout, dst: EngineLayout, runs: dict[str, np.ndarray],
                 plan_seconds: float = 0.0):
        self.spec, self.src, self.dst = spec, src, dst
        for name in _RUN_FIELDS:
            setattr(self, name, runs[name])
        self.plan_seconds = plan_seconds

    @cached_property
    def stats(self) -> PlanStats:
        return _stats(self, self.plan_seconds)

    dst_rank: np.ndarray
    src_rank: np.ndarray
    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def runs(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in _RUN_FIELDS}

    def select(self, mask: np.ndarray) -> Plan:
        """The runs where `mask` holds (e.g. one rank pair), as a plan of its own."""
        return Plan(self.spec, self.src, self.dst, {n: getattr(self, n)[mask] for n in _RUN_FIELDS},
                    self.plan_seconds)


def plan_request(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, request: Request,
                 dst_ranks: Sequence[int] | None = None) -> Plan:
    """Plan the copies of one request from every source rank to `dst_ranks` (default: all)."""
    t0 = time.perf_counter()
    src.check_model(spec, "source engine")
    dst.check_model(spec, "destination engine")
    segments = _validate_and_segment(spec, src, dst, request)
    ranks = range(dst.tp_size) if dst_ranks is None else dst_ranks
    parts = []
    for d in ranks:
        if not 0 <= d < dst.tp_size:
            raise InvalidRequest(f"destination rank {d} outside TP size {dst.tp_size}")
        parts.append(_plan_rank(spec, src, dst, d, segments))
    return Plan(spec, src, dst, _concat(parts, _RUN_FIELDS), time.perf_counter() - t0)


def _concat(parts: list[dict[str, np.ndarray]], fields: Sequence[str]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0, np.int64) for n in fields}


class _Segments(msgspec.Struct):
    """Token segments of one group: each lies inside one kernel block on both sides."""

    n: np.ndarray
    src_block: np.ndarray
    src_pos: np.ndarray
    dst_block: np.ndarray
    dst_pos: np.ndarray


def _state_segment(g: int, src: EngineLayout, dst: EngineLayout, req: Request) -> _Segments | None:
    """A recurrent group moves one state slot: the last block id of each side's list.

    (vLLM puts placeholder blocks before the real state block when prefix caching is on.)
    Nothing moves when the destination already holds every token.
    """
    slots = []
    for side, layout, ids in (("source", src, req.src_block_ids[g]), ("destination", dst, req.dst_block_ids[g])):
        if not ids:
            raise InvalidRequest(f"{side} group {g} (recurrent state) needs at least one block id, got none")
        if not 0 <= ids[-1] < layout.num_blocks:
            raise InvalidRequest(f"{side} group {g}: state block id {ids[-1]} outside [0, {layout.num_blocks})")
        slots.append(ids[-1])
    if req.num_cached_tokens >= req.num_tokens:
        return None
    one, zero = np.ones(1, np.int64), np.zeros(1, np.int64)
    return _Segments(one, np.array([slots[0]], np.int64), zero, np.array([slots[1]], np.int64), zero)


def _validate_and_segment(spec: ModelSpec, src: EngineLayout, dst: EngineLayout,
                          req: Request) -> list[_Segments | None]:
    n_groups = len(spec.groups)
    N, cached = req.num_tokens, req.num_cached_tokens
    if N < 0 or not 0 <= cached <= N:
        raise InvalidRequest(f"need 0 <= num_cached_tokens <= num_tokens, got {cached} and {N}")
    for side, ids in (("source", req.src_block_ids), ("destination", req.dst_block_ids)):
        if len(ids) != n_groups:
            raise InvalidRequest(f"{side} has block ids for {len(ids)} KV-cache groups, the model has {n_groups}")
    out: list[_Segments | None] = []
    for g in range(n_groups):
        if spec.group_layer(g).is_recurrent:
            out.append(_state_segment(g, src, dst, req))
            continue
        first = max(cached, spec.group_layer(g).tokens_kept(N))
        sides = []
        for side, layout, ids in (("source", src, req.src_block_ids[g]), ("destination", dst, req.dst_block_ids[g])):
            need = -(-N // layout.block_size)
            if len(ids) != need:
                raise InvalidRequest(
                    f"{side} group {g}: {N} tokens with block size {layout.block_size} need {need} block ids, "
                    f"got {len(ids)}")
            arr = np.asarray(ids, dtype=np.int64)
            used = arr[first // layout.block_size:] if first < N else arr[:0]
            bad = used[(used < 0) | (used >= layout.num_blocks)]
            if bad.size:
                raise InvalidRequest(
                    f"{side} group {g}: block id {int(bad[0])} outside [0, {layout.num_blocks})")
            if side == "destination" and len(np.unique(used)) != len(used):
                values, counts = np.unique(used, return_counts=True)
                raise InvalidRequest(
                    f"destination group {g}: block id {int(values[counts > 1][0])} appears twice among the "
                    f"blocks that receive tokens (two writes to one block)")
            sides.append(arr)
        if first >= N:
            out.append(None)
            continue
        ks, kd = src.kernel_size, dst.kernel_size
        starts = np.union1d(np.arange(-(-first // ks) * ks, N, ks), np.arange(-(-first // kd) * kd, N, kd))
        starts = np.union1d(starts, [first]).astype(np.int64)
        n = np.diff(np.append(starts, N))
        sb, sp = src.kernel_slots(sides[0], starts)
        db, dp = dst.kernel_slots(sides[1], starts)
        # Boxes are independent; visiting them in destination order makes every piece's runs
        # ascend, so the final sort by destination address only merges presorted sequences.
        order = np.argsort(db * dst.kernel_size + dp, kind="stable")
        out.append(_Segments(n[order], sb[order], sp[order], db[order], dp[order]))
    return out


_PIECE_COLUMNS = ("src_rank", "src_region", "src_base", "src_block_stride", "src_token_stride", "src_head_stride",
                  "dst_region", "dst_base", "dst_block_stride", "dst_token_stride", "dst_head_stride", "heads",
                  "row_bytes")


@lru_cache(maxsize=1024)
def _pieces(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int) -> tuple[np.ndarray, ...]:
    """Per group, one row per (layer, component, head slice) with its strides on both sides.

    Independent of the request, so computed once per engine pair and destination rank.
    """
    da = dst.addressing(spec, d)
    src_addr = [src.addressing(spec, s) for s in range(src.tp_size)]
    out = []
    for layers in spec.groups:
        rows: list[tuple[int, ...]] = []
        for li in layers:
            layer = spec.layers[li]
            for ci, comp in enumerate(layer.components):
                for s, h0, h1 in assign_sources(comp.heads, src.tp_size, dst.tp_size, d, layer.replicated):
                    sa = src_addr[s]
                    rows.append((
                        s, sa.region[li, ci], sa.base[li, ci] + (h0 - sa.first_head[li, ci]) * sa.head_stride[li, ci],
                        sa.block_stride[li, ci], sa.token_stride[li, ci], sa.head_stride[li, ci],
                        da.region[li, ci], da.base[li, ci] + (h0 - da.first_head[li, ci]) * da.head_stride[li, ci],
                        da.block_stride[li, ci], da.token_stride[li, ci], da.head_stride[li, ci],
                        h1 - h0, da.row_bytes[li, ci]))
        table = np.array(rows, dtype=np.int64).reshape(-1, len(_PIECE_COLUMNS))
        table.setflags(write=False)
        out.append(table)
    return tuple(out)


def _plan_rank(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int,
               segments: list[_Segments | None]) -> dict[str, np.ndarray]:
    pieces = _pieces(spec, src, dst, d)
    cells = [_expand(pieces[g], seg) for g, seg in enumerate(segments) if seg is not None and len(pieces[g])]
    runs = _coalesce(_concat(cells, _RUN_FIELDS[1:]))
    runs["dst_rank"] = np.full(len(runs["length"]), d, dtype=np.int64)
    return runs


def _expand(p: np.ndarray, seg: _Segments) -> dict[str, np.ndarray]:
    """Runs of every piece x segment box, vectorized over the (piece, segment) grid.

    A box is `n` tokens x `m` heads of `R`-byte rows. If rows of all its heads are adjacent on
    both sides (NHD-like, or a single head) the heads form one span per token, and the tokens
    fuse too when the token stride equals that span. If each head's tokens are adjacent on both
    sides (HND-like) the tokens form one span per head, and the heads fuse when the head stride
    equals that span (a whole kernel block). Otherwise every row is its own run.
    """
    (s_rank, s_reg, s_base, s_bs, s_ts, s_hs, d_reg, d_base, d_bs, d_ts, d_hs, m, R) = (
        p[:, i][:, None] for i in range(p.shape[1]))
    n = seg.n[None, :]
    s_start = s_base + seg.src_block[None, :] * s_bs + seg.src_pos[None, :] * s_ts
    d_start = d_base + seg.dst_block[None, :] * d_bs + seg.dst_pos[None, :] * d_ts
    heads_inner = (m == 1) | ((s_hs == R) & (d_hs == R))
    tokens_inner = ~heads_inner & (s_ts == R) & (d_ts == R)
    whole = ((heads_inner & (s_ts == m * R) & (d_ts == m * R)) | (heads_inner & (n == 1))
             | (tokens_inner & (s_hs == n * R) & (d_hs == n * R)))
    shape = s_start.shape
    if whole.all():  # fast path: one run per box
        # Full-shape arrays reshape to writable views; broadcasts reshape to (writable) copies.
        flat = lambda a: a.reshape(-1) if a.shape == shape else np.broadcast_to(a, shape).reshape(-1)  # noqa: E731
        return {"src_rank": flat(s_rank), "src_region": flat(s_reg), "src_offset": s_start.reshape(-1),
                "dst_region": flat(d_reg), "dst_offset": d_start.reshape(-1), "length": flat(n * m * R)}
    mixed = ~heads_inner & ~tokens_inner
    flat = lambda a: np.broadcast_to(a, shape).reshape(-1)  # noqa: E731
    c1 = flat(np.where(whole, 1, np.where(tokens_inner, m, n)))
    c2 = flat(np.where(mixed & ~whole, m, 1))
    st1_s = flat(np.where(tokens_inner, s_hs, s_ts))
    st1_d = flat(np.where(tokens_inner, d_hs, d_ts))
    length = flat(np.where(whole, n * m * R, np.where(heads_inner, m * R, np.where(tokens_inner, n * R, R))))
    count = c1 * c2
    cell = np.repeat(np.arange(count.size), count)
    j = np.arange(cell.size) - np.repeat(np.cumsum(count) - count, count)
    c2r = c2[cell]
    i1, i2 = j // c2r, j % c2r
    return {
        "src_rank": flat(s_rank)[cell],
        "src_region": flat(s_reg)[cell],
        "src_offset": s_start.reshape(-1)[cell] + i1 * st1_s[cell] + i2 * flat(s_hs)[cell],
        "dst_region": flat(d_reg)[cell],
        "dst_offset": d_start.reshape(-1)[cell] + i1 * st1_d[cell] + i2 * flat(d_hs)[cell],
        "length": length[cell],
    }


def _coalesce(r: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Sort by destination address and merge runs that touch on both sides."""
    if len(r["length"]) < 2:
        return r
    key = r["dst_region"] * (1 << 44) + r["dst_offset"]
    if np.any(key[1:] < key[:-1]):
        order = np.argsort(key, kind="stable")
        r = {k: v[order] for k, v in r.items()}
    touches = ((r["dst_region"][1:] == r["dst_region"][:-1])
               & (r["dst_offset"][1:] == r["dst_offset"][:-1] + r["length"][:-1])
               & (r["src_rank"][1:] == r["src_rank"][:-1])
               & (r["src_region"][1:] == r["src_region"][:-1])
               & (r["src_offset"][1:] == r["src_offset"][:-1] + r["length"][:-1]))
    if not touches.any():
        return r
    heads = np.flatnonzero(np.concatenate(([True], ~touches)))
    out = {k: v[heads] for k, v in r.items() if k != "length"}
    out["length"] = np.add.reduceat(r["length"], heads)
    return out


def _stats(plan: Plan, seconds: float) -> PlanStats:
    n = len(plan.length)
    total = int(plan.length.sum()) if n else 0
    pair_bytes: dict[str, int] = {}
    if n:
        key = plan.src_rank * plan.dst.tp_size + plan.dst_rank
        sums = np.bincount(key, weights=plan.length, minlength=plan.src.tp_size * plan.dst.tp_size)
        for k in np.flatnonzero(sums):
            pair_bytes[f"{k // plan.dst.tp_size}->{k % plan.dst.tp_size}"] = int(sums[k])
    mean = total / n if n else 0.0
    warnings = []
    if n and mean < TINY_RUN_BYTES:
        warnings.append(
            f"runs average {mean:.0f} B (below {TINY_RUN_BYTES} B): source {plan.src.describe()} and "
            f"destination {plan.dst.describe()} share little contiguity; expect slow transfers")
    return PlanStats(n, total, mean, int(plan.length.min()) if n else 0, int(plan.length.max()) if n else 0,
                     pair_bytes, seconds, warnings)


__all__ = ["Plan", "PlanStats", "Request", "plan_request", "TINY_RUN_BYTES"]
