"""In-process execution of a plan between torch tensors.

CPU tensors: one compiled (numba, parallel) loop over the run arrays of the whole plan, every
run a memcpy between region base addresses (the executor keeps the tensors alive). Tensors on one
CUDA device: one Triton kernel launch over the same runs (`copy_cuda`), where torch ships Triton.
Otherwise (or `backend="torch"`): runs are grouped per (source region, destination region) and
moved with one indexed torch copy per group at the widest element size that divides every run. Both validate every run against
region bounds before the first byte moves, so a bad plan never writes partially.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from kvbridge.errors import InvalidRequest
from kvbridge.transport import copy_cuda
from kvbridge.transport.copy import copy_runs, int64_array
from kvbridge.transport.cache import RankCache
from kvbridge.transport.convert import convert_runs
from kvbridge.core.plan import Plan


def _refuse_first(bad: np.ndarray, describe) -> None:
    """Raise `InvalidRequest` describing the first run flagged in `bad`, if any."""
    if bad.any():
        raise InvalidRequest(describe(int(np.flatnonzero(bad)[0])))


class LocalExecutor:
    """Executes plans between fixed sets of source and destination rank caches."""

    def __init__(self, src: Sequence[RankCache], dst: Sequence[RankCache],
                 backend: Literal["auto", "numba", "triton", "torch"] = "auto"):
        self.src, self.dst = list(src), list(dst)
        self._src_first = np.cumsum([0] + [len(c.regions) for c in self.src])
        self._dst_first = np.cumsum([0] + [len(c.regions) for c in self.dst])
        src_bytes = [r for c in self.src for r in c.byte_regions()]
        dst_bytes = [r for c in self.dst for r in c.byte_regions()]
        self._src_sizes = np.array([r.numel() for r in src_bytes], dtype=np.int64)
        self._dst_sizes = np.array([r.numel() for r in dst_bytes], dtype=np.int64)
        devices = {r.device for r in src_bytes + dst_bytes}
        on_cpu = all(d.type == "cpu" for d in devices)
        one_gpu = len(devices) == 1 and next(iter(devices)).type == "cuda"
        if backend == "auto":
            backend = "numba" if on_cpu else "triton" if one_gpu and copy_cuda.available() else "torch"
        self.backend = backend
        if self.backend == "numba" and not on_cpu:
            raise InvalidRequest("the numba backend needs CPU tensors; use backend='torch' for CUDA")
        if self.backend == "triton" and not (one_gpu and copy_cuda.available()):
            raise InvalidRequest("the triton backend needs every region on one CUDA device and a torch build with Triton")
        self._device = next(iter(devices)) if devices else torch.device("cpu")
        self._prepared: weakref.WeakKeyDictionary[Plan, copy_cuda.Pieces] = weakref.WeakKeyDictionary()
        self._src_t, self._dst_t = src_bytes, dst_bytes
        self._src_addr = np.array([r.data_ptr() for r in src_bytes], dtype=np.int64)
        self._dst_addr = np.array([r.data_ptr() for r in dst_bytes], dtype=np.int64)

    def global_regions(self, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """Region indices into this executor's flat region lists, bounds-checked."""
        if len(self.src) != plan.src.world_size or len(self.dst) != plan.dst.world_size:
            raise InvalidRequest(
                f"plan is for TP {plan.src.world_size} -> {plan.dst.world_size}, executor holds "
                f"{len(self.src)} -> {len(self.dst)} rank caches")
        src_count = np.diff(self._src_first)[plan.src_rank]
        dst_count = np.diff(self._dst_first)[plan.dst_rank]
        wrong = (plan.src_region < 0) | (plan.src_region >= src_count) | (plan.dst_region < 0) | (plan.dst_region >= dst_count)
        _refuse_first(wrong, lambda i: f"run {i} names region {int(plan.src_region[i])} of source rank "
                      f"{int(plan.src_rank[i])} ({int(src_count[i])} regions) and region {int(plan.dst_region[i])} "
                      f"of destination rank {int(plan.dst_rank[i])} ({int(dst_count[i])} regions)")
        sr = self._src_first[plan.src_rank] + plan.src_region
        dr = self._dst_first[plan.dst_rank] + plan.dst_region
        bad = ((plan.src_offset < 0) | (plan.src_offset + plan.src_length > self._src_sizes[sr])
               | (plan.dst_offset < 0) | (plan.dst_offset + plan.length > self._dst_sizes[dr]))
        _refuse_first(bad, lambda i: f"run {i} ({int(plan.length[i])} B from rank {int(plan.src_rank[i])} region "
                      f"{int(plan.src_region[i])} @ {int(plan.src_offset[i])} to rank {int(plan.dst_rank[i])} "
                      f"region {int(plan.dst_region[i])} @ {int(plan.dst_offset[i])}) falls outside the registered "
                      "regions")
        return sr, dr

    def addresses(self, sr: np.ndarray, dr: np.ndarray, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source address, destination address, length) of every run, given `global_regions`."""
        return self._src_addr[sr] + plan.src_offset, self._dst_addr[dr] + plan.dst_offset, plan.length

    def execute(self, plan: Plan) -> float:
        """Copy every run of `plan`; returns the seconds the copy took.

        The triton backend keeps each plan's validated, uploaded pieces while the plan object
        lives, so executing the same plan again (a request repeated, a benchmark) costs one
        kernel launch: a plan's run arrays must not change after its first execution.
        """
        t0 = time.perf_counter()
        prepared = self._prepared.get(plan) if self.backend == "triton" else None
        if prepared is not None:
            copy_cuda.launch(prepared)
            return time.perf_counter() - t0
        sr, dr = self.global_regions(plan)
        t0 = time.perf_counter()
        if len(plan) == 0:
            return 0.0
        original, converted = plan, plan.needs_conversion
        if converted:  # KV dtype conversion on the copy path (transport/convert.py)
            done = convert_runs(self._src_t, self._dst_t, sr, dr, plan)
            plan, sr, dr = plan.select(~done), sr[~done], dr[~done]
        if self.backend == "numba":
            copy_runs(self._src_addr, self._dst_addr, int64_array(sr), int64_array(plan.src_offset), int64_array(dr),
                      int64_array(plan.dst_offset), int64_array(plan.length))
        elif self.backend == "triton":
            prepared = copy_cuda.prepare(*self.addresses(sr, dr, plan), self._device)
            if not converted:
                self._prepared[original] = prepared
            copy_cuda.launch(prepared)
        else:
            self._execute_torch(sr, dr, plan)
        return time.perf_counter() - t0

    def _execute_torch(self, sr: np.ndarray, dr: np.ndarray, plan: Plan) -> None:
        """One gather/scatter per region pair, at the widest element size dividing every run."""
        pair = sr * len(self._dst_t) + dr
        for key in np.unique(pair):
            sel = pair == key
            so, do, ln = plan.src_offset[sel], plan.dst_offset[sel], plan.length[sel]
            src_bytes, dst_bytes = self._src_t[int(key // len(self._dst_t))], self._dst_t[int(key % len(self._dst_t))]
            width = math.gcd(int(np.gcd.reduce(so)), int(np.gcd.reduce(do)), int(np.gcd.reduce(ln)),
                             src_bytes.numel(), dst_bytes.numel(), 8)
            width = width & -width  # largest power of two dividing all of them
            dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
            src, dst = src_bytes.view(dtype), dst_bytes.view(dtype)
            counts = torch.from_numpy(ln // width)
            within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
            s_idx = (torch.repeat_interleave(torch.from_numpy(so // width), counts) + within).to(src.device)
            d_idx = (torch.repeat_interleave(torch.from_numpy(do // width), counts) + within).to(dst.device)
            dst[d_idx] = src[s_idx].to(dst.device)


def execute_plan(plan: Plan, src: Sequence[RankCache], dst: Sequence[RankCache],
                 backend: Literal["auto", "numba", "triton", "torch"] = "auto") -> float:
    """Execute `plan` once between the given rank caches; returns copy seconds."""
    return LocalExecutor(src, dst, backend).execute(plan)
