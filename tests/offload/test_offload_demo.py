"""Transformers proof: a prefix stored to CPU, evicted from the device and loaded back decodes like `generate`.

Hybrid model: tiny-gemma2 alternates sliding-window (8) and full-attention layers, so there are two
KV-cache groups and the sliding group's stores and loads start at null-padded positions.
"""

from __future__ import annotations

import pytest
import torch

from kvbridge.errors import InvalidRequest
from kvbridge.proofs.offload_demo import run_offload_demo

pytestmark = pytest.mark.oracle


def test_hybrid_model_mirror_pool():
    r = run_offload_demo("tiny-gemma2", seed=0, prompt_len=40, block_size=4, block_size_factor=2)
    assert r.ok, r.summary()
    assert r.hit_tokens == r.prefix_len == 32 and r.tokens_offload == r.tokens_reference
    # chunk 1 (32 tokens): 4 full blocks + the sliding group's window block; chunk 2: one more of each
    assert (r.stored_blocks, r.loaded_blocks, r.events) == (7, 5, {"stored": 7, "removed": 0})
    assert r.to_dict()["ok"] is True


@pytest.mark.parametrize("store_tp, load_tp, block_size, load_block_size, factor", [
    (2, 4, 4, 8, 2),  # TP 2 -> 4, device blocks 4 -> 8 tokens (factor 2 -> 1)
    (2, 1, 4, 4, 4),  # TP 2 -> 1, 16-token offloaded blocks: the sliding group loads from sub-block 2
])
def test_tp_independent_offload(store_tp, load_tp, block_size, load_block_size, factor):
    r = run_offload_demo("tiny-gemma2", seed=1, prompt_len=40, block_size=block_size, block_size_factor=factor,
                         store_tp=store_tp, load_tp=load_tp, load_block_size=load_block_size, canonical=True)
    assert r.ok, r.summary()
    assert f"TP={store_tp}" in r.store_engine and f"TP={load_tp}" in r.load_engine and "canonical" in r.pool


def test_all_sliding_model_with_arc():
    # Every layer slides (window 8): only the blocks inside the window at each chunk's end are stored.
    r = run_offload_demo("tiny-mistral", seed=2, prompt_len=24, prefix_len=16, block_size=4, block_size_factor=2,
                         policy="arc", num_cpu_blocks=6)
    assert r.ok, r.summary()
    assert (r.stored_blocks, r.loaded_blocks) == (2, 1)


def test_a_prefix_evicted_from_cpu_is_a_miss():
    # One CPU slot: storing the second chunk's block evicts the prefix's block, so B finds nothing to load.
    r = run_offload_demo("tiny-mistral", seed=2, prompt_len=24, prefix_len=16, block_size=4, block_size_factor=2,
                         num_cpu_blocks=1)
    assert r.events == {"stored": 2, "removed": 1}
    assert r.hit_tokens == 0 and r.loaded_blocks == 0 and not r.ok


def test_the_proof_fails_when_the_pool_is_corrupted():
    def corrupt(pool):
        for r in pool.byte_regions():
            r.add_(1)

    r = run_offload_demo("tiny-gemma2", seed=0, prompt_len=40, after_store=corrupt)
    assert not r.cache_equal and not r.ok and r.differences


def test_demo_arguments_are_checked():
    with pytest.raises(InvalidRequest, match="use canonical=True to load on another shape"):
        run_offload_demo("tiny-gemma2", store_tp=2, load_tp=4)
    with pytest.raises(InvalidRequest, match="prefix_len must be a multiple of the 8-token offloaded block"):
        run_offload_demo("tiny-gemma2", prompt_len=40, prefix_len=12)


@pytest.mark.parametrize("model, store_pp, load_pp, store_tp, load_tp", [
    ("tiny-gemma2", 2, 1, 2, 1),  # two groups (full, sliding) split over two stages
    ("tiny-qwen2", 1, 3, 1, 2),  # three stages of one layer each; TP 1 -> 2
])
def test_pipeline_parallel_engines_offload_through_the_canonical_pool(model, store_pp, load_pp, store_tp, load_tp):
    """Each PP stage is planned as a TP engine over the group layers it holds (a stage's ranks have
    regions for their own layers only, numbered from 0)."""
    r = run_offload_demo(model, seed=3, prompt_len=40, block_size=4, block_size_factor=2, store_tp=store_tp,
                         load_tp=load_tp, store_pp=store_pp, load_pp=load_pp, canonical=True)
    assert r.ok, r.summary()
    assert r.tokens_offload == r.tokens_reference


def test_a_mirror_pool_of_a_pipeline_parallel_engine_is_refused():
    with pytest.raises(InvalidRequest, match="mirror pool of a pipeline-parallel engine"):
        run_offload_demo("tiny-llama", store_pp=2, load_pp=2)


@pytest.mark.parametrize("model", ["tiny-bamba", "tiny-lfm2"])
def test_recurrent_checkpoints_offload_across_shapes(model):
    """Mamba2 and short-conv hybrids: the state checkpoint at the prefix's end goes to the canonical
    pool with the attention blocks and comes back into an engine of another TP and block size."""
    r = run_offload_demo(model, seed=3, prompt_len=40, block_size=4, block_size_factor=2, store_tp=1, load_tp=2,
                         load_block_size=8, canonical=True)
    assert r.ok, r.summary()
    assert r.hit_tokens == r.prefix_len == 32 and r.tokens_offload == r.tokens_reference


ZOO = [  # architecture, store TP / PP / block, load TP / PP / block, pool block: a bounded sample of `make models`' zoo
    ("minimax", (3, 1, 4), (1, 1, 16), 16),  # a cache class of its own (lightning attention)
    ("rwkv", (3, 1, 4), (2, 1, 2), 8),  # a state list outside any transformers Cache
    ("roberta", (1, 1, 8), (3, 1, 4), 8),  # a decoder whose default positions are not generate's
    ("gemma3n_text", (2, 2, 8), (6, 1, 16), 16),  # the last PP stage holds only layers that read others' K/V
    ("deepseek_v4", (1, 1, 8), (1, 1, 8), 16),  # rows of several tokens, two device blocks per pool block
    ("mamba", (2, 1, 4), (1, 2, 8), 8),  # Mamba1 reads its state only in one-token steps
    ("recurrent_gemma", (1, 1, 4), (2, 2, 8), 16),  # state kept on its modules, multi-token input is a prefill
]


@pytest.mark.parametrize("arch, store, load, pool_block", ZOO, ids=[z[0] for z in ZOO])
def test_zoo_models_offload_through_the_canonical_pool(tmp_path, arch, store, load, pool_block):
    """Each prefill runs as the direct proof runs it (the model's own cache argument and class,
    state outside a Cache, generate's positions), a stage without stateful layers stores nothing,
    and a state that a multi-token forward would not read takes the rest of the prompt one token at
    a time: an outside sweep of every architecture found these raising, refused or answering wrong."""
    from kvbridge.proofs.model_sweep import tiny_config

    tiny_config(arch).save_pretrained(tmp_path)
    (stp, spp, sbs), (ltp, lpp, lbs) = store, load
    r = run_offload_demo(str(tmp_path), seed=1, prompt_len=40, block_size=sbs, block_size_factor=pool_block // sbs,
                         store_tp=stp, store_pp=spp, load_tp=ltp, load_pp=lpp, load_block_size=lbs, canonical=True,
                         new_tokens=4)
    assert r.ok, r.summary()
    assert r.hit_tokens == r.prefix_len and r.tokens_offload == r.tokens_reference


def test_a_mamba1_state_is_what_its_tokens_continue_from(tmp_path):
    """The token check reads the loaded state: the same round trip with the pool's state bytes
    damaged gives other tokens (before, the rest of the prompt ran from a zero state, so no state
    loaded into a Mamba1 model, right or wrong, changed its tokens)."""
    from kvbridge.proofs.model_sweep import tiny_config

    tiny_config("mamba").save_pretrained(tmp_path)

    def damage(pool):
        for r in pool.byte_regions():
            r.view(torch.float32).mul_(-3.0)

    r = run_offload_demo(str(tmp_path), seed=1, prompt_len=40, block_size=4, block_size_factor=2, canonical=True,
                         new_tokens=4, after_store=damage)
    assert r.hit_tokens == r.prefix_len and not r.cache_equal
    assert r.tokens_offload != r.tokens_reference
