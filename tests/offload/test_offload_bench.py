"""Smoke tests of the offload benchmark (no timing assertions: ratios are measured, not promised here)."""

from __future__ import annotations

import pytest

from kvbridge.core.layout import EngineLayout
from kvbridge.bench.offload import bench_offload
from kvbridge.core.spec import ModelSpec

SMALL = ModelSpec.uniform(4, 4, 16, "bfloat16", name="small", kinds=("sliding", "full"), window=64)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(canonical=True, tp_size=2, block_size_factor=2),
    dict(device_layout=EngineLayout(kv_order="NHD", kv_placement="blocks_first"), block_size_factor=4),
])
def test_bench_offload_runs_and_reports(kwargs):
    calls = []
    r = bench_offload(SMALL, num_tokens=256, block_size=16, repeats=2, progress=lambda i, n: calls.append((i, n)),
                      **kwargs)
    assert r.bytes == 256 * SMALL.bytes_per_token()  # every group, every layer, each head once
    assert r.num_groups == 2 and r.num_runs > 0 and calls == [(1, 2), (2, 2)]
    assert r.store_gbps > 0 and r.load_gbps > 0 and r.contiguous_gbps > 0 and r.store_ratio > 0 and r.load_ratio > 0
    assert r.backend == "cpu" and "store" in r.summary() and r.to_dict()["bytes"] == r.bytes


def test_bench_offload_preset():
    r = bench_offload("llama-3-8b", num_tokens=32, repeats=1)
    assert r.bytes == 32 * 128 * 1024 and r.model == "llama-3-8b"
