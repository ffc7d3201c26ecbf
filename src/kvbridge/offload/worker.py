"""The worker side: asynchronous store (device -> CPU) and load (CPU -> device) jobs.

`submit((src_spec, dst_spec))` plans the job at once (so a bad spec raises there, before any byte
moves) and queues its copy; `get_finished()` polls, returning `(job_id, success, bytes, seconds)`
for jobs that are done, in submission order per direction. The two directions are independent;
inside a direction jobs run strictly in order, as vLLM's handlers do.

Data movement is one call per job over a run list that covers every group and layer:
* CPU tensors: kvbridge's compiled executor `copy_runs` (numba, parallel memcpy over region base
  addresses) on a per-direction background thread; numba releases the GIL, so the caller keeps
  running. Timing is the copy itself.
* CUDA tensors: the pool is pinned host memory; each job takes a stream from a pool, a store's
  stream first waits for the compute stream (the KV it copies must have been written), every job
  waits for the previous job's end event (FIFO), and the runs are issued as asynchronous copies
  between start and end events, which time it. Completion is polled with `Event.query()`.
  With Triton and a pinned pool (the default, `cuda_copy="auto"`), one launch of the plan
  executor's copy kernel (`transport.copy_cuda`) moves every run: the device reaches pinned host
  memory through its unified address, so thousands of small runs cost one launch, not one
  `cudaMemcpyAsync` each (the "memcpy" mode, vLLM's fallback path, kept for pageable pools).
  docs/gpu.md has both measured beside a plain host<->device copy.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import NamedTuple, Protocol

import numpy as np
import torch

from kvbridge.errors import IncompatibleEngines
from kvbridge.transport.cache import RankCache
from kvbridge.offload.errors import SpecMismatch
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.spec import GPULoadStoreSpec, TransferSpec
from kvbridge.offload.transfer import JobPlanner, JobRuns
from kvbridge.transport import copy_cuda
from kvbridge.transport.copy import copy_addresses, copy_runs

STORE = ("GPU", "CPU")
LOAD = ("CPU", "GPU")

# numba's default "workqueue" threading layer must not be entered from two threads at once; the
# two direction threads therefore take turns (they share one memory bus anyway).
_COPY_LOCK = threading.Lock()


class TransferResult(NamedTuple):
    job_id: int
    success: bool
    bytes: int
    seconds: float


class _Handler(Protocol):
    def launch(self, job_id: int, runs: JobRuns) -> None: ...
    def poll(self) -> list[TransferResult]: ...
    def wait(self, job_ids: set[int] | None) -> None: ...
    def shutdown(self) -> None: ...


def _base_addresses(regions: Sequence[torch.Tensor]) -> np.ndarray:
    return np.array([r.data_ptr() for r in regions], dtype=np.int64)


class _CpuHandler:
    """One direction between CPU tensors: a FIFO thread, one `copy_runs` call per job."""

    def __init__(self, name: str, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], parallel: bool = True):
        self._src, self._dst = list(src), list(dst)  # keep the memory alive while addresses are in use
        self._src_addr, self._dst_addr = _base_addresses(src), _base_addresses(dst)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvbridge-offload-{name}")
        self._jobs: deque[tuple[int, int, Future]] = deque()
        self.errors: dict[int, BaseException] = {}
        self.parallel = parallel
        empty = np.zeros(0, dtype=np.int64)
        if parallel:
            with _COPY_LOCK:  # compile now (once per process), so no job's time includes the JIT
                copy_runs(self._src_addr, self._dst_addr, empty, empty, empty, empty, empty)
        else:  # never start numba's parallel runtime (OpenMP) in this process: see `OffloadWorker`
            copy_addresses(empty, empty, empty)

    def _copy(self, runs: JobRuns) -> float:
        if not self.parallel:
            t0 = time.perf_counter()
            copy_addresses(self._src_addr[runs.src_region] + runs.src_offset,
                           self._dst_addr[runs.dst_region] + runs.dst_offset, runs.length)
            return time.perf_counter() - t0
        with _COPY_LOCK:
            t0 = time.perf_counter()
            if len(runs):
                copy_runs(self._src_addr, self._dst_addr, runs.src_region, runs.src_offset, runs.dst_region,
                          runs.dst_offset, runs.length)
            return time.perf_counter() - t0

    def launch(self, job_id: int, runs: JobRuns) -> None:
        self._jobs.append((job_id, runs.nbytes, self._thread.submit(self._copy, runs)))

    def poll(self) -> list[TransferResult]:
        out = []
        while self._jobs and self._jobs[0][2].done():
            job_id, nbytes, fut = self._jobs.popleft()
            err = fut.exception()
            if err is not None:
                self.errors[job_id] = err
                out.append(TransferResult(job_id, False, 0, 0.0))
            else:
                out.append(TransferResult(job_id, True, nbytes, fut.result()))
        return out

    def wait(self, job_ids: set[int] | None) -> None:
        wait_futures([f for j, _, f in list(self._jobs) if job_ids is None or j in job_ids])

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


def cuda_copy_mode(requested: str, host: Sequence[torch.Tensor]) -> str:
    """How CUDA jobs move runs: "kernel" (one Triton launch; the device reads and writes the pinned
    pool through its unified address) or "memcpy" (one `cudaMemcpyAsync` per run). "auto" takes the
    kernel when Triton is there and every pool region is pinned (a pageable one has no device address)."""
    if requested not in ("auto", "kernel", "memcpy"):
        raise IncompatibleEngines(f"cuda_copy is auto, kernel or memcpy, not {requested!r}")
    usable = copy_cuda.available() and all(r.is_pinned() for r in host)
    if requested == "kernel" and not usable:
        raise IncompatibleEngines("cuda_copy='kernel' needs Triton and a pinned pool")
    return "memcpy" if requested == "memcpy" or not usable else "kernel"


class _CudaHandler:  # pragma: no cover - needs a CUDA device
    """One direction with a CUDA device: pooled streams and timing events, FIFO by end events."""

    def __init__(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], store: bool, device: torch.device,
                 kernel: bool = False):
        self._src, self._dst, self._store, self._device = list(src), list(dst), store, device
        self._kernel = kernel
        self._src_addr, self._dst_addr = _base_addresses(src), _base_addresses(dst)
        self._streams: list[torch.cuda.Stream] = []
        self._events: list[torch.cuda.Event] = []
        self._jobs: deque[tuple[int, int, torch.cuda.Stream, torch.cuda.Event, torch.cuda.Event]] = deque()
        self.errors: dict[int, BaseException] = {}

    def _event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def launch(self, job_id: int, runs: JobRuns) -> None:
        stream = self._streams.pop() if self._streams else torch.cuda.Stream(device=self._device)
        start, end = self._event(), self._event()
        if self._store:  # copy only what the compute stream has finished writing
            stream.wait_stream(torch.cuda.current_stream(self._device))
        if self._jobs:  # strict FIFO per direction
            stream.wait_event(self._jobs[-1][4])
        with torch.cuda.stream(stream):
            if self._kernel:  # upload the triples before the start event, so the event times the copy
                pieces = copy_cuda.prepare(self._src_addr[runs.src_region] + runs.src_offset,
                                           self._dst_addr[runs.dst_region] + runs.dst_offset, runs.length, self._device)
            start.record(stream)
            if self._kernel:
                copy_cuda.launch(pieces)
            else:
                cols = [a.tolist() for a in (runs.src_region, runs.src_offset, runs.dst_region, runs.dst_offset,
                                             runs.length)]
                for sr, so, dr, do, ln in zip(*cols):
                    self._dst[dr][do:do + ln].copy_(self._src[sr][so:so + ln], non_blocking=True)
            end.record(stream)
        self._jobs.append((job_id, runs.nbytes, stream, start, end))

    def poll(self) -> list[TransferResult]:
        out = []
        while self._jobs and self._jobs[0][4].query():
            job_id, nbytes, stream, start, end = self._jobs.popleft()
            out.append(TransferResult(job_id, True, nbytes, start.elapsed_time(end) / 1000.0))
            self._streams.append(stream)
            self._events += [start, end]
        return out

    def wait(self, job_ids: set[int] | None) -> None:
        for job_id, *_, end in list(self._jobs):
            if job_ids is None or job_id in job_ids:
                end.synchronize()

    def shutdown(self) -> None:
        self.wait(None)
        self._streams.clear()
        self._events.clear()


class OffloadWorker:
    """Moves offloaded blocks between some ranks of one device engine and a CPU pool.

    `parallel=False` copies in the worker's own thread only (numba's serial loop): inside an
    engine process whose kernels use OpenMP (vLLM CPU attention checks its thread count against
    the one its metadata was built with), numba's parallel runtime must never start.
    """

    def __init__(self, device: Sequence[RankCache], pool: CPUPool, parallel: bool = True, cuda_copy: str = "auto"):
        device = list(device)
        if not device:
            raise IncompatibleEngines("an offload worker needs at least one device rank cache")
        spec, layout = device[0].spec, device[0].layout
        for c in device:
            if c.spec != spec or c.layout != layout:
                raise IncompatibleEngines(f"device rank {c.rank} has another geometry or layout than rank "
                                          f"{device[0].rank}; one worker serves one engine")
        self.spec, self.layout, self.device, self.pool = spec, layout, device, pool
        self.planner = JobPlanner(spec, layout, [c.rank for c in device], pool)
        dev = [r for c in device for r in c.byte_regions()]
        host = pool.byte_regions()
        if any(r.device.type != "cpu" for r in host):
            raise IncompatibleEngines("the offload pool must live in host memory")
        devices = {r.device for r in dev}
        if len(devices) > 1:
            raise IncompatibleEngines(f"device rank caches span several devices {sorted(map(str, devices))}; "
                                      f"use one worker per device")
        dev_device = next(iter(devices))
        self.backend = "cuda" if dev_device.type == "cuda" else "cpu"
        if self.backend == "cuda":  # pragma: no cover - needs a CUDA device
            kernel = cuda_copy_mode(cuda_copy, host) == "kernel"
            self.backend = "cuda-kernel" if kernel else "cuda-memcpy"
            self._handlers: dict[tuple[str, str], _Handler] = {
                STORE: _CudaHandler(dev, host, True, dev_device, kernel),
                LOAD: _CudaHandler(host, dev, False, dev_device, kernel)}
        else:
            self._handlers = {STORE: _CpuHandler("store", dev, host, parallel),
                              LOAD: _CpuHandler("load", host, dev, parallel)}
        self._ids = itertools.count(1)

    @property
    def block_size_factor(self) -> int:
        return self.planner.factor

    def plan(self, job: TransferSpec) -> tuple[tuple[str, str], JobRuns]:
        """The transfer type and run list of a job, without running it."""
        if not (isinstance(job, tuple) and len(job) == 2):
            raise SpecMismatch(f"a job is a (source spec, destination spec) pair, got {type(job).__name__}")
        src, dst = job
        pair = (src.medium(), dst.medium())
        if pair not in (STORE, LOAD):
            raise SpecMismatch(f"no handler moves {pair[0]} -> {pair[1]}; this worker handles GPU -> CPU and "
                               f"CPU -> GPU")
        gpu, cpu = (src, dst) if pair == STORE else (dst, src)
        if not isinstance(gpu, GPULoadStoreSpec):
            raise SpecMismatch(f"the device side of a job must be a GPULoadStoreSpec, got {type(gpu).__name__}")
        return pair, self.planner.plan(gpu, cpu, store=pair == STORE)  # type: ignore[arg-type]

    def submit(self, job: TransferSpec) -> int:
        """Plan and queue one job; returns its id (1, 2, ...)."""
        pair, runs = self.plan(job)
        job_id = next(self._ids)
        self._handlers[pair].launch(job_id, runs)
        return job_id

    def get_finished(self) -> list[TransferResult]:
        return [r for h in self._handlers.values() for r in h.poll()]

    def wait(self, job_ids: Iterable[int] | None = None) -> None:
        """Block until the given jobs (default: all in flight) are done; they are still reported by `get_finished`."""
        ids = None if job_ids is None else set(job_ids)
        for h in self._handlers.values():
            h.wait(ids)

    def error(self, job_id: int) -> BaseException | None:
        """Why a job reported `success=False`."""
        for h in self._handlers.values():
            if job_id in getattr(h, "errors", {}):
                return h.errors[job_id]  # type: ignore[attr-defined]
        return None

    def shutdown(self) -> None:
        for h in self._handlers.values():
            h.shutdown()

    def __enter__(self) -> OffloadWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["LOAD", "STORE", "OffloadWorker", "TransferResult"]
