"""What the end-to-end checksum (`ConnectorConfig.checksum`) costs beside the transfer it checks.

Why a bench: the checksum is on the critical path twice (a prefill rank computes its share
before announcing a request, a decode rank recomputes over what landed before reporting it), so
its cost adds to every transfer's latency. Its default follows the measurement: on when under
`THRESHOLD` of the transfer time.

The transfer time is `bench_transport`'s median for "ours" (same model, tokens and layouts); the
checksum time is the slowest prefill rank's `contribution_checksums` plus the slowest decode
rank's `destination_checksums`, each the median of `repeats` runs on caches of those layouts.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from kvbridge.bench.transport import bench_transport
from kvbridge.core.integrity import contribution_checksums, destination_checksums
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Request
from kvbridge.models import spec_from_hf_config
from kvbridge.models.presets import PRESETS
from kvbridge.transport.cache import RankCache

THRESHOLD = 0.05


@dataclass
class ChecksumBenchResult:
    transport: str
    model: str
    num_tokens: int
    bytes: int
    transfer_seconds: float
    source_checksum_seconds: float
    destination_checksum_seconds: float
    overhead: float  # checksum seconds / transfer seconds
    default_on: bool  # overhead < THRESHOLD

    def to_dict(self) -> dict:
        return asdict(self)


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_checksum(transport: str = "shm", model: str = "llama-3-8b", num_tokens: int = 1024,
                   decode_tp: int = 2, repeats: int = 3) -> ChecksumBenchResult:
    prefill = EngineLayout(tp_size=1, block_size=16, kv_order="HND")
    decode = EngineLayout(tp_size=decode_tp, block_size=16, kv_order="HND")
    moved = bench_transport(transport, model, num_tokens, prefill, decode, repeats=repeats, check=False)
    spec = spec_from_hf_config(PRESETS[model]) if model in PRESETS else spec_from_hf_config(model)
    blocks = -(-num_tokens // 16)
    p = EngineLayout(tp_size=1, block_size=16, kv_order="HND", num_blocks=blocks)
    d = EngineLayout(tp_size=decode_tp, block_size=16, kv_order="HND", num_blocks=blocks)
    ids = (tuple(range(blocks)),) * len(spec.groups)
    request = Request(ids, ids, num_tokens, 0)
    src = RankCache.allocate(spec, p, 0)
    src_s = _median_seconds(lambda: contribution_checksums(src, request, d), repeats)
    dst_s = max(_median_seconds(lambda c=RankCache.allocate(spec, d, r): destination_checksums([c], request), repeats)
                for r in range(decode_tp))
    overhead = (src_s + dst_s) / moved.ours_seconds
    return ChecksumBenchResult(transport, model, num_tokens, moved.bytes, moved.ours_seconds, src_s, dst_s, overhead,
                               overhead < THRESHOLD)


__all__ = ["THRESHOLD", "ChecksumBenchResult", "bench_checksum"]
