"""A load that is refused still decodes right (issue 30 point 3): the engine recomputes the blocks it
could not load into its own blocks, as vLLM does with load-error blocks, decodes from them, and the
tokens equal plain `generate`. Before, the refused path decoded nothing at all (`tokens_offload`
was empty) while the pool proof's docstring said the tokens still equal `generate`."""

from __future__ import annotations

import os

import pytest
import torch

from kvbridge.proofs import offload_demo
from kvbridge.proofs.offload_demo import run_offload_demo


def test_a_refused_load_recomputes_its_blocks_and_decodes_what_generate_does(monkeypatch):
    monkeypatch.setattr(offload_demo._CpuPoolBackend, "load", lambda self, engine, tables, keys, hit: None)
    r = run_offload_demo("tiny-gemma2", seed=3, prompt_len=40, new_tokens=6)  # sliding + full groups
    assert r.recomputed and r.hit_tokens == 0 and r.loaded_blocks == 0
    assert len(r.tokens_offload) == 6 and r.tokens_offload == r.tokens_reference and r.match
    assert not r.ok  # nothing came from the pool: the round trip itself is not proven by a recompute
    assert "the load refused, its blocks recomputed" in r.describe()


def test_the_recompute_is_what_the_tokens_are_decoded_from(monkeypatch):
    """The decode reads the engine's blocks: a recompute that wrote nothing there (the device holds
    the evicted garbage) decodes other tokens than `generate`, so the check above is not vacuous."""
    monkeypatch.setattr(offload_demo._CpuPoolBackend, "load", lambda self, engine, tables, keys, hit: None)
    monkeypatch.setattr(offload_demo, "export_cache", _export_only_before_the_lookup())
    r = run_offload_demo("tiny-llama", seed=1, prompt_len=40, new_tokens=6)
    assert r.recomputed and r.tokens_offload != r.tokens_reference


def _export_only_before_the_lookup():
    """export_cache for the store engine's two prefill chunks, a no-op afterwards (the recompute)."""
    real, calls = offload_demo.export_cache, []

    def export(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            real(*args, **kwargs)
    return export


def test_a_miss_prefills_the_whole_prompt_and_decodes_from_the_engines_blocks(monkeypatch):
    monkeypatch.setattr(offload_demo._CpuPoolBackend, "hit", lambda self, keys, windows, obs, n: 0)
    r = run_offload_demo("tiny-gemma2", seed=2, prompt_len=40, new_tokens=5)
    assert r.hit_tokens == 0 and not r.recomputed
    assert len(r.tokens_offload) == 5 and r.tokens_offload == r.tokens_reference


def test_a_pool_object_failing_its_check_is_recomputed_and_the_tokens_equal_generate(tmp_path):
    """The shared pool's refused path end to end: every object the store engine put is replaced by
    bytes that fail their seal and size; the load engine finds B's prefix present, its load is
    refused, it recomputes and decodes."""
    pytest.importorskip("mooncake.store", reason="the pool needs the Mooncake wheel (installed by `make test`)")
    from kvbridge.pool.master import MooncakeMaster
    from kvbridge.proofs.pool_demo import Shape, run_pool_demo

    kept: list[torch.Tensor] = []

    def forge(client, keys):
        for key in keys:
            buf = torch.frombuffer(bytearray(os.urandom(64)), dtype=torch.uint8)
            client.register(buf.data_ptr(), buf.numel())
            client.remove([key])
            assert client.put([key], [[(buf.data_ptr(), buf.numel())]]) == [0]
            kept.append(buf)  # registered memory must outlive the client

    master = MooncakeMaster.start(tmp_path / "master.log")
    try:
        r = run_pool_demo("tiny-llama-6kv", seed=4, store=Shape(tp=2, block=4), load=Shape(tp=3, block=8),
                          pool_block=8, prompt_len=40, new_tokens=5, master=master, log_dir=tmp_path, tamper=forge)
    finally:
        master.stop()
    assert r.recomputed and r.hit_tokens == 0 and r.differences  # the tiers' reasons for refusing
    assert len(r.tokens_offload) == 5 and r.tokens_offload == r.tokens_reference
