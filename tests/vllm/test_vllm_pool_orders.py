"""Pool cases an outside-style trial found broken, through real `vllm serve` instances.

1. bfloat16 on a CPU with AMX tiles (`make test`): vLLM CPU's AMX attention kernel keeps a block's
   bytes in VNNI tiles, not the transposed K kvbridge describes, and its order changes with the
   block size, so such instances share only with instances of the same order
   (`registration.cpu_byte_order`; that another block size then misses is checked against vLLM's
   kernel in `test_vllm_cpu_order.py`). X (TP 1, block 64) stores a prompt; Y, fresh, of the same
   order, loads it as its very first prefill (which killed its engine on an illegal instruction
   until the worker asked Linux for AMX tiles) and answers with X's tokens and log-probs (equal to
   the bit in every run on this host). Z (TP 1,
   block 32, another order; `make fleet-tests`) gets no external hit and answers as it computes:
   before the fix it loaded X's bytes misread (another first token, no seal failure).
2. Every layer sliding (one vLLM group of `SlidingWindowSpec`; `make fleet-tests`): the instances
   stopped at start (the workers called the group full, the scheduler sliding); now X (TP 1,
   block 64) stores and Y (TP 2, block 128) loads the window's blocks and answers as X.
"""

from __future__ import annotations

import pytest

from pool_fleet import greedy_logprobs, pool_fleet, stored_prompt

from kvbridge.integrations.vllm.fleet import InstanceShape
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import metric_total

pytestmark = pytest.mark.vllm
HITS = "vllm:external_prefix_cache_hits_total"
SEALS = "vllm:kvbridge_pool_seal_failures_total"


def _amx_fleet(vllm_env, tmp_path_factory, shapes):
    import torch

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM CPU uses its vec kernels, whose order kvbridge describes")
    work = tmp_path_factory.mktemp("vllm-pool-amx")
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny-llama", seed=5, head_dim=64))
    return pool_fleet(vllm_env, work, model, shapes, b"a" * 32, dtype="bfloat16")


@pytest.mark.fleet  # two bf16 instance starts (77 s of CI); tests/pool/test_pool_faults.py keeps vLLM CPU's orders
def test_a_fresh_bfloat16_amx_instance_starts_from_a_pool_hit_exactly(vllm_env, tmp_path_factory):
    shapes = (("x", InstanceShape(tp=1, block=64)), ("y", InstanceShape(tp=1, block=64)))
    with _amx_fleet(vllm_env, tmp_path_factory, shapes) as (master, x, y):
        text, reference, _ = stored_prompt(master, x, seed=71, length=129)
        hits = metric_total(y.url, HITS)
        got = greedy_logprobs(y.url, text)  # Y's first prefill, from X's blocks
        assert [t for t, _ in got] == [t for t, _ in reference]
        # equal to the bit in every run here; a misread block is off by far more
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, reference)) < 1e-3
        assert metric_total(y.url, HITS) - hits == 128
        assert metric_total(y.url, SEALS) == 0


@pytest.mark.fleet
def test_a_bfloat16_amx_instance_of_another_block_size_misses(vllm_env, tmp_path_factory):
    shapes = (("x", InstanceShape(tp=1, block=64)), ("z", InstanceShape(tp=1, block=32)))
    with _amx_fleet(vllm_env, tmp_path_factory, shapes) as (master, x, z):
        text, reference, _ = stored_prompt(master, x, seed=72, length=129)
        hits = metric_total(z.url, HITS)
        got = greedy_logprobs(z.url, text)
        assert metric_total(z.url, HITS) == hits, "an instance of another AMX block size loaded X's blocks"
        assert got[0][0] == reference[0][0]  # computed by itself: X's first token
        assert metric_total(z.url, SEALS) == 0


@pytest.mark.fleet
def test_a_model_whose_every_layer_slides_is_shared_across_shapes(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool-all-sliding")
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny-mistral", seed=6, sliding_window=128,
                                               every_layer_slides=True))
    shapes = (("x", InstanceShape(tp=1, block=64)), ("y", InstanceShape(tp=2, block=128)))
    with pool_fleet(vllm_env, work, model, shapes, b"s" * 32, block_tokens=128) as (master, x, y):
        text, reference, _ = stored_prompt(master, x, seed=81, length=300)
        hits = metric_total(y.url, HITS)
        got = greedy_logprobs(y.url, text)
        assert metric_total(y.url, HITS) - hits == 256
        assert [t for t, _ in got] == [t for t, _ in reference]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, reference)) < 1e-3  # float32: TP 1 / TP 2 agree here
        assert metric_total(y.url, SEALS) == 0
