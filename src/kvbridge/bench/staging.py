"""Staged vs direct vs one contiguous copy of the same bytes, measured side by side in one run.

For each shape pair the three moves alternate (median of `repeats`), so machine noise hits them
alike; the ratios are the result, absolute numbers on a shared machine are noise. "staged" forces
every pair through gather -> one contiguous copy -> scatter (`StagedExecutor`), "direct" is the
`LocalExecutor` (numba on CPU, indexed torch copies on CUDA), "direct_torch" its torch backend
(the like-for-like torch baseline), and the contiguous copy is the floor for the same byte count.

On CPU (2 shared cores) staging loses to the numba direct copy (~9-10x) and beats the torch direct
backend (~4-5x): torch's CPU index kernels move ~0.3-2 GB/s where numba's memcpy loop runs near
memory speed, and on CPU a run costs no transfer. The case staging is for, one network or
device transfer per run, needs a GPU (and NIXL) to measure; no figure here stands for it.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import msgspec
import torch

from kvbridge.bench.results import BenchFigures
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Request, plan_request
from kvbridge.models import spec_from_hf_config
from kvbridge.models.presets import PRESETS
from kvbridge.transport.cache import RankCache
from kvbridge.transport.device_staging import DEFAULT_THRESHOLD_BYTES, StagedExecutor, choose_path
from kvbridge.transport.local import LocalExecutor


@dataclass
class StagingBench(BenchFigures):
    model: str
    prefill: str
    decode: str
    num_tokens: int
    device: str
    bytes: int
    num_runs: int
    mean_run_bytes: float
    default_choice: str  # what choose_path picks at the default threshold, e.g. "2 staged / 0 direct"
    staged_seconds: float
    direct_seconds: float
    direct_torch_seconds: float
    contiguous_seconds: float
    staged_over_direct: float  # > 1: staging is slower
    staged_over_direct_torch: float
    staged_over_contiguous: float
    direct_over_contiguous: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def bench_staging_pair(model: str, num_tokens: int, prefill: EngineLayout, decode: EngineLayout,
                       repeats: int = 5, device: str = "cpu", seed: int = 0) -> StagingBench:
    """One shape pair: staged, direct (both backends) and a contiguous copy, interleaved."""
    spec = spec_from_hf_config(PRESETS[model]) if model in PRESETS else spec_from_hf_config(model)
    rng = random.Random(seed)

    def sized(layout: EngineLayout) -> EngineLayout:  # just enough blocks: memory ~2x the request
        return msgspec.structs.replace(layout, num_blocks=-(-num_tokens // layout.block_size) + 1)

    prefill, decode = sized(prefill), sized(decode)

    def ids(layout: EngineLayout) -> tuple[tuple[int, ...], ...]:
        need = -(-num_tokens // layout.block_size)
        return tuple(tuple(rng.sample(range(layout.num_blocks), need)) for _ in spec.groups)

    plan = plan_request(spec, prefill, decode, Request(ids(prefill), ids(decode), num_tokens))
    src = RankCache.allocate_engine(spec, prefill, device, fill=None)
    dst = RankCache.allocate_engine(spec, decode, device, fill=None)
    for c in src:
        for r in c.byte_regions():
            r.fill_(7)
    dev = torch.device(device)
    staged = StagedExecutor(src, dst, threshold_bytes=2**62)  # every pair staged
    direct = LocalExecutor(src, dst)
    direct_torch = LocalExecutor(src, dst, backend="torch")
    a = torch.ones(plan.nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    moves = {"staged": lambda: staged.execute(plan), "direct": lambda: direct.execute(plan),
             "direct_torch": lambda: direct_torch.execute(plan), "contiguous": lambda: b.copy_(a)}
    for fn in moves.values():  # warm: numba compile, staging buffers, page faults
        fn()
    times: dict[str, list[float]] = {k: [] for k in moves}
    for _ in range(repeats):
        for name, fn in moves.items():
            times[name].append(_timed(fn, dev))
    med = {k: statistics.median(v) for k, v in times.items()}
    paths = [p.path for p in choose_path(plan, DEFAULT_THRESHOLD_BYTES)]
    return StagingBench(
        model=model, prefill=prefill.describe(), decode=decode.describe(), num_tokens=num_tokens, device=str(dev),
        bytes=plan.nbytes, num_runs=len(plan), mean_run_bytes=plan.stats.mean_run_bytes,
        default_choice=f"{paths.count('staged')} staged / {paths.count('direct')} direct",
        staged_seconds=med["staged"], direct_seconds=med["direct"], direct_torch_seconds=med["direct_torch"],
        contiguous_seconds=med["contiguous"], staged_over_direct=med["staged"] / med["direct"],
        staged_over_direct_torch=med["staged"] / med["direct_torch"],
        staged_over_contiguous=med["staged"] / med["contiguous"],
        direct_over_contiguous=med["direct"] / med["contiguous"])


def bench_staging(model: str = "llama-3-8b", num_tokens: int = 4096, repeats: int = 5,
                  device: str = "cpu") -> list[StagingBench]:
    """Llama-3-8B geometry, TP1 -> TP2 with HND on both sides (runs of whole head spans) and
    NHD -> HND (tiny runs: one head's row per token)."""
    pairs = [(EngineLayout(tp_size=1, block_size=16, kv_order="HND"), EngineLayout(tp_size=2, block_size=16, kv_order="HND")),
             (EngineLayout(tp_size=1, block_size=16, kv_order="NHD"), EngineLayout(tp_size=2, block_size=16, kv_order="HND"))]
    return [bench_staging_pair(model, num_tokens, p, d, repeats, device) for p, d in pairs]
