"""Runs of one offload job, produced by kvbridge's planner.

A job moves, per KV-cache group, `n` device blocks starting at logical block L to or from the
CPU blocks that hold them (see `spec`). That is an ordinary kvbridge request between two layouts:
for the group's layers only, tokens `[skip * B, (skip + n) * B)` (B = device block size) with
the device ids on one side and the CPU ids (blocks of `factor * B` tokens) on the other; the
request starts at the first CPU block, so L itself never matters beyond its remainder `skip`.
The planner turns it into coalesced byte runs whatever the two layouts are: the mirror pool of
the same engine or the canonical pool of any engine.

Each group is planned on its own sub-model (its layers, windows removed: the scheduler has already
chosen exactly which blocks move), then region numbers are mapped back to the full model and to
flat region lists, and all groups are concatenated into *one* run list for one copy call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvbridge.errors import InvalidRequest
from kvbridge.core.layout import EngineLayout
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.spec import BlockIDsLoadStoreSpec, GPULoadStoreSpec, split_groups
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.spec import LayerSpec, ModelSpec


@lru_cache(maxsize=256)
def group_model(spec: ModelSpec, group: int) -> ModelSpec:
    """The layers of one KV-cache group as a model of their own, sliding windows turned off."""
    layers = []
    for li in spec.groups[group]:
        layer = spec.layers[li]
        if layer.window is not None:  # sliding K/V becomes full K/V, sliding MLA plain MLA
            layer = LayerSpec("full" if layer.kind == "sliding" else layer.kind, layer.num_kv_heads, layer.key_dim,
                              layer.value_dim)
        layers.append(layer)
    return ModelSpec(tuple(layers), spec.dtype, f"{spec.name}/group{group}")


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
    """One side's flat region numbering: region r of rank k is `first[pos[k]] + remap[g][r]`."""

    def __init__(self, spec: ModelSpec, layout: EngineLayout, ranks: Sequence[int]):
        self.layout = layout
        self.pos = np.full(layout.tp_size, -1, dtype=np.int64)
        self.pos[np.asarray(ranks, dtype=np.int64)] = np.arange(len(ranks))
        sizes = [layout.addressing(spec, r).region_nbytes for r in ranks]
        self.first = np.cumsum([0] + [len(s) for s in sizes[:-1]]).astype(np.int64)
        self.sizes = np.asarray([n for s in sizes for n in s], dtype=np.int64)
        per_layer = layout.layer_placement == "per_layer"
        self.remap = [np.asarray(layers if per_layer else (0,), dtype=np.int64) for layers in spec.groups]

    def flat(self, group: int, rank: np.ndarray, region: np.ndarray) -> np.ndarray:
        return self.first[self.pos[rank]] + self.remap[group][region]


class JobPlanner:
    """Plans store and load jobs between some ranks of a device engine and a CPU pool."""

    def __init__(self, spec: ModelSpec, device: EngineLayout, device_ranks: Sequence[int], pool: CPUPool):
        self.spec, self.device, self.pool = spec, device, pool
        self.factor = pool.factor_for(spec, device)
        self.ranks = tuple(int(r) for r in device_ranks)
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or not all(
                0 <= r < device.tp_size for r in self.ranks):
            raise InvalidRequest(f"device ranks {list(self.ranks)} must be distinct ranks of TP={device.tp_size}")
        self.dev = _Side(spec, device, self.ranks)
        self.cpu = _Side(spec, pool.layout, range(pool.layout.tp_size))
        # Same TP on both sides: pool rank r reads and writes only device rank r (the mirror case).
        self._rank_to_rank = pool.layout.tp_size == device.tp_size

    def plan(self, gpu: GPULoadStoreSpec, cpu: BlockIDsLoadStoreSpec, store: bool) -> JobRuns:
        """Runs of a store (device -> pool) or a load (pool -> device), all groups together."""
        t0 = time.perf_counter()
        slices = split_groups(gpu, cpu, self.factor, len(self.spec.groups))
        B = self.device.block_size
        parts = []
        for s in slices:
            sub = group_model(self.spec, s.group)
            n = len(s.device_ids)
            dev_ids = tuple([0] * s.skip + s.device_ids.tolist())  # the skipped entries are never read
            req_dev_cpu = (dev_ids, tuple(s.cpu_ids.tolist()))
            src_ids, dst_ids = req_dev_cpu if store else req_dev_cpu[::-1]
            req = Request((src_ids,), (dst_ids,), (s.skip + n) * B, s.skip * B)
            if store:
                dst_ranks = self.ranks if self._rank_to_rank else None
                p = plan_request(sub, self.device, self.pool.layout, req, dst_ranks)
                keep = self.dev.pos[p.src_rank] >= 0  # canonical: this worker writes the heads its ranks serve
                src = self.dev.flat(s.group, p.src_rank[keep], p.src_region[keep])
                dst = self.cpu.flat(s.group, p.dst_rank[keep], p.dst_region[keep])
            else:
                p = plan_request(sub, self.pool.layout, self.device, req, self.ranks)
                keep = slice(None)
                src = self.cpu.flat(s.group, p.src_rank, p.src_region)
                dst = self.dev.flat(s.group, p.dst_rank, p.dst_region)
            parts.append((src, p.src_offset[keep], dst, p.dst_offset[keep], p.length[keep]))
        cols = [np.concatenate(c) if c else np.zeros(0, np.int64) for c in zip(*parts)] if parts else \
            [np.zeros(0, np.int64)] * 5
        runs = JobRuns(*(np.ascontiguousarray(c, dtype=np.int64) for c in cols),
                       num_device_blocks=sum(len(s.device_ids) for s in slices),
                       plan_seconds=time.perf_counter() - t0)
        self._check_bounds(runs, store)
        return runs

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
