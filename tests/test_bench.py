"""pytest-benchmark measurements (run with `pytest tests/test_bench.py --benchmark-enable`).

With benchmarks disabled (the default in CI) each body runs once as a smoke test. Speed claims
come from these benchmarks and `kvbridge bench`, never from timed assertions.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvbridge import EngineLayout, LocalExecutor, RankCache, Request, plan_request
from kvbridge.models.presets import PRESETS
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.verify import clone_caches, expected_destination, fill_source, mismatch_report, random_bytes

SPEC = spec_from_hf_config(PRESETS["llama-3-8b"])
TOKENS = 1024


@pytest.fixture(scope="module")
def setup():
    rng = random.Random(0)
    src = EngineLayout(tp_size=1, block_size=16, num_blocks=TOKENS // 16 + 1)
    dst = EngineLayout(tp_size=2, block_size=16, num_blocks=TOKENS // 16 + 1)
    req = Request((tuple(rng.sample(range(src.num_blocks), TOKENS // 16)),),
                  (tuple(rng.sample(range(dst.num_blocks), TOKENS // 16)),), TOKENS)
    return src, dst, req


def test_bench_plan(benchmark, setup):
    src, dst, req = setup
    plan = benchmark(plan_request, SPEC, src, dst, req)
    assert plan.nbytes == TOKENS * SPEC.bytes_per_token()


def test_bench_plan_token_by_token_reference(benchmark, setup):
    """The same plan without the cached template (what `plan_request` did before templates)."""
    src, dst, req = setup
    plan = benchmark(plan_request, SPEC, src, dst, req, templates=False)
    assert plan.nbytes == TOKENS * SPEC.bytes_per_token()


@pytest.mark.parametrize("templates", [True, False], ids=["template", "reference"])
@pytest.mark.parametrize("tokens", [4096, 4096 - 7], ids=["whole-blocks", "partial-last-block"])
def test_bench_plan_llama_4096_tp1_to_tp2(benchmark, templates, tokens):
    """Issue 14's yardstick: Llama-3-8B, 4096 tokens, block 16, TP1 -> TP2, HND both sides, with the
    request's normalization included; compare with the bytes' time at 50 GB/s (10.7 ms)."""
    rng = random.Random(0)
    src = EngineLayout(tp_size=1, block_size=16, num_blocks=4096 // 16 + 1)
    dst = EngineLayout(tp_size=2, block_size=16, num_blocks=4096 // 16 + 1)
    src_ids = tuple(rng.sample(range(src.num_blocks), 4096 // 16))
    dst_ids = tuple(rng.sample(range(dst.num_blocks), 4096 // 16))
    plan = benchmark(lambda: plan_request(SPEC, src, dst, Request(src_ids, dst_ids, tokens), templates=templates))
    assert plan.nbytes == tokens * SPEC.bytes_per_token()


def test_bench_execute_vs_contiguous(benchmark, setup):
    src, dst, req = setup
    plan = plan_request(SPEC, src, dst, req)
    sources, dests = RankCache.allocate_engine(SPEC, src), RankCache.allocate_engine(SPEC, dst)
    fill_source(sources, req.src_block_ids, req.num_tokens)
    random_bytes(dests, 3)
    want = clone_caches(dests)
    expected_destination(want, req, src)
    ex = LocalExecutor(sources, dests)
    benchmark(ex.execute, plan)
    # What was timed moved the request's bytes exactly (a benchmark of a broken copy measures nothing).
    assert not mismatch_report(dests, want)


def test_bench_contiguous_copy_same_bytes(benchmark):
    a = torch.ones(TOKENS * SPEC.bytes_per_token(), dtype=torch.uint8)
    b = torch.empty_like(a)
    benchmark(b.copy_, a)
    assert torch.equal(a, b)
