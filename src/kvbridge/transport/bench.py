"""Transport benchmark: one request moved between two processes by a real engine.

The prefill rank lives in a spawned child process, the decode ranks in this one (for `read`,
the decode ranks post; for `write`, the prefill rank posts from the child). Three ways to move
the same bytes are timed, interleaved repetition by repetition (the order rotates) so machine
noise hits all alike, and the medians compared:

- **ours**: the planner's coalesced runs, one submission per (decode rank, prefill rank) pair,
  all in flight together; the transport picks its path (direct, or staged for small runs);
- **contiguous**: the raw engine moving the same number of bytes as ONE descriptor between two
  contiguous registered buffers (staging cannot apply: one run is never small);
- **per-block**: one descriptor per block per layer per K/V (every run split at both sides'
  block boundaries), as vLLM's NIXL and Mooncake connectors issue them, posted directly.

Before timing, one transfer of `ours` is checked byte-exactly (`verify`). Absolute GB/s on
shared machines are noise; the ratios from one run are the result.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

import msgspec
import numpy as np

from kvbridge.layout import EngineLayout
from kvbridge.plan import Request, plan_request
from kvbridge.presets import PRESETS
from kvbridge.spec import ModelSpec
from kvbridge.transport.base import Runs
from kvbridge.transport.peer import AgentHost, PeerProcess, runs_between


@dataclass
class TransportBenchResult:
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
    per_block_gbps: float
    ratio_vs_contiguous: float
    ratio_vs_per_block: float
    ours_seconds: float
    contiguous_seconds: float
    per_block_seconds: float
    verified: bool
    setup_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


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
    """Median of `repeats` interleaved runs of ours vs one contiguous descriptor vs per-block descriptors.

    `prefill` defaults to TP=1 HND block 16 and `decode` to TP=2 HND block 16 (the core bench's
    shapes); the prefill engine must have TP=1 (one source process). `transport_options` go to
    the transport constructors (e.g. slot_bytes, stage_below, batch_size).
    """
    t_setup = time.perf_counter()
    spec = ModelSpec.from_hf_config(PRESETS[model]) if model in PRESETS else ModelSpec.from_hf_config(model)
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
    d_names = [f"bench-D{d}" for d in range(decode.tp_size)]
    child = PeerProcess()
    here = AgentHost()
    try:
        child.create(transport, "bench-P0", **opts)
        child.alloc("bench-P0", spec, prefill, 0, "pattern" if check else "const", request.src_block_ids,
                    num_tokens, seed=3)
        p_flat = child.alloc_bytes("bench-P0", nbytes, 7 if op == "read" else 0)
        for d, name in enumerate(d_names):
            here.create(transport, name, **opts)
            here.alloc(name, spec, decode, d, "const", seed=0)
        d_flat = here.alloc_bytes(d_names[0], nbytes, 0 if op == "read" else 7)
        p_meta = child.metadata("bench-P0")
        for name in d_names:
            here.connect(name, "bench-P0", p_meta)
            child.connect("bench-P0", name, here.metadata(name))

        # Who posts: the decode ranks here (read), or the prefill rank in the child (write).
        poster, who = (here, "D") if op == "read" else (child, "P")
        p_stride = int(prefill.addressing(spec, 0).block_stride[0, 0])
        ours, per_block = [], []
        for d, name in enumerate(d_names):
            runs = runs_between(plan, 0, d, op)
            d_stride = int(decode.addressing(spec, d).block_stride[0, 0])
            ls, rs = (d_stride, p_stride) if op == "read" else (p_stride, d_stride)
            pair = (name, "bench-P0") if op == "read" else ("bench-P0", name)
            ours.append((*pair, op, runs))
            per_block.append((*pair, op, split_at_blocks(runs, ls, rs)))
        one = np.array([0], np.int64)
        if op == "read":
            contiguous = [(d_names[0], "bench-P0", op, Runs(np.array([d_flat]), one, np.array([p_flat]), one,
                                                            np.array([nbytes])))]
        else:
            contiguous = [("bench-P0", d_names[0], op, Runs(np.array([p_flat]), one, np.array([d_flat]), one,
                                                            np.array([nbytes])))]
        agent0 = ours[0][0]
        stage_below = _attr(poster, agent0, "stage_below")
        staged = stage_below > 0 and nbytes < stage_below * len(plan)

        def run(batch, direct: bool = False) -> float:
            names = sorted({b[0] for b in batch})
            if direct:
                for n in names:
                    poster.set(n, stage_below=0)
            try:
                return poster.run_timed(batch)
            finally:
                if direct:
                    for n in names:
                        poster.set(n, stage_below=stage_below)

        # Warm up every path (connections, registrations, page faults, compiled copies), then verify.
        verified = False
        if check:
            for name in d_names:
                here.snapshot(name)
        run(ours)
        if check:
            bad = [m for name in d_names for m in here.verify(name, request)]
            if bad:
                raise RuntimeError(f"{transport} moved wrong bytes: {bad[:3]}")
            verified = True
        run(contiguous)
        run(per_block, direct=True)
        if op == "read" and not here.check_bytes(d_names[0], 0, 7):
            raise RuntimeError(f"{transport}: the contiguous transfer did not land")
        times: dict[str, list[float]] = {"ours": [], "contiguous": [], "per_block": []}
        order = ["ours", "contiguous", "per_block"]
        for i in range(repeats):
            for k in order[i % 3:] + order[: i % 3]:
                times[k].append(run({"ours": ours, "contiguous": contiguous, "per_block": per_block}[k],
                                    direct=k == "per_block"))
            if progress:
                progress(i + 1, repeats)
        med = {k: statistics.median(v) for k, v in times.items()}
        setup = time.perf_counter() - t_setup - sum(sum(v) for v in times.values())
    finally:
        here.close_all()
        child.close()
    return TransportBenchResult(
        transport=transport, model=model, prefill=prefill.describe(), decode=decode.describe(), op=op,
        num_tokens=num_tokens, bytes=nbytes, num_runs=len(plan), mean_run_bytes=nbytes / max(1, len(plan)),
        per_block_runs=sum(len(b[3]) for b in per_block), staged=staged, repeats=repeats,
        ours_gbps=nbytes / med["ours"] / 1e9, contiguous_gbps=nbytes / med["contiguous"] / 1e9,
        per_block_gbps=nbytes / med["per_block"] / 1e9, ratio_vs_contiguous=med["contiguous"] / med["ours"],
        ratio_vs_per_block=med["per_block"] / med["ours"], ours_seconds=med["ours"],
        contiguous_seconds=med["contiguous"], per_block_seconds=med["per_block"], verified=verified,
        setup_seconds=setup)


def _attr(host, name: str, attr: str):
    return host.get(name, attr)
