"""Offload throughput beside a contiguous copy of the same bytes, measured in one run.

One store job (device -> CPU pool) and one load job (pool -> device) of a whole request, every
KV-cache group, alternate with a plain contiguous `copy_` of as many bytes; each figure is the
median of `repeats` such rounds, so machine noise hits both alike. The ratio, not the absolute
GB/s, is the result on shared machines. Job seconds are what the worker reports (the copy call);
planning happens in `submit` and is reported on its own.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from kvbridge.bench.results import BenchFigures
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.models import spec_from_hf_config
from kvbridge.models.presets import PRESETS
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.spec import CPULoadStoreSpec, GPULoadStoreSpec, cdiv
from kvbridge.offload.worker import OffloadWorker
from kvbridge.transport.cache import RankCache


@dataclass
class OffloadBenchResult(BenchFigures):
    model: str
    device: str
    pool: str
    num_tokens: int
    num_groups: int
    bytes: int
    num_runs: int
    mean_run_bytes: float
    repeats: int
    store_gbps: float
    load_gbps: float
    contiguous_gbps: float
    store_ratio: float
    load_ratio: float
    store_seconds: float
    load_seconds: float
    contiguous_seconds: float
    plan_seconds: float
    backend: str


    def summary(self) -> str:
        return (f"{self.model} {self.num_tokens} tokens, {self.num_groups} group(s), {self.bytes / 2**20:.1f} MiB in "
                f"{self.num_runs} runs ({self.mean_run_bytes / 1024:.1f} KiB mean), device [{self.device}] <-> "
                f"{self.pool}: store {self.store_gbps:.2f} GB/s ({self.store_ratio:.2f}x contiguous), load "
                f"{self.load_gbps:.2f} GB/s ({self.load_ratio:.2f}x), contiguous {self.contiguous_gbps:.2f} GB/s, "
                f"planning {self.plan_seconds * 1e3:.2f} ms per job; median of {self.repeats}")


def _model(model: str | ModelSpec) -> tuple[str, ModelSpec]:
    if isinstance(model, ModelSpec):
        return model.name, model
    return model, spec_from_hf_config(PRESETS[model] if model in PRESETS else model)


def bench_offload(model: str | ModelSpec = "llama-3-8b", num_tokens: int = 4096, block_size: int = 16,
                  block_size_factor: int = 1, tp_size: int = 1, canonical: bool = False,
                  device_layout: EngineLayout | None = None, repeats: int = 7, seed: int = 0,
                  progress=None, device: str = "cpu", cuda_copy: str = "auto") -> OffloadBenchResult:
    """Store and load one request of `num_tokens` tokens (every group, full blocks, scattered ids).

    On `device="cuda"` the engine's cache is on the GPU and the pool pinned; the contiguous
    figure is then a plain device -> pinned host copy of as many bytes (store) and back (load).
    """
    name, spec = _model(model)
    rng = np.random.default_rng(seed)
    obs = block_size * block_size_factor
    n = cdiv(num_tokens, block_size)
    per_group = cdiv(n, block_size_factor)
    layout = device_layout or EngineLayout(tp_size=tp_size, block_size=block_size, kv_order="HND")
    layout = msgspec.structs.replace(layout, block_size=block_size, num_blocks=n + 1)
    groups = len(spec.groups)
    slots = groups * per_group + 1
    cuda = torch.device(device).type == "cuda"
    pool = (CPUPool.canonical(spec, obs, slots, pin_memory=cuda, kernel_tokens=block_size) if canonical
            else CPUPool.mirror(spec, layout, block_size_factor, slots, pin_memory=cuda))
    ranks = RankCache.allocate_engine(spec, layout, device=device, fill=None)
    for c in ranks:
        for r in c.byte_regions():
            r.fill_(7)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gpu = GPULoadStoreSpec(np.concatenate([rng.permutation(layout.num_blocks)[:n] for _ in range(groups)]),
                           [n] * groups, [0] * groups)
    cpu = CPULoadStoreSpec(rng.permutation(slots)[:groups * per_group])
    with OffloadWorker(ranks, pool, cuda_copy=cuda_copy) as worker:
        _, runs = worker.plan((gpu, cpu))
        a = torch.ones(runs.nbytes, dtype=torch.uint8, device=device)
        b = torch.empty(runs.nbytes, dtype=torch.uint8, pin_memory=cuda)

        def job(spec_pair) -> tuple[float, float]:
            t0 = time.perf_counter()
            job_id = worker.submit(spec_pair)
            planned = time.perf_counter() - t0
            worker.wait([job_id])
            (res,) = worker.get_finished()
            if not res.success:
                raise RuntimeError(f"offload job {job_id} failed: {worker.error(job_id)!r}")
            return res.seconds, planned

        def contiguous(dst: torch.Tensor, src: torch.Tensor) -> float:
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            sync()
            return time.perf_counter() - t0

        job((gpu, cpu)), job((cpu, gpu)), contiguous(b, a), contiguous(a, b)  # warm: JIT, page faults
        stores, loads, conts, plans = [], [], [], []
        for i in range(repeats):
            s, p1 = job((gpu, cpu))
            c1 = contiguous(b, a)
            ld, p2 = job((cpu, gpu))
            c2 = contiguous(a, b)
            stores.append(s)
            loads.append(ld)
            conts.append((c1, c2))
            plans += [p1, p2]
            if progress:
                progress(i + 1, repeats)
        backend = worker.backend
    st, ld, pl = (statistics.median(x) for x in (stores, loads, plans))
    c_store, c_load = (statistics.median(c[i] for c in conts) for i in (0, 1))  # same direction as the job
    ct = statistics.median(c for pair in conts for c in pair)
    nbytes = runs.nbytes
    return OffloadBenchResult(
        model=name, device=layout.describe(), pool=pool.describe(), num_tokens=num_tokens, num_groups=groups,
        bytes=nbytes, num_runs=len(runs), mean_run_bytes=nbytes / max(1, len(runs)), repeats=repeats,
        store_gbps=nbytes / st / 1e9, load_gbps=nbytes / ld / 1e9, contiguous_gbps=nbytes / ct / 1e9,
        store_ratio=c_store / st, load_ratio=c_load / ld, store_seconds=st, load_seconds=ld, contiguous_seconds=ct,
        plan_seconds=pl, backend=backend)


__all__ = ["OffloadBenchResult", "bench_offload"]
