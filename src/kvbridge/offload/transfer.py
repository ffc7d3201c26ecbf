"""Runs of one offload job, produced by kvbridge's planner.

A job moves, per KV-cache group, `n` device blocks starting at logical block L to or from the
CPU blocks that hold them (see `spec`). That is an ordinary kvbridge request between two layouts:
for the group's layers only, tokens `[skip * B, (skip + n) * B)` (B = device block size) with
the device ids on one side and the CPU ids (blocks of `factor * B` tokens) on the other; the
request starts at the first CPU block, so L itself never matters beyond its remainder `skip`.
The planner turns it into coalesced byte runs whatever the two layouts are: the mirror pool of
the same engine or the canonical pool of any engine.

A recurrent group's checkpoints are one state slot each (`spec.split_groups`), each planned as a
request of its own, which moves one slot between any TP sizes.

Each group is planned on its own sub-model (its layers, windows removed: the scheduler has already
chosen exactly which blocks move), then region numbers are mapped back to the full model and to
flat region lists, and all groups are concatenated into *one* run list for one copy call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import msgspec

import numpy as np

from kvbridge.errors import IncompatibleEngines, InvalidRequest
from kvbridge.core.layout import Addressing, EngineLayout
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.spec import BlockIDsLoadStoreSpec, GPULoadStoreSpec, GroupSlice, split_groups
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.spec import ModelSpec


@lru_cache(maxsize=256)
def group_model(spec: ModelSpec, group: int, layers: tuple[int, ...] | None = None) -> ModelSpec:
    """The layers of one KV-cache group (or `layers`, some of them) as a model of their own,
    sliding windows turned off."""
    out = []
    for li in spec.groups[group] if layers is None else layers:
        layer = spec.layers[li]
        if layer.window is not None:  # sliding K/V becomes full K/V, sliding MLA plain MLA (same class: an
            # engine's own layer subclass, e.g. vLLM CPU's, says how its layout addresses the layer)
            layer = msgspec.structs.replace(layer, kind="full" if layer.kind == "sliding" else layer.kind, window=None)
        out.append(layer)
    return ModelSpec(tuple(out), spec.dtype, f"{spec.name}/group{group}")


@dataclass(frozen=True)
class JobRuns:
    """Byte runs of one job between flat source and destination region lists."""

    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray
    num_device_blocks: int
    plan_seconds: float

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def __len__(self) -> int:
        return len(self.length)


class _Side:
    """One side's flat region numbering: full-model region r of rank k is `first[pos[k]] + r`."""

    def __init__(self, spec: ModelSpec, layout: EngineLayout, ranks: Sequence[int]):
        self.layout = layout
        self.pos = np.full(layout.world_size, -1, dtype=np.int64)
        self.pos[np.asarray(ranks, dtype=np.int64)] = np.arange(len(ranks))
        self.addr = {r: layout.addressing(spec, r) for r in ranks}
        sizes = [self.addr[r].region_nbytes for r in ranks]
        self.first = np.cumsum([0] + [len(s) for s in sizes[:-1]]).astype(np.int64)
        self.sizes = np.asarray([n for s in sizes for n in s], dtype=np.int64)

    def flat(self, rank: np.ndarray, region: np.ndarray) -> np.ndarray:
        return self.first[self.pos[rank]] + region


class _Part(NamedTuple):
    """The layers of one group on one device PP stage, planned as a TP-only model of their own."""

    group: int
    stage: int
    model: ModelSpec
    dev_regions: np.ndarray  # sub-model region i -> the device rank's full-model region
    cpu_regions: np.ndarray  # sub-model region i -> the pool's full-model region


def _check_alone(whole: Addressing, alone: Addressing, layers: tuple[int, ...], group: int) -> None:
    """A group's layers must sit where the whole model puts them when planned as a model of their
    own: a layout that pads every page to the largest group's would otherwise be misread."""
    for i, li in enumerate(layers):
        n = int(alone.num_components[i])
        for field in ("base", "block_stride", "token_stride", "head_stride", "row_bytes", "heads"):
            if n != int(whole.num_components[li]) or not np.array_equal(getattr(whole, field)[li, :n],
                                                                         getattr(alone, field)[i, :n]):
                raise IncompatibleEngines(f"KV-cache group {group}: layer {li}'s {field.replace('_', ' ')} depends on "
                                          f"the other groups' layers (padded pages); offload does not move it")


class _UnitTable(NamedTuple):
    """One device block's runs as constants and per-id strides (`JobPlanner._unit_table`)."""

    dev_region: np.ndarray
    dev_const: np.ndarray
    dev_stride: np.ndarray
    cpu_region: np.ndarray
    cpu_const: np.ndarray
    cpu_stride: np.ndarray
    length: np.ndarray


class JobPlanner:
    """Plans store and load jobs between some ranks of a device engine and a CPU pool."""

    def __init__(self, spec: ModelSpec, device: EngineLayout, device_ranks: Sequence[int], pool: CPUPool):
        self.spec, self.device, self.pool = spec, device, pool
        self.factor = pool.factor_for(spec, device)
        self.ranks = tuple(int(r) for r in device_ranks)
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or not all(
                0 <= r < device.world_size for r in self.ranks):
            raise InvalidRequest(f"device ranks {list(self.ranks)} must be distinct ranks of "
                                 f"{device.describe_ranks()}")
        if device.pp_size > 1 and pool.format == "mirror":
            raise InvalidRequest("a mirror pool of a pipeline-parallel engine is not supported; use the canonical pool")
        if device.cp_size > 1:
            raise InvalidRequest(f"offload of a context-parallel engine ({device.describe()}) is not supported")
        self._tables: dict[tuple[int, int, bool], _UnitTable | None] = {}  # `_unit_tables`, built at first use
        self.dev = _Side(spec, device, self.ranks)
        self.cpu = _Side(spec, pool.layout, range(pool.layout.tp_size))
        # Same TP on both sides: pool rank r reads and writes only device rank r (the mirror case).
        self._rank_to_rank = pool.layout.tp_size == device.tp_size
        # Each PP stage is planned as a TP-only engine over the group's layers it holds.
        stage_of = device.layer_stage(spec.num_layers)
        cpu_addr = self.cpu.addr[0]
        self._parts: dict[int, list[_Part]] = {}
        self._stage_layouts: dict[int, EngineLayout] = {}
        for g, layers in enumerate(spec.groups):
            # One group's layers are planned as a model of their own, so the layout keeps that group's block size alone.
            self._stage_layouts[g] = msgspec.structs.replace(
                device, pp_size=1, layer_split=(),
                group_block_sizes=(device.group_block_size(g),) if device.group_block_sizes else ())
            parts = []
            for p in range(device.pp_size):
                mine = tuple(li for li in layers if stage_of[li] == p)
                if not mine:
                    continue
                dev_addr = device.addressing(spec, device.flat_rank(0, p))
                model = group_model(spec, g, mine)
                _check_alone(dev_addr, self._stage_layouts[g].addressing(model, 0), mine, g)
                _check_alone(cpu_addr, pool.layout.addressing(model, 0), mine, g)
                parts.append(_Part(g, p, model, dev_addr.region[list(mine), 0].copy(),
                                   cpu_addr.region[list(mine), 0].copy()))
            self._parts[g] = parts

    def plan(self, gpu: GPULoadStoreSpec, cpu: BlockIDsLoadStoreSpec, store: bool, by_unit: bool = True) -> JobRuns:
        """Runs of a store (device -> pool) or a load (pool -> device), all groups together.
        `by_unit=False` plans every job whole (the reference the per-block tables are tested against)."""
        t0 = time.perf_counter()
        slices = split_groups(gpu, cpu, self.factor, len(self.spec.groups), self.spec.recurrent_groups())
        B = self.device.block_size
        parts, from_tables = [], True  # runs from `_by_unit` were checked with their tables
        for s in slices:
            n = len(s.device_ids)
            if s.state:  # one state slot per checkpoint, each its own request (the planner moves the last id's slot)
                from_tables = False
                pairs = [((int(d),), (int(c),)) for d, c in zip(s.device_ids, s.cpu_ids)]
                reqs = [Request((a,), (b,), 1, 0) if store else Request((b,), (a,), 1, 0) for a, b in pairs]
            else:
                unit = self._by_unit(s, store) if by_unit else None
                if unit is not None:
                    parts += unit
                    continue
                from_tables = False
                dev_ids = tuple([0] * s.skip + s.device_ids.tolist())  # the skipped entries are never read
                req_dev_cpu = (dev_ids, tuple(s.cpu_ids.tolist()))
                src_ids, dst_ids = req_dev_cpu if store else req_dev_cpu[::-1]
                reqs = [Request((src_ids,), (dst_ids,), (s.skip + n) * B, s.skip * B)]
            for req, part in ((r, p) for r in reqs for p in self._parts[s.group]):
                parts += self._request_runs(req, part, store)
        cols = [np.concatenate(c) if c else np.zeros(0, np.int64) for c in zip(*parts)] if parts else \
            [np.zeros(0, np.int64)] * 5
        runs = JobRuns(*(np.ascontiguousarray(c, dtype=np.int64) for c in cols),
                       num_device_blocks=sum(len(s.device_ids) for s in slices),
                       plan_seconds=time.perf_counter() - t0)
        if not from_tables:
            self._check_bounds(runs, store)
        return runs

    def _request_runs(self, req: Request, part: _Part, store: bool) -> list[tuple[np.ndarray, ...]]:
        """(source region, offset, destination region, offset, length) of one request on one part,
        in flat region numbers; [] when none of this worker's ranks holds the part's layers."""
        tp = self.device.tp_size
        stage_ranks = [r - part.stage * tp for r in self.ranks if r // tp == part.stage]
        if not stage_ranks:
            return []
        if store:
            dst_ranks = stage_ranks if self._rank_to_rank else None
            p = plan_request(part.model, self._stage_layouts[part.group], self.pool.layout, req, dst_ranks)
            src_flat = p.src_rank + part.stage * tp
            keep = self.dev.pos[src_flat] >= 0  # canonical: this worker writes the heads its ranks serve
            src = self.dev.flat(src_flat[keep], part.dev_regions[p.src_region[keep]])
            dst = self.cpu.flat(p.dst_rank[keep], part.cpu_regions[p.dst_region[keep]])
            return [(src, p.src_offset[keep], dst, p.dst_offset[keep], p.length[keep])]
        p = plan_request(part.model, self.pool.layout, self._stage_layouts[part.group], req, stage_ranks)
        src = self.cpu.flat(p.src_rank, part.cpu_regions[p.src_region])
        dst = self.dev.flat(p.dst_rank + part.stage * tp, part.dev_regions[p.dst_region])
        return [(src, p.src_offset, dst, p.dst_offset, p.length)]

    def _by_unit(self, s: GroupSlice, store: bool) -> list[tuple[np.ndarray, ...]] | None:
        """A slice's runs from per-device-block tables (`_unit_table`): every device block's runs
        are the same up to its id and its CPU block's id, each moving them by a fixed stride, so a
        job costs a few vector operations instead of a plan (a plan of 4,096 tokens in 16-token
        blocks is half a million runs: planned each time, it took longer than the copy). Runs of
        neighbouring blocks are not merged, which changes their number, never a byte. None when a
        table does not exist (see `_unit_table`): the caller plans the slice."""
        q = s.skip + np.arange(len(s.device_ids), dtype=np.int64)
        sub, cpu_ids = q % self.factor, s.cpu_ids[q // self.factor]
        if (len(s.device_ids) and (int(s.device_ids.max()) >= self.device.num_blocks
                                   or int(cpu_ids.max()) >= self.pool.layout.num_blocks)):
            return None  # out of range: the planner says why
        out = []
        for k in range(len(self._parts[s.group])):
            t = self._unit_tables(s.group, k, store)
            if t is None:
                return None
            if not t.length.shape[1]:
                continue
            dev_off = t.dev_const[sub] + s.device_ids[:, None] * t.dev_stride[sub]
            cpu_off = t.cpu_const[sub] + cpu_ids[:, None] * t.cpu_stride[sub]
            cols = [t.dev_region[sub], dev_off, t.cpu_region[sub], cpu_off] if store else \
                [t.cpu_region[sub], cpu_off, t.dev_region[sub], dev_off]
            out.append(tuple(c.reshape(-1) for c in cols + [t.length[sub]]))
        return out

    def _unit_tables(self, group: int, part: int, store: bool) -> _UnitTable | None:
        """Every sub-block's `_unit_table`, stacked (`column[sub, run]`); None unless all exist
        with as many runs each. Kept by the planner (one per engine and pool), not in a cache of
        the process: a table holds a block's runs for every sub-block, megabytes for a big model."""
        key = (group, part, store)
        if key not in self._tables:
            tables = [self._unit_table(group, part, r, store) for r in range(self.factor)]
            self._tables[key] = None if any(t is None for t in tables) or len(
                {len(t.length) for t in tables}) != 1 else _UnitTable(*(np.stack(col) for col in zip(*tables)))  # type: ignore[union-attr,misc]
        return self._tables[key]

    def _unit_table(self, group: int, part: int, sub: int, store: bool) -> _UnitTable | None:
        """The runs that move sub-block `sub` of a CPU block (one device block) of part `part`,
        as constants plus strides per device and CPU block id: planned with ids 0 and 1 on each
        side and checked at the largest ids. None when the engine has fewer than two blocks on a
        side, or its runs are not of that form (the caller then plans every job)."""
        nd, nc = self.device.num_blocks, self.pool.layout.num_blocks
        if nd < 2 or nc < 2:
            return None
        B = self.device.block_size
        d, c = (0, 2) if store else (2, 0)  # where the device's and the CPU's columns are in a run

        def runs(dev: int, host: int) -> tuple[np.ndarray, ...]:
            ids = ((0,) * sub + (dev,), (host,))
            src, dst = ids if store else ids[::-1]
            found = self._request_runs(Request((src,), (dst,), (sub + 1) * B, sub * B), self._parts[group][part], store)
            return found[0] if found else (np.zeros(0, np.int64),) * 5

        base, dev1, cpu1, far = runs(0, 0), runs(1, 0), runs(0, 1), runs(nd - 1, nc - 1)
        if any(len(r[4]) != len(base[4]) for r in (dev1, cpu1, far)):
            return None
        for other in (dev1, cpu1, far):
            if not all(np.array_equal(other[i], base[i]) for i in (d, c, 4)):
                return None
        table = _UnitTable(base[d], base[d + 1], dev1[d + 1] - base[d + 1], base[c], base[c + 1],
                           cpu1[c + 1] - base[c + 1], base[4])
        if not (np.array_equal(table.dev_const + (nd - 1) * table.dev_stride, far[d + 1])
                and np.array_equal(table.cpu_const + (nc - 1) * table.cpu_stride, far[c + 1])):
            return None  # not a constant stride per id
        for ends in (base, far):  # every id between lies between these two, inside the regions
            self._check_bounds(JobRuns(*ends, num_device_blocks=1, plan_seconds=0.0), store)
        return table

    def _check_bounds(self, runs: JobRuns, store: bool) -> None:
        src, dst = (self.dev, self.cpu) if store else (self.cpu, self.dev)
        bad = ((runs.src_offset < 0) | (runs.src_offset + runs.length > src.sizes[runs.src_region])
               | (runs.dst_offset < 0) | (runs.dst_offset + runs.length > dst.sizes[runs.dst_region]))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InvalidRequest(f"offload run {i} ({int(runs.length[i])} B from region {int(runs.src_region[i])} @ "
                                 f"{int(runs.src_offset[i])} to region {int(runs.dst_region[i])} @ "
                                 f"{int(runs.dst_offset[i])}) falls outside the registered regions")


__all__ = ["JobPlanner", "JobRuns", "group_model"]
