"""The planner: which bytes of which source rank land where on each destination rank.

For one request it intersects every destination rank's shard with the source ranks' shards,
walks both layouts' `Addressing` over the tokens to move and emits runs
`(src_rank, src_region, src_offset, dst_region, dst_offset, length)` as numpy arrays.

A rank's shard is heads (TP), layers (PP stage) and tokens (CP rank); each axis has one rule in
`shard`, and the planner only intersects them: a destination rank takes the layers of its stage
(each read from the source stage that holds it), the tokens of its CP rank (each read from the
source CP rank that holds it), and its heads (`shard.assign_sources`, among the source TP
ranks of that CP rank).

It is pure (no I/O, no torch) and vectorized: tokens are cut into *segments* that stay inside
one kernel block and one CP rank on both sides; each (layer, component, head slice) x segment is
a box of tokens x heads x rows whose strides on both sides decide how many runs it needs (one
when the box is contiguous on both sides). Runs that touch on both sides are then merged. Any
TP/PP/CP pair whose sharding is legal on each side, any block sizes (per group), NHD or HND on
either side work the same way, with no special case.

KV dtype. When a component's element type or scale differs between the sides, its runs carry a
conversion id (`convert`, an index into `Plan.conversions`; -1 = a byte copy) and `src_length`
differs from `length` (destination bytes). Such runs never span heads whose scales differ. The
executor converts element by element on its copy path; a transport that only moves bytes must
refuse a plan with `needs_conversion`.

Speed. Everything that depends only on the engine pair (per destination rank and group: the
runs one whole destination block receives, up to its ids) is a cached template
(`plan_template`); a request then only adds its block ids, vectorized, and merges across
blocks where consecutive ids allow it. The token-by-token pipeline below stays as the reference
(`templates=False`, tested equal) and plans what templates do not cover (several groups, a
recurrent state, a layout outside the template's form).

Length: about 600 lines; the planner is one pipeline (validate, segment, pieces, expand,
coalesce) kept in one file so its vectorized steps read in order (the template is its own module).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import cached_property, lru_cache
from typing import NamedTuple

import msgspec
import numpy as np

from kvbridge.errors import InvalidRequest
from kvbridge.core.layout import Addressing, EngineLayout
from kvbridge.core.shard import assign_sources
from kvbridge.core.spec import ModelSpec

TINY_RUN_BYTES = 2048
"""Mean run length below which a plan warns that copies will be slow."""

_RUN_FIELDS = ("dst_rank", "src_rank", "src_region", "src_offset", "dst_region", "dst_offset", "length")
_EXTRA_FIELDS = ("src_length", "convert")


class Conversion(NamedTuple):
    """Element conversion of a run: `dst = cast((src * src_scale) / dst_scale)` (fp8 saturates)."""

    src_dtype: str
    dst_dtype: str
    src_scale: float
    dst_scale: float


class Request(msgspec.Struct, frozen=True):
    """One request's blocks: logical block ids per KV-cache group on each side.

    Each id list covers tokens `[0, num_tokens)`: one id per `block size x CP size` tokens of that
    side and group (with context parallel one id names the same block on every CP rank, vLLM's
    virtual block), or, with pages smaller than the CP interleave, as many ids as the CP rank
    holding the most tokens fills (`EngineLayout.block_ids_needed`). The destination already
    holds the first `num_cached_tokens` tokens (prefix cache), which are not moved. Entries of blocks that hold no token to move (before a sliding
    window, or cached) are never read and may be any value (vLLM puts its null block there);
    a list may also stop short of them: vLLM sends sliding-window lists clipped to the window, so
    a list with fewer ids than the tokens need is read as its *last* ids (the first ones dropped).
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
    """Runs for every destination rank of one request, sorted by destination rank.

    `length` is the bytes each run writes; `src_length` the bytes it reads (equal unless the run
    converts, `convert >= 0`).
    """

    def __init__(self, spec: ModelSpec, src: EngineLayout, dst: EngineLayout, runs: dict[str, np.ndarray],
                 plan_seconds: float = 0.0, conversions: tuple[Conversion, ...] = ()):
        self.spec, self.src, self.dst = spec, src, dst
        for name in _RUN_FIELDS:
            setattr(self, name, runs[name])
        self.src_length = runs.get("src_length", self.length)
        self.convert = runs.get("convert", np.broadcast_to(np.int64(-1), self.length.shape))
        self.plan_seconds, self.conversions = plan_seconds, conversions

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
    src_length: np.ndarray
    convert: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @property
    def needs_conversion(self) -> bool:
        """Whether some run converts elements (a byte-copying transport cannot execute it)."""
        return bool(self.conversions) and bool((self.convert >= 0).any())

    def runs(self, conversion: bool = False) -> dict[str, np.ndarray]:
        """The run arrays; with `conversion` also `src_length` and `convert` (a plan built from
        runs without them copies bytes: `src_length = length`)."""
        return {name: getattr(self, name) for name in _RUN_FIELDS + (_EXTRA_FIELDS if conversion else ())}

    def select(self, mask: np.ndarray) -> Plan:
        """The runs where `mask` holds (e.g. one rank pair), as a plan of its own."""
        return Plan(self.spec, self.src, self.dst, {n: a[mask] for n, a in self.runs(True).items()},
                    self.plan_seconds, self.conversions)


def plan_request(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, request: Request,
                 dst_ranks: Sequence[int] | None = None, *, templates: bool = True) -> Plan:
    """Plan the copies of one request from every source rank to `dst_ranks` (default: all).

    `templates=False` plans every token the straightforward way (no cached per-pair template):
    the reference the template path is tested against; both give the same plan.
    """
    t0 = time.perf_counter()
    _check_models(spec, src, dst)
    groups = _validate(spec, src.row_layout(spec), dst.row_layout(spec), request)
    ranks = range(dst.world_size) if dst_ranks is None else dst_ranks
    for d in ranks:
        if not 0 <= d < dst.world_size:
            raise InvalidRequest(f"destination rank {d} outside {dst.describe_ranks()}")
    conversions = _conversions(spec, src, dst)[0]
    runs = None
    if templates and len(groups) == 1 and isinstance(groups[0], _GroupIds):  # the common case: one buffer
        from kvbridge.core.plan_template import template_runs
        ids = groups[0]
        runs = template_runs(spec, src, dst, 0, ids.src, ids.dst, ids.first, ids.stop, ranks,
                               bool(conversions))
    if runs is None:
        runs = _concat([_plan_rank(spec, src, dst, d, groups, request.num_tokens, templates) for d in ranks],
                       _RUN_FIELDS + (_EXTRA_FIELDS if conversions else ()))
    return Plan(spec, src, dst, runs, time.perf_counter() - t0, conversions)


@lru_cache(maxsize=256)
def _check_models(spec: ModelSpec, src: EngineLayout, dst: EngineLayout) -> None:
    """Both engines can hold the model (checked once per pair: only a pass is cached)."""
    src.check_model(spec, "source engine")
    dst.check_model(spec, "destination engine")


def _concat(parts: list[dict[str, np.ndarray]], fields: Sequence[str]) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    return {n: np.concatenate([p[n] for p in parts]) if parts else np.zeros(0, np.int64) for n in fields}


class _Segments(msgspec.Struct):
    """Token segments of one group: each lies inside one kernel block and CP rank on both sides.

    `state`: a recurrent group's one slot, held whole by every CP rank.
    """

    n: np.ndarray
    src_block: np.ndarray
    src_pos: np.ndarray
    dst_block: np.ndarray
    dst_pos: np.ndarray
    src_cp: np.ndarray
    dst_cp: np.ndarray
    state: bool = False

    def take(self, mask: np.ndarray) -> _Segments:
        return _Segments(*(a[mask] for a in (self.n, self.src_block, self.src_pos, self.dst_block, self.dst_pos,
                                             self.src_cp, self.dst_cp)), self.state)


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
    return _Segments(one, np.array([slots[0]], np.int64), zero, np.array([slots[1]], np.int64), zero, zero, zero,
                     state=True)


def full_block_ids(layout: EngineLayout, group: int, ids: Sequence[int], num_tokens: int) -> np.ndarray:
    """An id list over `[0, num_tokens)`, a clipped one padded in front with -1 (never read)."""
    need = layout.block_ids_needed(group, num_tokens)
    return np.concatenate([np.full(max(0, need - len(ids)), -1, dtype=np.int64), np.asarray(ids, dtype=np.int64)])


def _block_ids(side: str, g: int, layout: EngineLayout, ids: Sequence[int], num_tokens: int,
               first: int, rate: int = 1) -> np.ndarray:
    """A side's id list over `[0, num_tokens)`: full, or clipped to the blocks from `first` on.

    A clipped list (vLLM clips sliding-window lists to the window) is padded in front with -1,
    which only the never-read blocks before `first` get. For a group keeping one row per `rate`
    tokens, positions are rows and `layout` its row layout; a refusal still speaks in tokens.
    """
    need = layout.block_ids_needed(g, num_tokens)
    lo = layout.block_span(g, first, num_tokens)[0] if first < num_tokens else need
    arr = np.asarray(ids, dtype=np.int64)
    if len(arr) == need:
        return arr
    fewest = need - lo
    if fewest <= len(arr) < need:
        return full_block_ids(layout, g, arr, num_tokens)
    window = "" if fewest == need else f" (or at least the last {fewest}, clipped to the tokens kept)"
    held = (f"{num_tokens} tokens" if rate == 1 else
            f"{num_tokens} complete rows of {rate} tokens")
    raise InvalidRequest(
        f"{side} group {g}: {held} with block size {layout.group_block_size(g) * rate}"
        f"{f' x CP {layout.cp_size}' if layout.cp_size > 1 else ''}"
        f"{'' if layout.whole_chunks(g) else f' (interleave {layout.cp_interleave})'} need {need} block ids{window}, "
        f"got {len(arr)}")


class _GroupIds(NamedTuple):
    """A group's validated id lists over `[0, num_tokens)` and the positions `[first, stop)` it
    moves (rows, for a layer keeping one row per several tokens)."""

    src: np.ndarray
    dst: np.ndarray
    first: int
    stop: int


def _validate(spec: ModelSpec, src: EngineLayout, dst: EngineLayout,
              req: Request) -> list[_GroupIds | _Segments | None]:
    """Per group: its ids (attention), its state segment (recurrent), or None (nothing to move).

    `src` and `dst` are the row layouts (`EngineLayout.row_layout`): a group keeping one row per
    r tokens moves rows `[cached // r, N // r)`, and its id lists, one id per block of tokens, may
    name the blocks of the open window too (never read)."""
    n_groups = len(spec.groups)
    N, cached = req.num_tokens, req.num_cached_tokens
    if N < 0 or not 0 <= cached <= N:
        raise InvalidRequest(f"need 0 <= num_cached_tokens <= num_tokens, got {cached} and {N}")
    for side, ids in (("source", req.src_block_ids), ("destination", req.dst_block_ids)):
        if len(ids) != n_groups:
            raise InvalidRequest(f"{side} has block ids for {len(ids)} KV-cache groups, the model has {n_groups}")
    out: list[_GroupIds | _Segments | None] = []
    for g in range(n_groups):
        if spec.group_layer(g).is_recurrent:
            out.append(_state_segment(g, src, dst, req))
            continue
        layer = spec.group_layer(g)
        rows, rate = layer.rows(N), layer.tokens_per_row
        first = layer.moved_positions(N, cached).start
        sides = []
        for side, layout, ids in (("source", src, req.src_block_ids[g]), ("destination", dst, req.dst_block_ids[g])):
            if rate > 1 and len(ids) == layout.block_ids_needed(g, -(-N // rate)):
                ids = ids[:layout.block_ids_needed(g, rows)]  # one id per block of tokens: the open window's too
            arr = _block_ids(side, g, layout, ids, rows, first, rate)
            used = arr[layout.block_span(g, first, rows)[0]:] if first < rows else arr[:0]
            if used.size and (used.min() < 0 or used.max() >= layout.num_blocks):
                bad = used[(used < 0) | (used >= layout.num_blocks)]
                raise InvalidRequest(
                    f"{side} group {g}: block id {int(bad[0])} outside [0, {layout.num_blocks})")
            if side == "destination" and used.size > 1:
                ordered = np.sort(used)
                twice = ordered[1:][ordered[1:] == ordered[:-1]]
                if twice.size:
                    raise InvalidRequest(
                        f"destination group {g}: block id {int(twice[0])} appears twice among the "
                        f"blocks that receive tokens (two writes to one block)")
            sides.append(arr)
        out.append(_GroupIds(sides[0], sides[1], first, rows) if first < rows else None)
    return out


def _segments(g: int, src: EngineLayout, dst: EngineLayout, src_ids: np.ndarray, dst_ids: np.ndarray,
              first: int, N: int) -> _Segments:
    """Cut tokens `[first, N)` where either side changes kernel block or CP rank, or jumps."""
    pos = np.arange(first, N, dtype=np.int64)
    slots = []
    for layout, ids in ((src, src_ids), (dst, dst_ids)):
        kb, off = layout.kernel_slots(ids, pos, g)
        slots.append((kb, off, layout.token_owner(pos, g)))
    (sb, sp, sc), (db, dp, dc) = slots
    cut = np.ones(len(pos), dtype=bool)
    cut[1:] = ((sb[1:] != sb[:-1]) | (sp[1:] != sp[:-1] + 1) | (sc[1:] != sc[:-1])
               | (db[1:] != db[:-1]) | (dp[1:] != dp[:-1] + 1) | (dc[1:] != dc[:-1]))
    starts = np.flatnonzero(cut)
    n = np.diff(np.append(starts, len(pos)))
    # Boxes are independent; visiting them in destination order makes every piece's runs
    # ascend, so the final sort by destination address only merges presorted sequences.
    order = np.argsort(db[starts] * dst.group_kernel_size(g) + dp[starts], kind="stable")
    i = starts[order]
    return _Segments(n[order], sb[i], sp[i], db[i], dp[i], sc[i], dc[i])


_PIECE_COLUMNS = ("src_rank", "src_region", "src_base", "src_block_stride", "src_token_stride", "src_head_stride",
                  "dst_region", "dst_base", "dst_block_stride", "dst_token_stride", "dst_head_stride", "heads",
                  "row_bytes", "src_row_bytes", "convert")


class SourceSlice(NamedTuple):
    """Units `[start, stop)` of one component of one layer that a destination rank reads from `src_rank`."""

    layer: int
    comp: int
    src_rank: int
    start: int
    stop: int


def source_slices(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int,
                  src_cp: int) -> tuple[SourceSlice, ...]:
    """What destination rank `d` reads, for the tokens held by source CP rank `src_cp`.

    Layers: those of `d`'s PP stage, each from the source stage holding it. Heads:
    `shard.assign_sources` among the source TP ranks of CP rank `src_cp` (recurrent state is
    not split by tokens: any DCP rank serves it). Per-head scales that differ split a slice per head.
    """
    dc = dst.rank_coords(d)
    pcp, dcp = divmod(src_cp, src.dcp_size)
    start, stop = dst.stage_layers(spec.num_layers, dc.pp)
    stage = src.layer_stage(spec.num_layers)
    _, convert_of = _conversions(spec, src, dst)
    out = []
    for li in range(start, stop):
        layer = spec.layers[li]
        for ci, comp in enumerate(layer.components):
            by_token = (src.dcp_size, dcp) if not layer.is_recurrent else (1, 0)
            per_head = (li, ci) in convert_of and len(convert_of[li, ci]) > 1
            for q, h0, h1 in assign_sources(comp.heads, src.tp_size, dst.tp_size, dc.tp, layer.replicated, by_token):
                rank = src.flat_rank(q, int(stage[li]), pcp)
                if per_head:
                    out += [SourceSlice(li, ci, rank, h, h + 1) for h in range(h0, h1)]
                else:
                    out.append(SourceSlice(li, ci, rank, h0, h1))
    return tuple(out)


def pair_conversions(spec: ModelSpec, src: EngineLayout, dst: EngineLayout) -> tuple[Conversion, ...]:
    """The element conversions a transfer from `src` to `dst` needs (empty: bytes move as they are)."""
    return _conversions(spec, src, dst)[0]


@lru_cache(maxsize=256)
def _conversions(spec: ModelSpec, src: EngineLayout,
                 dst: EngineLayout) -> tuple[tuple[Conversion, ...], dict[tuple[int, int], tuple[int, ...]]]:
    """Distinct conversions, and per (layer, component) the conversion id of each head (one id
    when every head converts alike). Components whose type and scales match are absent."""
    s_spec, d_spec = src.engine_spec(spec), dst.engine_spec(spec)
    table: dict[Conversion, int] = {}
    of: dict[tuple[int, int], tuple[int, ...]] = {}
    for li, (s_layer, d_layer) in enumerate(zip(s_spec.layers, d_spec.layers)):
        for ci, (sc, dc) in enumerate(zip(s_layer.components, d_layer.components)):
            sd, dd = s_spec.component_dtype(sc), d_spec.component_dtype(dc)
            ss, ds = src.scales(li, ci), dst.scales(li, ci)
            if sd == dd and ss == ds:
                continue
            pairs = [(ss[0], ds[0])] if len(ss) == len(ds) == 1 else [
                (ss[h % len(ss)], ds[h % len(ds)]) for h in range(sc.heads)]
            of[li, ci] = tuple(table.setdefault(Conversion(sd, dd, a, b), len(table)) for a, b in pairs)
    return tuple(table), of


@lru_cache(maxsize=1024)
def _pieces(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int, src_cp: int) -> tuple[np.ndarray, ...]:
    """Per group, one row per (layer, component, head slice) with its strides on both sides.

    Independent of the request, so computed once per engine pair, destination rank and source CP rank.
    """
    da = dst.addressing(spec, d)
    src_addr: dict[int, Addressing] = {}
    _, convert_of = _conversions(spec, src, dst)
    rows: list[list[tuple[int, ...]]] = [[] for _ in spec.groups]
    for li, ci, s, h0, h1 in source_slices(spec, src, dst, d, src_cp):
        sa = src_addr.get(s) or src_addr.setdefault(s, src.addressing(spec, s))
        ids = convert_of.get((li, ci), (-1,))
        rows[spec.layer_group[li]].append((
            s, sa.region[li, ci], sa.base[li, ci] + (h0 - sa.first_head[li, ci]) * sa.head_stride[li, ci],
            sa.block_stride[li, ci], sa.token_stride[li, ci], sa.head_stride[li, ci],
            da.region[li, ci], da.base[li, ci] + (h0 - da.first_head[li, ci]) * da.head_stride[li, ci],
            da.block_stride[li, ci], da.token_stride[li, ci], da.head_stride[li, ci],
            h1 - h0, da.row_bytes[li, ci], sa.row_bytes[li, ci], ids[h0 % len(ids)]))
    out = []
    for group_rows in rows:
        table = np.array(group_rows, dtype=np.int64).reshape(-1, len(_PIECE_COLUMNS))
        table.setflags(write=False)
        out.append(table)
    return tuple(out)


def _plan_rank(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int,
               groups: list[_GroupIds | _Segments | None], N: int, templates: bool) -> dict[str, np.ndarray]:
    """Runs of destination rank `d`: each group from its template if it has one (and
    `templates`), else token by token (the reference the templates are tested against); merged."""
    from kvbridge.core.plan_template import rank_runs
    converting = bool(_conversions(spec, src, dst)[0])
    fields = _RUN_FIELDS[1:] + (_EXTRA_FIELDS if converting else ())
    cells: list[dict[str, np.ndarray]] = []
    for g, item in enumerate(groups):
        if isinstance(item, _GroupIds):
            fast = (rank_runs(spec, src, dst, d, g, item.src, item.dst, item.first, item.stop, converting)
                    if templates else None)
            if fast is not None:
                cells.append(fast)
                continue
            item = _segments(g, src.row_layout(spec), dst.row_layout(spec), item.src, item.dst, item.first, item.stop)
        if item is not None:
            cells += _cells(spec, src, dst, d, g, item, converting)
    runs = _coalesce(_concat(cells, fields)) if cells else {n: np.zeros(0, np.int64) for n in fields}
    runs["dst_rank"] = np.full(len(runs["length"]), d, dtype=np.int64)
    return runs


def _cells(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int, g: int, seg: _Segments,
           converting: bool) -> list[dict[str, np.ndarray]]:
    """Uncoalesced runs of one group's segments for destination rank `d`, per source CP rank."""
    if seg.state:  # every CP rank holds the whole state; spread readers over the source CP ranks
        parts = [(dst.rank_coords(d).cp % src.cp_size, seg)]
    else:
        mine = seg.take(seg.dst_cp == dst.rank_coords(d).cp)
        parts = [(int(c), mine.take(mine.src_cp == c)) for c in np.unique(mine.src_cp)]
    cells = []
    for c, part in parts:
        pieces = _pieces(spec, src, dst, d, c)[g]
        if len(pieces) and len(part.n):
            cells.append(_expand(pieces, part, converting)[0])
    return cells


def _expand(p: np.ndarray, seg: _Segments, converting: bool) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Runs of every piece x segment box, vectorized over the (piece, segment) grid, and the grid
    cell (`piece * len(seg.n) + segment`) of each run (None: one run per cell, in cell order).

    A box is `n` tokens x `m` heads of rows (`R` bytes on the destination, `Rs` on the source).
    If rows of all its heads are adjacent on both sides (NHD-like, or a single head) the heads
    form one span per token, and the tokens fuse too when the token stride equals that span. If
    each head's tokens are adjacent on both sides (HND-like) the tokens form one span per head,
    and the heads fuse when the head stride equals that span (a whole kernel block). Otherwise
    every row is its own run. `converting`: also return `src_length` and `convert` (only pairs
    with a conversion pay for them).
    """
    (s_rank, s_reg, s_base, s_bs, s_ts, s_hs, d_reg, d_base, d_bs, d_ts, d_hs, m, R, Rs, conv) = (
        p[:, i][:, None] for i in range(p.shape[1]))
    n = seg.n[None, :]
    s_start = s_base + seg.src_block[None, :] * s_bs + seg.src_pos[None, :] * s_ts
    d_start = d_base + seg.dst_block[None, :] * d_bs + seg.dst_pos[None, :] * d_ts
    heads_inner = (m == 1) | ((s_hs == Rs) & (d_hs == R))
    tokens_inner = ~heads_inner & (s_ts == Rs) & (d_ts == R)
    whole = ((heads_inner & (s_ts == m * Rs) & (d_ts == m * R)) | (heads_inner & (n == 1))
             | (tokens_inner & (s_hs == n * Rs) & (d_hs == n * R)))
    shape = s_start.shape
    if whole.all():  # fast path: one run per box
        # Full-shape arrays reshape to writable views; broadcasts reshape to (writable) copies.
        flat = lambda a: a.reshape(-1) if a.shape == shape else np.broadcast_to(a, shape).reshape(-1)  # noqa: E731
        out = {"src_rank": flat(s_rank), "src_region": flat(s_reg), "src_offset": s_start.reshape(-1),
               "dst_region": flat(d_reg), "dst_offset": d_start.reshape(-1), "length": flat(n * m * R)}
        if converting:
            out |= {"src_length": flat(n * m * Rs), "convert": flat(conv)}
        return out, None
    mixed = ~heads_inner & ~tokens_inner
    flat = lambda a: np.broadcast_to(a, shape).reshape(-1)  # noqa: E731
    c1 = flat(np.where(whole, 1, np.where(tokens_inner, m, n)))
    c2 = flat(np.where(mixed & ~whole, m, 1))
    st1_s = flat(np.where(tokens_inner, s_hs, s_ts))
    st1_d = flat(np.where(tokens_inner, d_hs, d_ts))
    rows = flat(np.where(whole, n * m, np.where(heads_inner, m, np.where(tokens_inner, n, 1))))
    count = c1 * c2
    cell = np.repeat(np.arange(count.size), count)
    j = np.arange(cell.size) - np.repeat(np.cumsum(count) - count, count)
    c2r = c2[cell]
    i1, i2 = j // c2r, j % c2r
    out = {
        "src_rank": flat(s_rank)[cell],
        "src_region": flat(s_reg)[cell],
        "src_offset": s_start.reshape(-1)[cell] + i1 * st1_s[cell] + i2 * flat(s_hs)[cell],
        "dst_region": flat(d_reg)[cell],
        "dst_offset": d_start.reshape(-1)[cell] + i1 * st1_d[cell] + i2 * flat(d_hs)[cell],
        "length": (rows * flat(R))[cell],
    }
    if converting:
        out |= {"src_length": (rows * flat(Rs))[cell], "convert": flat(conv)[cell]}
    return out, cell


def _coalesce(r: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Sort by destination address and merge runs that touch on both sides (and convert alike)."""
    if len(r["length"]) < 2:
        return r
    key = r["dst_region"] * (1 << 44) + r["dst_offset"]
    if np.any(key[1:] < key[:-1]):
        order = np.argsort(key, kind="stable")
        r = {k: v[order] for k, v in r.items()}
    src_length = r.get("src_length", r["length"])
    touches = ((r["dst_region"][1:] == r["dst_region"][:-1])
               & (r["dst_offset"][1:] == r["dst_offset"][:-1] + r["length"][:-1])
               & (r["src_rank"][1:] == r["src_rank"][:-1])
               & (r["src_region"][1:] == r["src_region"][:-1])
               & (r["src_offset"][1:] == r["src_offset"][:-1] + src_length[:-1]))
    if "convert" in r:
        touches &= r["convert"][1:] == r["convert"][:-1]
    if not touches.any():
        return r
    heads = np.flatnonzero(np.concatenate(([True], ~touches)))
    out = {k: v[heads] for k, v in r.items() if k not in ("length", "src_length")}
    for k in ("length", "src_length"):
        if k in r:
            out[k] = np.add.reduceat(r[k], heads)
    return out


def _stats(plan: Plan, seconds: float) -> PlanStats:
    n = len(plan.length)
    total = int(plan.length.sum()) if n else 0
    pair_bytes: dict[str, int] = {}
    if n:
        world = plan.dst.world_size
        key = plan.src_rank * world + plan.dst_rank
        sums = np.bincount(key, weights=plan.length, minlength=plan.src.world_size * world)
        for k in np.flatnonzero(sums):
            pair_bytes[f"{k // world}->{k % world}"] = int(sums[k])
    mean = total / n if n else 0.0
    warnings = []
    if n and mean < TINY_RUN_BYTES:
        warnings.append(
            f"runs average {mean:.0f} B (below {TINY_RUN_BYTES} B): source {plan.src.describe()} and "
            f"destination {plan.dst.describe()} share little contiguity; expect slow transfers")
    return PlanStats(n, total, mean, int(plan.length.min()) if n else 0, int(plan.length.max()) if n else 0,
                     pair_bytes, seconds, warnings)


__all__ = ["Conversion", "Plan", "full_block_ids", "pair_conversions", "PlanStats", "Request", "SourceSlice", "plan_request", "source_slices",
           "TINY_RUN_BYTES"]
