"""Staging of small runs into one contiguous buffer per rank pair, on whatever device holds the caches.

Many tiny runs cost one transfer (one descriptor, one launch) each; staging pays two cheap memory
passes instead: a gather kernel packs a (source rank, destination rank) pair's runs into one
contiguous buffer, the buffer moves as one transfer, and a scatter kernel unpacks it on arrival.
Everything is plain torch, so the same code runs on CPU (tested in CI) and on CUDA tensors.

Kernels: runs are grouped by (source region, destination region, length L). Each group reads its
runs through a zero-copy `unfold(0, L, 1)` view of the source region (one row per start position)
with one `index_select` of the run starts, and writes them with one `index_copy_` into the same
kind of view of the destination region: index memory is 8 B per run, not per byte. Both views use
the widest word (8/4/2/1 B) dividing the group's offsets and length. The unfold rows overlap; the
plan guarantees the written runs do not, and if a torch build refuses writes into an overlapping
view the scatter falls back to non-overlapping rows of the offsets' common granularity.

The buffer layout (which run lies where) is a pure function of the plan, so the sending side and
the receiving side compute it alike and nothing but the bytes travels.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np
import torch

from kvbridge.core.plan import Plan
from kvbridge.errors import InvalidRequest
from kvbridge.transport.cache import RankCache
from kvbridge.transport.local import LocalExecutor

# Default staging threshold: a pair whose mean run is below 64 KiB is staged. Why: one transfer
# (a NIXL/RDMA descriptor or a cudaMemcpy launch) costs a few microseconds however small, and at
# ~12-25 GB/s per link 64 KiB also takes ~3-5 us to move, so below it the fixed cost dominates;
# the gather and scatter read and write each byte once more in device memory (TB/s), well under
# 0.1 us per 64 KiB. An estimate from those orders of magnitude, not a GPU measurement.
DEFAULT_THRESHOLD_BYTES = 64 * 1024

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PairPath(msgspec.Struct, frozen=True):
    """How one (source rank, destination rank) pair moved: `staged` (gather, one transfer,
    scatter) or `direct` (one copy per run); `reason` says why when it was forced."""

    src_rank: int
    dst_rank: int
    path: Literal["staged", "direct"]
    num_runs: int
    bytes: int
    mean_run_bytes: float
    reason: str = ""


class StagingReport(msgspec.Struct):
    threshold_bytes: int
    pairs: list[PairPath]
    seconds: float = 0.0

    def path_of(self, src_rank: int, dst_rank: int) -> str:
        return next(p.path for p in self.pairs if (p.src_rank, p.dst_rank) == (src_rank, dst_rank))


def _pair_keys(plan: Plan) -> np.ndarray:
    return plan.src_rank.astype(np.int64) * plan.dst.world_size + plan.dst_rank


def rank_pairs(plan: Plan) -> list[tuple[int, int]]:
    """The (source rank, destination rank) pairs that have runs, in sorted order."""
    counts = np.bincount(_pair_keys(plan), minlength=plan.src.world_size * plan.dst.world_size)
    return [divmod(int(k), plan.dst.world_size) for k in np.flatnonzero(counts)]


def pair_mask(plan: Plan, src_rank: int, dst_rank: int) -> np.ndarray:
    return (plan.src_rank == src_rank) & (plan.dst_rank == dst_rank)


def choose_path(plan: Plan, threshold_bytes: int = DEFAULT_THRESHOLD_BYTES) -> list[PairPath]:
    """Per rank pair: staged when its mean run is below `threshold_bytes`, else direct.

    A pair with converting runs (KV dtype conversion) always goes direct: staging moves bytes.
    Linear in the runs (one bincount per figure), no sort.
    """
    if threshold_bytes < 0:
        raise InvalidRequest(f"staging threshold must be >= 0 bytes, got {threshold_bytes}")
    keys, size = _pair_keys(plan), plan.src.world_size * plan.dst.world_size
    runs = np.bincount(keys, minlength=size)
    nbytes = np.bincount(keys, weights=plan.length, minlength=size)
    converts = (np.bincount(keys, weights=plan.convert >= 0, minlength=size) > 0 if plan.needs_conversion
                else np.zeros(size, dtype=bool))
    out = []
    for k in np.flatnonzero(runs):
        s, d = divmod(int(k), plan.dst.world_size)
        n, b = int(runs[k]), int(nbytes[k])
        path = "direct" if converts[k] or b / n >= threshold_bytes else "staged"
        out.append(PairPath(s, d, path, n, b, b / n, "converts KV dtype" if converts[k] else ""))
    return out


class _Group(msgspec.Struct, frozen=True):
    """Runs sharing (source region, destination region, length), at one word width, and where
    they lie in the buffer (`start`, `start + len(runs) * length`)."""

    src_region: int
    dst_region: int
    length: int
    width: int
    runs: np.ndarray  # indices into the pair plan
    start: int


def staging_layout(plan: Plan) -> tuple[list[_Group], int]:
    """Groups of the plan's runs and the buffer size. Groups are placed widest word first, so every
    group starts at a multiple of its own width (each group's size is a multiple of its width)."""
    if plan.needs_conversion and bool((plan.convert >= 0).any()):
        raise InvalidRequest("staging moves bytes; runs that convert KV dtype must go direct")
    if len(plan) == 0:
        return [], 0
    # One int64 key per run, (source region, destination region, length) in lexicographic order;
    # a stable sort (timsort: plans come in long already-sorted stretches) finds the groups.
    regions_d = int(plan.dst_region.max()) + 1
    lengths, length_code = np.unique(plan.length, return_inverse=True)
    key = (plan.src_region.astype(np.int64) * regions_d + plan.dst_region) * len(lengths) + length_code.reshape(-1)
    order = np.argsort(key, kind="stable")
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(key[order])) + 1, [len(key)]])
    groups = []
    for lo, hi in itertools.pairwise(bounds):
        runs = order[lo:hi]
        first = runs[0]
        sr, dr, ln = plan.src_region[first], plan.dst_region[first], plan.length[first]
        g = math.gcd(int(ln), int(np.gcd.reduce(plan.src_offset[runs])), int(np.gcd.reduce(plan.dst_offset[runs])), 8)
        groups.append((g & -g, int(sr), int(dr), int(ln), runs))
    groups.sort(key=lambda t: -t[0])  # stable: ties keep (region, region, length) order
    out, pos = [], 0
    for width, sr, dr, ln, runs in groups:
        out.append(_Group(sr, dr, ln, width, runs, pos))
        pos += len(runs) * ln
    return out, pos


def _words(region: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """`region` (flat uint8) as words of the widest size <= `width` its alignment allows."""
    while width > 1 and (region.storage_offset() % width or region.data_ptr() % width):
        width //= 2
    usable = region.numel() - region.numel() % width
    return region[:usable].view(_WORD[width]), width


def _rows(region: torch.Tensor, length: int, width: int) -> tuple[torch.Tensor, int]:
    """Zero-copy view `[start position, length // w]` of `region` in words of `w` bytes."""
    words, w = _words(region, width)
    return words.unfold(0, length // w, 1), w


def _starts(offsets: np.ndarray, width: int, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(offsets // width)).to(device)


def gather(plan: Plan, src_regions: Sequence[torch.Tensor], layout: tuple[list[_Group], int] | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack the runs of `plan` (one source rank) from `src_regions` into one contiguous uint8 buffer
    laid out by `staging_layout(plan)`; the buffer is on the source regions' device."""
    groups, size = layout or staging_layout(plan)
    device = src_regions[0].device if src_regions else torch.device("cpu")
    buf = torch.empty(size, dtype=torch.uint8, device=device) if out is None else out
    if buf.numel() != size:
        raise InvalidRequest(f"staging buffer holds {buf.numel()} bytes, the plan needs {size}")
    for g in groups:
        rows, w = _rows(src_regions[g.src_region], g.length, g.width)
        dest = buf[g.start:g.start + len(g.runs) * g.length]
        dest = dest.view(_WORD[w]).view(len(g.runs), g.length // w)
        torch.index_select(rows, 0, _starts(plan.src_offset[g.runs], w, rows.device), out=dest)
    return buf


def scatter(buffer: torch.Tensor, plan: Plan, dst_regions: Sequence[torch.Tensor],
            layout: tuple[list[_Group], int] | None = None, overlapping_rows: bool = True) -> None:
    """Unpack a buffer made by `gather` for the same plan into `dst_regions` (one destination rank).

    `overlapping_rows=False` forces the non-overlapping fallback (rows of the offsets' common
    granularity, one index per row) that is otherwise used only if torch refuses the unfold view.
    """
    groups, size = layout or staging_layout(plan)
    if buffer.numel() != size:
        raise InvalidRequest(f"staging buffer holds {buffer.numel()} bytes, the plan needs {size}")
    for g in groups:
        region = dst_regions[g.dst_region]
        offsets = plan.dst_offset[g.runs]
        src = buffer[g.start:g.start + len(g.runs) * g.length].to(region.device)
        if overlapping_rows:
            rows, w = _rows(region, g.length, g.width)
            data = src.view(_WORD[w]).view(len(g.runs), g.length // w)
            try:
                rows.index_copy_(0, _starts(offsets, w, rows.device), data)
                continue
            except RuntimeError:  # a torch build that refuses writes through overlapping views
                pass
        _scatter_chunks(region, offsets, g, src)


def _scatter_chunks(region: torch.Tensor, offsets: np.ndarray, g: _Group, src: torch.Tensor) -> None:
    """Scatter through non-overlapping rows of `c` bytes, `c` the granularity of offsets and length:
    one index per `c` bytes (one per run when every run starts at a multiple of its length)."""
    c = math.gcd(g.length, int(np.gcd.reduce(offsets)))
    words, w = _words(region, math.gcd(c, g.width))
    per_row = c // w
    rows = words[:words.numel() - words.numel() % per_row].view(-1, per_row)
    chunks = g.length // c
    idx = (offsets[:, None] // c + np.arange(chunks, dtype=np.int64)[None, :]).reshape(-1)
    rows.index_copy_(0, torch.from_numpy(idx).to(rows.device), src.view(_WORD[w]).view(-1, per_row))


class StagedExecutor:
    """Moves a plan pair by pair: staged pairs gather into one buffer, copy it in one piece into a
    buffer on the destination's device (standing in for the one network transfer) and scatter;
    direct pairs go through `LocalExecutor`. `execute` returns which path each pair used."""

    def __init__(self, src: Sequence[RankCache], dst: Sequence[RankCache],
                 threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
                 backend: Literal["auto", "numba", "torch"] = "auto"):
        self.direct = LocalExecutor(src, dst, backend)
        self.threshold_bytes = threshold_bytes
        self._src = [c.byte_regions() for c in self.direct.src]
        self._dst = [c.byte_regions() for c in self.direct.dst]
        self._buffers: dict[tuple[str, int, int], torch.Tensor] = {}

    def execute(self, plan: Plan) -> StagingReport:
        self.direct.global_regions(plan)  # every run bounds-checked before the first byte moves
        t0 = time.perf_counter()
        pairs = choose_path(plan, self.threshold_bytes)
        direct = np.zeros(len(plan), dtype=bool)
        for p in pairs:
            m = pair_mask(plan, p.src_rank, p.dst_rank)
            if p.path == "direct":
                direct |= m
                continue
            self.move_staged(plan.select(m), p.src_rank, p.dst_rank)
        if direct.any():
            self.direct.execute(plan.select(direct))
        return StagingReport(self.threshold_bytes, pairs, time.perf_counter() - t0)

    def move_staged(self, pair_plan: Plan, src_rank: int, dst_rank: int) -> None:
        layout = staging_layout(pair_plan)
        src_regions, dst_regions = self._src[src_rank], self._dst[dst_rank]
        sent = gather(pair_plan, src_regions, layout, self._buffer(("send", src_rank, dst_rank), layout[1], src_regions))
        arrived = self._buffer(("recv", src_rank, dst_rank), layout[1], dst_regions)
        arrived.copy_(sent)  # the one transfer
        scatter(arrived, pair_plan, dst_regions, layout)

    def _buffer(self, key: tuple[str, int, int], size: int, regions: list[torch.Tensor]) -> torch.Tensor:
        """A staging buffer kept per pair and side and reused while the size fits (as a transport
        keeps its registered buffers): no allocation or page faults on the hot path."""
        have = self._buffers.get(key)
        if have is None or have.numel() < size:
            device = regions[0].device if regions else torch.device("cpu")
            have = self._buffers[key] = torch.empty(size, dtype=torch.uint8, device=device)
        return have[:size]
