"""Plan templates: the part of planning that depends only on the engine pair, computed once.

Every whole destination block id of a group (a *unit*: the tokens one id covers over all CP
ranks) brings a destination rank the same runs in every request; only the block ids move them.
A run's address on either side is `const + block_id * block_bytes`, with `block_bytes` the
byte stride of one logical block in its region (kernel blocks of one logical block are adjacent).
So for each (engine pair, destination rank, group) the planner's own pipeline (`plan._segments`,
`_pieces`, `_expand`, `_coalesce`) runs once over one period of units (the least common multiple
of both sides' tokens per id) with every id zero, and keeps per run: `const`, which source id of
the unit it reads (`src_vb`, relative to the unit's first source id) and `block_bytes`. A
request then only adds its ids, vectorized over all whole units at once.

Partial units (a prefix hit or the request's end inside a block) have tables of their own, cached
per (slot, token range inside the unit), and are slotted in among the whole ones.

Order and merging. The plan must equal the token-by-token planner's: runs sorted by destination
address, every two runs that touch on both sides merged. A template is sorted into *stripes*
(destination region and `const // block_bytes`: K and V of a kv_first layer are two stripes)
with the same number of runs per unit, and each stripe visits the request's units in ascending
destination id, so the runs come out sorted while stripes of one region cannot interleave
(checked: the ids' span against the stripes' gap). Touching is ruled out per request from
facts worked out once: which source id steps would continue a stripe into the next destination
id, at which id spans two stripes meet, and the runs on both sides of a partial unit. Whatever
is not ruled out goes through the planner's merge (`plan._coalesce`, which also sorts if
needed): a costlier plan, never a different one. A pair whose runs do not fit the template's
form (a region whose blocks have different strides, uneven stripes) has no template and is
planned token by token, and so is a side whose pages are smaller than its CP interleave (one
block id then names tokens of one CP rank only, not a unit of consecutive tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec

MAX_SLOTS = 64
"""Units per period beyond which a pair gets no template (block sizes with a huge lcm)."""

_COLUMNS = ("src_rank", "src_region", "src_offset", "src_vb", "src_ls", "dst_region", "dst_offset", "dst_ls",
            "length", "src_length", "convert")
_C = {name: i for i, name in enumerate(_COLUMNS)}
_OUT = ("src_rank", "src_region", "src_offset", "dst_region", "dst_offset", "length")
_EXTRA = ("src_length", "convert")


class _Layout(NamedTuple):
    """One request's units on one rank: whole units by ascending destination id, and the
    partial units' slabs `(position among them, unit, destination id, table[column, stripe, run])`."""

    units: np.ndarray
    dst_sorted: np.ndarray
    slabs: list[tuple[int, int, int, np.ndarray]]
    width: int  # runs per stripe
    inner_touch: bool  # adjacent runs of a partial unit may touch


class PlanTemplate(NamedTuple):
    """Runs of one whole unit per slot (`slot = unit % slots`), as `columns[column, slot, stripe, run]`."""

    unit: int  # destination tokens per block id
    src_unit: int  # source tokens per block id
    columns: np.ndarray
    src_ids_per_unit: int  # distinct `src_vb`
    stripe_gap: int  # least `const // block_bytes` step between stripes of one region (no such pair: huge)
    inner_touch: bool  # adjacent runs of a unit may touch (they read different source ids)
    steps: tuple[int, ...] | None  # source id steps that continue a stripe into the next destination id (None: unknown)
    stripe_keys: np.ndarray  # (stripe, [destination region, const // block_bytes])
    key: tuple  # (spec, src, dst, d, g): where partial units' tables are cached
    src_ls: int  # the one source block stride of every run (0: they differ)
    dst_ls: int  # the one destination block stride of every run (0: they differ)
    seams: frozenset[int] | None  # id spans for which a stripe's last run meets the next stripe's first (None: unknown)

    @property
    def slots(self) -> int:
        return self.columns.shape[1]

    def layout(self, dst_ids: np.ndarray, first: int, stop: int) -> _Layout | None:
        """Where tokens `[first, stop)` go: whole units in ascending destination id, the partial
        first and last unit slotted in; None without a whole unit, or when a partial unit's runs
        do not fill the stripes evenly."""
        whole = (-(-first // self.unit), stop // self.unit)
        if whole[0] >= whole[1]:
            return None
        ids = dst_ids[whole[0]:whole[1]]
        order = np.argsort(ids, kind="stable")
        dst_sorted = ids[order]
        slabs = []
        touchy = False
        for a, b in ((first, whole[0] * self.unit), (whole[1] * self.unit, stop)):
            if a < b:
                j = a // self.unit
                partial = _partial_table(*self.key, j % self.slots, a - j * self.unit, b - j * self.unit)
                if partial is None:
                    return None
                table, inner_touch = partial
                if table.shape[2]:
                    touchy |= inner_touch
                    slabs.append((int(np.searchsorted(dst_sorted, dst_ids[j])), j, int(dst_ids[j]), table))
        slabs.sort(key=lambda slab: (slab[0], slab[2]))  # two partial units between the same whole ones: by id
        width = len(ids) * self.columns.shape[3] + sum(slab[3].shape[2] for slab in slabs)
        return _Layout(order + whole[0], dst_sorted, slabs, width, touchy)

    def write(self, lay: _Layout, src_ids: np.ndarray, out: dict[str, np.ndarray]) -> bool:
        """Write the runs of `lay` into `out` (flat arrays of `stripes x width` runs); whether
        they are surely sorted by destination address with no two touching (else: merge them)."""
        S, c = self.columns.shape[2], self.columns.shape[3]
        rows = {k: v.reshape(S, lay.width) for k, v in out.items()}
        edges = []
        if all(slab[3].shape[2] % c == 0 for slab in lay.slabs):
            # Whole units in one pass, with stand-ins where the partial units go; then those.
            units, dst_sorted = lay.units, lay.dst_sorted
            for position, _, _, table in reversed(lay.slabs):
                k = table.shape[2] // c
                units = np.insert(units, position, np.full(k, units[0]))
                dst_sorted = np.insert(dst_sorted, position, np.full(k, dst_sorted[0]))
            self._write_whole(rows, 0, units, dst_sorted, src_ids)
            shift = 0
            for position, j, dst_id, table in lay.slabs:
                at = position * c + shift
                self._write_partial(rows, at, j, table, src_ids, dst_id)
                edges += [at, at + table.shape[2]]
                shift += table.shape[2]
        else:
            at = done = 0
            for position, j, dst_id, table in lay.slabs + [(len(lay.units), -1, -1, None)]:
                if position > done:
                    self._write_whole(rows, at, lay.units[done:position], lay.dst_sorted[done:position], src_ids)
                    at, done = at + (position - done) * c, position
                if table is not None:
                    self._write_partial(rows, at, j, table, src_ids, dst_id)
                    edges += [at, at + table.shape[2]]
                    at += table.shape[2]
        return self._settled(out, lay, src_ids, [e for e in edges if 0 < e < lay.width])

    def _write_whole(self, rows: dict[str, np.ndarray], at: int, units: np.ndarray, dst_sorted: np.ndarray,
                     src_ids: np.ndarray) -> None:
        """Runs of whole `units` (in ascending destination id) into columns `at...` of every stripe."""
        cols = self.columns
        S, c, B = cols.shape[2], cols.shape[3], len(units)
        # (stripe, unit, run) with the runs axis dropped when a stripe has one run per unit:
        # numpy's broadcasting is fastest along a long last axis.
        squeeze = c == 1
        if self.slots == 1:
            col = (lambda k: cols[_C[k], 0]) if squeeze else (lambda k: cols[_C[k], 0][:, None, :])  # noqa: E731
        else:
            slot = units % self.slots
            col = ((lambda k: cols[_C[k]][slot, :, 0].T) if squeeze  # noqa: E731
                   else (lambda k: cols[_C[k]][slot].transpose(1, 0, 2)))
        along = (lambda a: a[None, :]) if squeeze else (lambda a: a[None, :, None])  # noqa: E731
        first_src = units * self.unit // self.src_unit
        if self.src_ids_per_unit == 1:
            src_of = along(src_ids[first_src])
        else:
            # A unit in another slot may read fewer ids: clip the ones it never picks.
            table = src_ids[np.minimum(first_src[:, None] + np.arange(self.src_ids_per_unit), len(src_ids) - 1)]
            src_of = table[along(np.arange(B)), col("src_vb")]
        for k, row in rows.items():
            view = row[:, at:at + B * c]
            if not squeeze:
                view = view.reshape(S, B, c)  # splits the contiguous last axis: a view
            if k == "src_offset" and self.src_ls and self.src_ids_per_unit == 1:  # one pass: const + id * stride
                np.add(col("src_offset"), src_of * self.src_ls, out=view)
            elif k == "src_offset":
                np.multiply(src_of, col("src_ls"), out=view)
                view += col("src_offset")
            elif k == "dst_offset" and self.dst_ls:
                np.add(col("dst_offset"), along(dst_sorted * self.dst_ls), out=view)
            elif k == "dst_offset":
                np.multiply(along(dst_sorted), col("dst_ls"), out=view)
                view += col("dst_offset")
            else:
                view[...] = col(k)

    def _write_partial(self, rows: dict[str, np.ndarray], at: int, j: int, table: np.ndarray, src_ids: np.ndarray,
                       dst_id: int) -> None:
        """Runs of partial unit `j` (`table[column, stripe, run]`) into columns `at...`."""
        first_src = j * self.unit // self.src_unit
        for k, row in rows.items():
            view = row[:, at:at + table.shape[2]]
            if k == "src_offset":
                view[...] = table[_C["src_offset"]] + src_ids[first_src + table[_C["src_vb"]]] * table[_C["src_ls"]]
            elif k == "dst_offset":
                view[...] = table[_C["dst_offset"]] + dst_id * table[_C["dst_ls"]]
            else:
                view[...] = table[_C[k]]

    def _settled(self, out: dict[str, np.ndarray], lay: _Layout, src_ids: np.ndarray, edges: list[int]) -> bool:
        """Whether the runs are surely sorted with no two touching: stripes of one region keep
        apart, no stripe of a whole unit continues into the next id, and the runs on either side of
        a partial unit's slab or of a stripe's end do not touch."""
        if self.inner_touch or lay.inner_touch:
            return False
        ids = lay.dst_sorted
        extremes = [int(ids[0]), int(ids[-1])] + [slab[2] for slab in lay.slabs]
        span = max(extremes) - min(extremes)
        if span >= self.stripe_gap:
            return False
        if len(ids) > 1 and self.steps != ():
            follows = ids[1:] == ids[:-1] + 1
            if follows.any():
                if self.steps is None:
                    return False
                step = np.diff(src_ids[lay.units * self.unit // self.src_unit])[follows]
                if any((step == s).any() for s in self.steps):
                    return False
        S = self.columns.shape[2]
        # A stripe's end meets the next stripe of its region only if their steps differ by at most
        # span + 1 (runs stay inside their blocks), and, between whole units, only for the spans in
        # `seams`; other regions never meet.
        seam = span + 1 >= self.stripe_gap and (lay.slabs or self.seams is None or span in self.seams)
        if not edges and not seam:
            return True
        starts = (np.arange(S)[:, None] * lay.width + np.array(edges, dtype=np.int64)[None, :]).reshape(-1)
        if seam:
            starts = np.concatenate([starts, np.arange(1, S) * lay.width])
        return not np.any(_touching(out, starts - 1, starts))

def _touching(r: dict[str, np.ndarray], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether run `b` continues run `a` on both sides (`plan._coalesce`'s rule)."""
    src_length = r.get("src_length", r["length"])
    out = ((r["dst_region"][b] == r["dst_region"][a]) & (r["dst_offset"][b] == r["dst_offset"][a] + r["length"][a])
           & (r["src_rank"][b] == r["src_rank"][a]) & (r["src_region"][b] == r["src_region"][a])
           & (r["src_offset"][b] == r["src_offset"][a] + src_length[a]))
    if "convert" in r:
        out &= r["convert"][b] == r["convert"][a]
    return out


@lru_cache(maxsize=256)
def plan_template(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int, g: int) -> PlanTemplate | None:
    """The template of destination rank `d` and group `g`, or None (recurrent state, or runs
    that do not fit the template's form: planned token by token)."""
    if spec.group_layer(g).is_recurrent:
        return None
    if not (src.row_layout(spec).whole_chunks(g) and dst.row_layout(spec).whole_chunks(g)):
        return None  # pages smaller than the CP interleave: an id names no fixed run of consecutive tokens
    src_unit, unit = src.row_layout(spec).tokens_per_block_id(g), dst.row_layout(spec).tokens_per_block_id(g)
    slots = math.lcm(src_unit, unit) // unit
    if slots > MAX_SLOTS:
        return None
    tables = [_slot_runs(spec, src, dst, d, g, slot * unit, (slot + 1) * unit, slot * unit) for slot in range(slots)]
    if any(t is None for t in tables):
        return None
    stripes = [_stripes(t) for t in tables]  # type: ignore[arg-type]
    if any(s is None for s in stripes) or any(not np.array_equal(s[0], stripes[0][0]) for s in stripes):  # type: ignore[index]
        return None
    keys, count = stripes[0]  # type: ignore[misc]
    if any(s[1] != count for s in stripes):  # type: ignore[index]
        return None
    columns = np.stack([t.reshape(len(_COLUMNS), len(keys), count) for t in tables], axis=1)  # type: ignore[union-attr]
    columns.setflags(write=False)
    vbs = int(columns[_C["src_vb"]].max(initial=0)) + 1
    return PlanTemplate(unit, src_unit, columns, vbs, _stripe_gap(keys), _inner_touch(columns), _steps(columns, vbs), keys,
                        (spec, src, dst, d, g), _one(columns[_C["src_ls"]]), _one(columns[_C["dst_ls"]]),
                        _seams(columns, keys))


def _seams(columns: np.ndarray, keys: np.ndarray) -> frozenset[int] | None:
    """Spans `max id - min id` of a request's destination ids for which the last run of a
    stripe (in the unit of the largest id) ends where the next stripe of its region starts (in
    the unit of the smallest id); None with several slots (the units' runs differ)."""
    if columns.shape[1] > 1:
        return None
    offset, length, ls = (columns[_C[k], 0] for k in ("dst_offset", "length", "dst_ls"))
    out = set()
    for s in np.flatnonzero(keys[1:, 0] == keys[:-1, 0]):
        gap = int(offset[s + 1, 0] - offset[s, -1] - length[s, -1])  # = span * block bytes where they meet
        if gap % int(ls[s, 0]) == 0:
            out.add(gap // int(ls[s, 0]))
    return frozenset(out)


def _one(values: np.ndarray) -> int:
    return int(values.flat[0]) if values.size and np.all(values == values.flat[0]) else 0


@lru_cache(maxsize=512)  # per pair and rank at most 2 x slots x tokens per block (first, last partial unit)
def _partial_table(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int, g: int, slot: int, lo: int,
                   hi: int) -> tuple[np.ndarray, bool] | None:
    """Runs of tokens `[lo, hi)` of a unit in `slot` as `[column, stripe, run]` on the whole
    units' stripes and whether two adjacent ones may touch, or None when they do not fill those
    stripes evenly."""
    template = plan_template(spec, src, dst, d, g)
    unit = dst.row_layout(spec).tokens_per_block_id(g)
    table = _slot_runs(spec, src, dst, d, g, slot * unit + lo, slot * unit + hi, slot * unit)
    if template is None or table is None:
        return None
    if not table.shape[1]:
        return table.reshape(len(_COLUMNS), len(template.stripe_keys), 0), False
    stripes = _stripes(table)
    if stripes is None or not np.array_equal(stripes[0], template.stripe_keys):
        return None
    out = table.reshape(len(_COLUMNS), len(template.stripe_keys), stripes[1])
    out.setflags(write=False)
    return out, _inner_touch(out)


def _slot_runs(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int, g: int, start: int, stop: int,
               unit_start: int) -> np.ndarray | None:
    """Coalesced runs of tokens `[start, stop)` of the unit from `unit_start` on rank `d` with
    every block id zero, as `[column, run]` sorted by destination address; None if some
    region's blocks have different strides. (Tokens are rows for a group keeping one row per
    several tokens: its row layout gives the sizes.)"""
    from kvbridge.core import plan
    layouts = src, dst
    src, dst = src.row_layout(spec), dst.row_layout(spec)
    s_ratio = src.group_block_size(g) // src.group_kernel_size(g)
    d_ratio = dst.group_block_size(g) // dst.group_kernel_size(g)
    src_unit, unit = src.tokens_per_block_id(g), dst.tokens_per_block_id(g)
    src_first = unit_start // src_unit
    # Ids equal to their index: kernel block // ratio is then the id's index in the list.
    seg = plan._segments(g, src, dst, np.arange(-(-stop // src_unit), dtype=np.int64),
                         np.arange(unit_start // unit + 1, dtype=np.int64), start, stop)
    mine = seg.take(seg.dst_cp == dst.rank_coords(d).cp)
    cells = []
    for c in np.unique(mine.src_cp):
        part = mine.take(mine.src_cp == c)
        pieces = plan._pieces(spec, *layouts, d, int(c))[g]
        if not len(pieces):
            continue
        src_vb = part.src_block // s_ratio - src_first
        zero = plan._Segments(part.n, part.src_block % s_ratio, part.src_pos, part.dst_block % d_ratio, part.dst_pos,
                              part.src_cp, part.dst_cp)
        runs, cell = plan._expand(pieces, zero, True)
        cell = np.arange(len(runs["length"])) if cell is None else cell
        piece, which = np.divmod(cell, len(part.n))
        runs = {k: np.array(v) for k, v in runs.items()}
        runs |= {"src_vb": src_vb[which], "src_ls": pieces[piece, plan._PIECE_COLUMNS.index("src_block_stride")] * s_ratio,
                 "dst_ls": pieces[piece, plan._PIECE_COLUMNS.index("dst_block_stride")] * d_ratio}
        cells.append(runs)
    if not cells:
        return np.zeros((len(_COLUMNS), 0), np.int64)
    runs = {k: np.concatenate([r[k] for r in cells]) for k in cells[0]}
    if not (_one_stride(runs["src_ls"], runs["src_rank"], runs["src_region"])
            and _one_stride(runs["dst_ls"], runs["dst_region"])):
        return None
    # Runs reading different source ids of the unit touch only for some ids: keep them apart
    # here (the region key carries the id) and let the request's merge join them.
    vbs = int(runs["src_vb"].max()) + 1
    region = runs["src_region"]
    runs["src_region"] = region * vbs + runs["src_vb"]
    runs = plan._coalesce(runs)
    runs["src_region"] //= vbs
    return np.stack([runs[k] for k in _COLUMNS])


def _one_stride(stride: np.ndarray, *keys: np.ndarray) -> bool:
    """Whether every (keys) region has one block stride."""
    key = keys[0] if len(keys) == 1 else keys[0] * (1 << 32) + keys[1]
    order = np.argsort(key, kind="stable")
    k, s = key[order], stride[order]
    return not np.any((k[1:] == k[:-1]) & (s[1:] != s[:-1]))


def _stripes(table: np.ndarray) -> tuple[np.ndarray, int] | None:
    """Stripe keys `(region, const // block_bytes)` of a sorted unit and the runs per stripe,
    or None when stripes are uneven or a run leaves its block."""
    if not table.shape[1]:
        return np.zeros((0, 2), np.int64), 0
    region, offset, ls, length = (table[_C[k]] for k in ("dst_region", "dst_offset", "dst_ls", "length"))
    if np.any(ls <= 0):
        return None
    q, r = np.divmod(offset, ls)
    if np.any(r + length > ls):
        return None
    key = np.stack([region, q], axis=1)
    starts = np.flatnonzero(np.concatenate(([True], np.any(key[1:] != key[:-1], axis=1))))
    counts = np.diff(np.append(starts, len(q)))
    if np.any(counts != counts[0]):
        return None
    return key[starts], int(counts[0])


def _stripe_gap(keys: np.ndarray) -> int:
    """Least step of `const // block_bytes` between consecutive stripes of one region: a
    request's units keep the stripes apart while their destination ids span less than it."""
    same = keys[1:, 0] == keys[:-1, 0]
    return int((keys[1:, 1] - keys[:-1, 1])[same].min()) if same.any() else 1 << 62


def _inner_touch(columns: np.ndarray) -> bool:
    """Whether adjacent runs of a unit may touch for some ids: they touch on the destination and
    read different source ids of one source region (runs reading the same id that could touch
    were merged already)."""
    col = {k: columns[_C[k]] for k in ("dst_offset", "length", "src_rank", "src_region", "convert", "src_vb")}
    a, b = (lambda k: col[k][..., :-1]), (lambda k: col[k][..., 1:])  # noqa: E731
    return bool(np.any((b("dst_offset") == a("dst_offset") + a("length")) & (b("src_vb") != a("src_vb"))
                       & (b("src_rank") == a("src_rank")) & (b("src_region") == a("src_region"))
                       & (b("convert") == a("convert"))))


def _steps(columns: np.ndarray, vbs: int) -> tuple[int, ...] | None:
    """Source id steps between consecutive destination ids that continue some stripe: its last
    run ends its destination block, its first starts the next, and the source follows by that many
    ids (None: not worked out for several slots or source ids per unit; every consecutive
    destination id is then a candidate)."""
    if not columns.shape[3]:  # the rank holds none of the group's layers
        return ()
    col = {k: columns[_C[k]] for k in _COLUMNS}
    r = col["dst_offset"] % np.maximum(col["dst_ls"], 1)
    wraps = (r[..., -1] + col["length"][..., -1] == col["dst_ls"][..., -1]) & (r[..., 0] == 0)
    if not wraps.any():
        return ()
    if columns.shape[1] > 1 or vbs > 1:
        return None
    same = wraps[0] & np.all([col[k][0, :, -1] == col[k][0, :, 0] for k in ("src_rank", "src_region", "convert")],
                             axis=0)
    gap = col["src_offset"][0, :, -1] + col["src_length"][0, :, -1] - col["src_offset"][0, :, 0]
    ls = np.maximum(col["src_ls"][0, :, 0], 1)
    whole = same & (gap % ls == 0)
    return tuple(sorted({int(x) for x in gap[whole] // ls[whole]}))


def template_runs(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, g: int, src_ids: np.ndarray,
                  dst_ids: np.ndarray, first: int, stop: int, ranks: Sequence[int],
                  converting: bool) -> dict[str, np.ndarray] | None:
    """The plan's runs (with `dst_rank`) for tokens `[first, stop)` of group `g`, every rank
    written into one buffer; None when a rank has no template or no layout for them (the
    caller then plans token by token)."""
    from kvbridge.core import plan
    templates = [plan_template(spec, src, dst, d, g) for d in ranks]
    if not templates or any(t is None for t in templates):
        return None
    layouts = [t.layout(dst_ids, first, stop) for t in templates]  # type: ignore[union-attr]
    if any(lay is None for lay in layouts):
        return None
    names = ("dst_rank",) + _OUT + (_EXTRA if converting else ())
    sizes = [t.columns.shape[2] * lay.width for t, lay in zip(templates, layouts)]  # type: ignore[union-attr]
    rows = dict(zip(names, np.empty((len(names), sum(sizes)), np.int64)))
    parts, settled, at = [], True, 0
    for d, template, lay, n in zip(ranks, templates, layouts, sizes):
        part = {k: v[at:at + n] for k, v in rows.items()}
        part["dst_rank"][...] = d
        if not template.write(lay, src_ids, {k: part[k] for k in names[1:]}):  # type: ignore[union-attr]
            part, settled = plan._coalesce(part), False
        parts.append(part)
        at += n
    return rows if settled else plan._concat(parts, names)


def rank_runs(spec: ModelSpec, src: EngineLayout, dst: EngineLayout, d: int, g: int, src_ids: np.ndarray,
              dst_ids: np.ndarray, first: int, stop: int, converting: bool) -> dict[str, np.ndarray] | None:
    """Rank `d`'s runs of group `g` from its template, for the planner to merge with other
    groups' (several groups interleave by layer: the merge sorts); None as `template_runs`."""
    template = plan_template(spec, src, dst, d, g)
    lay = template.layout(dst_ids, first, stop) if template is not None else None
    if lay is None:
        return None
    names = _OUT + (_EXTRA if converting else ())
    out = dict(zip(names, np.empty((len(names), template.columns.shape[2] * lay.width), np.int64)))  # type: ignore[union-attr]
    template.write(lay, src_ids, out)  # type: ignore[union-attr]
    return out


def clear_plan_caches() -> None:
    """Forget every engine pair's templates and tables (the next plan of a pair is cold again)."""
    from kvbridge.core import plan
    from kvbridge.core.layout import _addressing
    for cached in (plan_template, _partial_table, plan._pieces, plan._conversions, plan._check_models, _addressing):
        cached.cache_clear()
