"""Benchmarks that report ratios measured side by side in one run.

The local executor moving one request is compared with a plain contiguous `copy_` of the same
number of bytes, alternating the two so that machine noise hits both alike; planning time is
reported as a fraction of the copy time and of the time the bytes take on a link
(`bench.planning`: cold, warm, and the token-by-token reference). Absolute numbers on shared machines are noise; the
ratios are the result.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from kvbridge.bench.planning import DEFAULT_LINK_GBPS, PlanningFigures, bench_planning
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Request, plan_request
from kvbridge.models import spec_from_hf_config
from kvbridge.models.presets import PRESETS
from kvbridge.transport.cache import RankCache
from kvbridge.transport.local import LocalExecutor


@dataclass
class BenchResult(PlanningFigures):
    model: str
    prefill: str
    decode: str
    num_tokens: int
    bytes: int
    num_runs: int
    mean_run_bytes: float
    repeats: int
    executor_gbps: float
    contiguous_gbps: float
    ratio: float
    copy_seconds: float
    contiguous_seconds: float
    plan_seconds: float
    plan_fraction: float
    backend: str



def bench_local(model: str = "llama-3-8b", num_tokens: int = 4096, prefill: EngineLayout | None = None,
                decode: EngineLayout | None = None, repeats: int = 7, seed: int = 0,
                progress=None, link_gbps: float = DEFAULT_LINK_GBPS) -> BenchResult:
    """Median of `repeats` interleaved runs of our executor vs a contiguous copy of the same bytes."""
    spec = spec_from_hf_config(PRESETS[model]) if model in PRESETS else spec_from_hf_config(model)
    rng = random.Random(seed)
    prefill = prefill or EngineLayout(tp_size=1, block_size=16, kv_order="HND")
    decode = decode or EngineLayout(tp_size=2, block_size=16, kv_order="HND")
    # Just enough blocks for the request, so memory stays near 2x the request's bytes.
    def sized(layout: EngineLayout) -> EngineLayout:
        import msgspec
        return msgspec.structs.replace(layout, num_blocks=-(-num_tokens // layout.block_size) + 1)
    prefill, decode = sized(prefill), sized(decode)

    def ids(layout: EngineLayout) -> tuple[tuple[int, ...], ...]:
        need = -(-num_tokens // layout.block_size)
        return tuple(tuple(rng.sample(range(layout.num_blocks), need)) for _ in spec.groups)

    request = Request(ids(prefill), ids(decode), num_tokens)
    src = RankCache.allocate_engine(spec, prefill, fill=None)
    dst = RankCache.allocate_engine(spec, decode, fill=None)
    for c in src:
        for r in c.byte_regions():
            r.fill_(7)
    executor = LocalExecutor(src, dst)
    plan = plan_request(spec, prefill, decode, request)  # warm: addressing cache, numpy
    a = torch.ones(plan.nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    executor.execute(plan)  # warm: numba compile, page faults
    b.copy_(a)
    planning = bench_planning(spec, prefill, decode, request.src_block_ids, request.dst_block_ids, num_tokens,
                              link_gbps)
    ours, contiguous = [], []
    for i in range(repeats):
        ours.append(executor.execute(plan))
        t0 = time.perf_counter()
        b.copy_(a)
        contiguous.append(time.perf_counter() - t0)
        if progress:
            progress(i + 1, repeats)
    copy_s, cont_s = (statistics.median(x) for x in (ours, contiguous))
    plan_s = planning.plan_warm_seconds
    return BenchResult(
        model=model, prefill=prefill.describe(), decode=decode.describe(), num_tokens=num_tokens,
        bytes=plan.nbytes, num_runs=len(plan), mean_run_bytes=plan.stats.mean_run_bytes, repeats=repeats,
        executor_gbps=plan.nbytes / copy_s / 1e9, contiguous_gbps=plan.nbytes / cont_s / 1e9,
        ratio=cont_s / copy_s, copy_seconds=copy_s, contiguous_seconds=cont_s, plan_seconds=plan_s,
        plan_fraction=plan_s / copy_s, backend=executor.backend, **planning.to_dict())
