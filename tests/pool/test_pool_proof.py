"""The shared pool proven on transformers models (issue 23 point 3): an engine of one shape stores
through a real Mooncake Store, an engine of another shape loads; caches bit-exact, tokens equal
plain `generate`. Hybrids with recurrent state (issue 29 point 3) store the state checkpoint at
each pool block's end, as vLLM's `align` mode keeps it, and a reader resumes from it."""

from __future__ import annotations

import pytest

from kvbridge.proofs.pool_demo import Shape, run_pool_demo

CASES = [  # model, store shape, load shape, pool block, prompt length
    ("tiny-llama-6kv", Shape(tp=6, block=4), Shape(tp=3, block=16), 16, 40),  # TP 6 -> 3 (replicas), block 4 -> 16
    ("tiny-llama-6kv", Shape(tp=2, block=16), Shape(tp=3, block=16, kv_order="HND"), 16, 40),  # TP 2 -> 3, NHD -> HND
    ("tiny-llama", Shape(tp=2, block=4, pp=2), Shape(tp=1, block=8), 8, 40),  # PP 2 -> 1
    ("tiny-deepseek-v3", Shape(tp=2, block=4), Shape(tp=1, block=8, kv_order="HND"), 8, 40),  # MLA: one writer
    ("tiny-gemma2", Shape(tp=2, block=4), Shape(tp=1, block=16, kv_order="HND"), 16, 40),  # sliding + full groups
    ("tiny-mistral", Shape(tp=1, block=4), Shape(tp=2, block=8, pp=2), 8, 24),  # all sliding; PP 1 -> 2
]


@pytest.mark.parametrize("model, store, load, pool_block, prompt_len", CASES,
                         ids=[f"{c[0]}-{c[1].tp}x{c[1].pp}b{c[1].block}-{c[2].tp}x{c[2].pp}b{c[2].block}" for c in CASES])
def test_a_prefix_stored_by_one_shape_loads_bit_exact_into_another(master, lender, model, store, load, pool_block,
                                                                   prompt_len):
    r = run_pool_demo(model, seed=CASES.index((model, store, load, pool_block, prompt_len)), store=store, load=load,
                      pool_block=pool_block, prompt_len=prompt_len, master=master, client=lender)
    assert r.ok, r.summary()
    assert r.cache_equal and r.tokens_offload == r.tokens_reference
    assert r.hit_tokens == r.prefix_len and not r.recomputed
    assert r.events["seal_failures"] == r.events["missing"] == 0
    assert r.events["objects_got"] > 0


RECURRENT = [  # hybrids with recurrent state: the checkpoint at the prefix's end goes through the pool
    ("tiny-bamba", Shape(tp=1, block=4), Shape(tp=2, block=8, kv_order="HND"), 8),  # Mamba2: TP 1 -> 2
    ("tiny-qwen3-next", Shape(tp=2, block=4), Shape(tp=1, block=16), 16),  # gated delta net: TP 2 -> 1
    ("tiny-lfm2", Shape(tp=2, block=2), Shape(tp=1, block=8, pp=2), 8),  # short conv: TP 2 -> PP 2
]


@pytest.mark.parametrize("model, store, load, pool_block", RECURRENT, ids=[c[0] for c in RECURRENT])
def test_recurrent_checkpoints_load_into_another_shape(master, lender, model, store, load, pool_block):
    r = run_pool_demo(model, seed=7, store=store, load=load, pool_block=pool_block, prompt_len=40, master=master,
                      client=lender)
    assert r.ok, r.summary()
    assert r.cache_equal and r.tokens_offload == r.tokens_reference  # the state included (`prove_cache`)
    assert r.hit_tokens == r.prefix_len and not r.recomputed
    assert r.events["seal_failures"] == r.events["missing"] == 0


def test_two_proofs_of_one_model_and_seed_on_one_master_do_not_read_each_others_objects(master, lender):
    """The first object written under a key stays; a proof of the same (model, seed) with a longer
    prompt computes its prefix in a longer prefill, whose last bits differ, and loaded the first
    proof's bytes: a false "cache differs" (issue 43, noted and left). Each run now stores under
    a namespace of its own; two runs given one `run` share, as a fleet restarted with its secret."""
    first = run_pool_demo("tiny-llama", seed=3, store=Shape(tp=2, block=4), load=Shape(tp=1, block=8), pool_block=8,
                          prompt_len=40, master=master, client=lender)
    second = run_pool_demo("tiny-llama", seed=3, store=Shape(tp=1, block=8), load=Shape(tp=2, block=4), pool_block=8,
                           prompt_len=200, master=master, client=lender)
    for r in (first, second):
        assert r.ok and r.cache_equal, r.summary()
        assert r.hit_tokens == r.prefix_len and r.events["objects_got"] > 0
    shared = [run_pool_demo("tiny-llama", seed=4, store=Shape(tp=1, block=8), load=Shape(tp=2, block=4),
                            pool_block=8, prompt_len=40, master=master, client=lender, run="shared")
              for _ in range(2)]
    assert shared[0].ok and shared[1].ok
