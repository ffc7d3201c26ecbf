"""Transport benchmark: one request moved between processes by a real engine.

The prefill rank and every decode rank live in their own spawned process, as in a deployment
(for `read`, each decode rank posts its reads; for `write`, the prefill rank posts its writes).
The ways to move the same bytes are timed, interleaved repetition by repetition (the order
rotates) so machine noise hits all alike, and the medians compared. A measurement starts every
poster at one instant on the host's monotonic clock and ends at the last completion.

- **ours**: the planner's coalesced runs, one submission per (decode rank, prefill rank) pair,
  all in flight together; the transport picks its path (direct, or staged for small runs);
- **contiguous**: the raw engine moving the same number of bytes as ONE descriptor between two
  contiguous registered buffers, posted by one process (staging cannot apply);
- **contiguous per rank**: each decode rank's share as one descriptor, all posted at once from
  the same processes as ours: the same concurrency, only the descriptors differ;
- **per-block**: one descriptor per block per layer per K/V (every run split at both sides'
  block boundaries), as vLLM's NIXL and Mooncake connectors issue them, posted directly.

The baselines run on agents of their own (same processes, same memory sizes) with the engine
settings our agents use (NIXL without its progress thread, Mooncake polled without blocking:
both make every way faster, the contiguous ones included) but with none of the options that
tune our path (staging, `transport_options`). Before timing, one transfer of `ours` is checked
byte-exactly (`verify`). Absolute GB/s on shared machines are noise; the ratios from one run are
the result.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import msgspec
import numpy as np

from kvbridge.bench.results import BenchFigures
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Request, plan_request
from kvbridge.models import spec_from_hf_config
from kvbridge.models.presets import PRESETS
from kvbridge.testing.peer import PeerProcess, runs_between
from kvbridge.transport.base import Runs


@dataclass
class TransportBenchResult(BenchFigures):
    transport: str
    model: str
    prefill: str
    decode: str
    op: str
    num_tokens: int
    bytes: int
    num_runs: int
    mean_run_bytes: float
    per_block_runs: int
    staged: bool
    repeats: int
    ours_gbps: float
    contiguous_gbps: float
    contiguous_per_rank_gbps: float
    per_block_gbps: float
    ratio_vs_contiguous: float
    ratio_vs_contiguous_per_rank: float
    ratio_vs_per_block: float
    ours_seconds: float
    contiguous_seconds: float
    contiguous_per_rank_seconds: float
    per_block_seconds: float
    verified: bool
    setup_seconds: float



def split_at_blocks(runs: Runs, local_stride: int, remote_stride: int) -> Runs:
    """Cut every run at multiples of `local_stride` (local offsets) and `remote_stride` (remote)."""
    arrays = [runs.local_region, runs.local_offset, runs.remote_region, runs.remote_offset, runs.length]
    for which, stride in ((1, local_stride), (3, remote_stride)):
        lr, lo, rr, ro, ln = arrays
        off = arrays[which]
        first = off // stride
        count = (off + ln - 1) // stride - first + 1
        idx = np.repeat(np.arange(len(ln)), count)
        k = np.arange(len(idx)) - np.repeat(np.cumsum(count) - count, count)
        start = np.maximum(off[idx], (first[idx] + k) * stride)
        end = np.minimum(off[idx] + ln[idx], (first[idx] + k + 1) * stride)
        delta = start - off[idx]
        arrays = [lr[idx], lo[idx] + delta, rr[idx], ro[idx] + delta, end - start]
    return Runs(*(np.ascontiguousarray(a, np.int64) for a in arrays))


def bench_transport(transport: str = "nixl", model: str = "llama-3-8b", num_tokens: int = 1024,
                    prefill: EngineLayout | None = None, decode: EngineLayout | None = None, op: str = "read",
                    repeats: int = 5, seed: int = 0, check: bool = True, transport_options: dict | None = None,
                    progress=None) -> TransportBenchResult:
    """Median of `repeats` interleaved runs of ours vs the contiguous and per-block baselines.

    `prefill` defaults to TP=1 HND block 16 and `decode` to TP=2 HND block 16 (the core bench's
    shapes); the prefill engine must have TP=1 (one source process). `transport_options` go to
    the transport constructors (e.g. slot_bytes, stage_below, batch_size).
    """
    t_setup = time.perf_counter()
    spec = spec_from_hf_config(PRESETS[model]) if model in PRESETS else spec_from_hf_config(model)
    prefill = prefill or EngineLayout(tp_size=1, block_size=16, kv_order="HND")
    decode = decode or EngineLayout(tp_size=2, block_size=16, kv_order="HND")
    if prefill.tp_size != 1:
        raise ValueError("bench_transport runs one prefill rank; use a prefill layout with tp_size=1")
    if op not in ("read", "write"):
        raise ValueError(f"op must be 'read' or 'write', got {op!r}")

    def sized(layout: EngineLayout) -> EngineLayout:
        return msgspec.structs.replace(layout, num_blocks=-(-num_tokens // layout.block_size) + 1)

    prefill, decode = sized(prefill), sized(decode)
    rng = random.Random(seed)

    def ids(layout: EngineLayout) -> tuple[tuple[int, ...], ...]:
        need = -(-num_tokens // layout.block_size)
        return tuple(tuple(rng.sample(range(layout.num_blocks), need)) for _ in spec.groups)

    request = Request(ids(prefill), ids(decode), num_tokens)
    plan = plan_request(spec, prefill, decode, request)
    nbytes = plan.nbytes
    opts = dict(transport_options or {})
    opts.setdefault("timeout_s", 120.0)
    # The baselines run on their own agents in the engine's default configuration, posted
    # directly: options that tune our path (staging, threads) never touch the baselines.
    raw_opts = {"timeout_s": opts["timeout_s"], "stage_below": 0, "staging_bytes": 0}
    share = [int(plan.length[plan.dst_rank == d].sum()) for d in range(decode.tp_size)]
    p_proc: PeerProcess | None = None
    d_procs: list[PeerProcess] = []
    try:
        p_proc = PeerProcess()
        d_procs = [PeerProcess() for _ in range(decode.tp_size)]
        owner: dict[str, PeerProcess] = {}
        p_flat = d_flat = None
        for tag, options in (("", opts), ("-raw", raw_opts)):
            p_name = f"bench-P0{tag}"
            p_proc.create(transport, p_name, **options)
            p_proc.alloc(p_name, spec, prefill, 0, "pattern" if check else "const", request.src_block_ids,
                         num_tokens, seed=3)
            owner[p_name] = p_proc
            if tag:
                p_flat = p_proc.alloc_bytes(p_name, nbytes, 7 if op == "read" else 0)
                d_flat = []
            for d, proc in enumerate(d_procs):
                name = f"bench-D{d}{tag}"
                proc.create(transport, name, **options)
                proc.alloc(name, spec, decode, d, "const", seed=0)
                owner[name] = proc
                if tag:  # D0's flat buffer takes all the bytes (the one-descriptor baseline)
                    d_flat.append(proc.alloc_bytes(name, nbytes if d == 0 else share[d], 0 if op == "read" else 7))
            p_meta = p_proc.metadata(p_name)
            for proc, d in zip(d_procs, range(decode.tp_size)):
                proc.connect(f"bench-D{d}{tag}", p_name, p_meta)
                p_proc.connect(p_name, f"bench-D{d}{tag}", proc.metadata(f"bench-D{d}{tag}"))

        # Who posts: each decode rank in its own process (read), or the prefill rank (write).
        p_stride = int(prefill.addressing(spec, 0).block_stride[0, 0])
        p_start = np.concatenate([[0], np.cumsum(share)[:-1]]).astype(np.int64)

        def pair(d: int, tag: str = "") -> tuple[str, str]:
            return (f"bench-D{d}{tag}", f"bench-P0{tag}") if op == "read" else (f"bench-P0{tag}", f"bench-D{d}{tag}")

        def flat(d_region: int, d_offset: int, p_offset: int, length: int) -> Runs:
            d_side = (np.array([d_region]), np.array([d_offset]))
            p_side = (np.array([p_flat]), np.array([p_offset]))
            local, remote = (d_side, p_side) if op == "read" else (p_side, d_side)
            return Runs(*local, *remote, np.array([length]))

        ours, per_block, per_rank = [], [], []
        for d in range(decode.tp_size):
            runs = runs_between(plan, 0, d, op)
            d_stride = int(decode.addressing(spec, d).block_stride[0, 0])
            ls, rs = (d_stride, p_stride) if op == "read" else (p_stride, d_stride)
            ours.append((*pair(d), op, runs))
            per_block.append((*pair(d, "-raw"), op, split_at_blocks(runs, ls, rs)))
            per_rank.append((*pair(d, "-raw"), op, flat(d_flat[d], 0, int(p_start[d]), share[d])))
        contiguous = [(*pair(0, "-raw"), op, flat(d_flat[0], 0, 0, nbytes))]
        stage_below = owner[ours[0][0]].get(ours[0][0], "stage_below")
        staged = stage_below > 0 and nbytes < stage_below * len(plan)

        def run(batch) -> float:
            """Each poster's share submitted in its own process at one instant; first submit to last done."""
            by_proc: dict[int, tuple[PeerProcess, list]] = {}
            for b in batch:
                proc = owner[b[0]]
                by_proc.setdefault(id(proc), (proc, []))[1].append(b)
            start_at = time.monotonic() + 0.05
            for proc, part in by_proc.values():
                proc.begin("run_at", part, start_at)
            spans = [proc.finish(600.0) for proc, _ in by_proc.values()]
            return max(e for _, e in spans) - min(s for s, _ in spans)

        # Warm up every path (connections, registrations, page faults, compiled copies), then verify.
        verified = False
        d_names = [f"bench-D{d}" for d in range(decode.tp_size)]
        if check:
            for proc, name in zip(d_procs, d_names):
                proc.snapshot(name)
        run(ours)
        if check:
            bad = [m for proc, name in zip(d_procs, d_names) for m in proc.verify(name, request)]
            if bad:
                raise RuntimeError(f"{transport} moved wrong bytes: {bad[:3]}")
            verified = True
        run(contiguous)
        if op == "read" and not d_procs[0].check_bytes("bench-D0-raw", 0, 7):
            raise RuntimeError(f"{transport}: the contiguous transfer did not land")
        run(per_rank)
        run(per_block)
        batches = {"ours": ours, "contiguous": contiguous, "per_rank": per_rank, "per_block": per_block}
        times: dict[str, list[float]] = {k: [] for k in batches}
        order = list(batches)
        for i in range(repeats):
            for k in order[i % len(order):] + order[: i % len(order)]:
                times[k].append(run(batches[k]))
            if progress:
                progress(i + 1, repeats)
        med = {k: statistics.median(v) for k, v in times.items()}
        setup = time.perf_counter() - t_setup - sum(sum(v) for v in times.values())
    finally:
        for proc in [*d_procs, *([p_proc] if p_proc else [])]:
            proc.close()
    return TransportBenchResult(
        transport=transport, model=model, prefill=prefill.describe(), decode=decode.describe(), op=op,
        num_tokens=num_tokens, bytes=nbytes, num_runs=len(plan), mean_run_bytes=nbytes / max(1, len(plan)),
        per_block_runs=sum(len(b[3]) for b in per_block), staged=staged, repeats=repeats,
        ours_gbps=nbytes / med["ours"] / 1e9, contiguous_gbps=nbytes / med["contiguous"] / 1e9,
        contiguous_per_rank_gbps=nbytes / med["per_rank"] / 1e9,
        per_block_gbps=nbytes / med["per_block"] / 1e9, ratio_vs_contiguous=med["contiguous"] / med["ours"],
        ratio_vs_contiguous_per_rank=med["per_rank"] / med["ours"],
        ratio_vs_per_block=med["per_block"] / med["ours"], ours_seconds=med["ours"],
        contiguous_seconds=med["contiguous"], contiguous_per_rank_seconds=med["per_rank"],
        per_block_seconds=med["per_block"], verified=verified, setup_seconds=setup)
