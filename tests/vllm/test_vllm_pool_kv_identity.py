"""Two `vllm serve` instances of one model directory that differ only in an `--hf-overrides` that
changes RoPE share no pool object (issue 43 point 1): X stores a prompt; Y, a plain instance of
another shape, loads it (the control: the pool works); Z, the same directory with RoPE theta
overridden, finds nothing of it and computes the prompt itself."""

from __future__ import annotations

import json

import pytest

from pool_fleet import pool_fleet, stored_prompt

from kvbridge.integrations.vllm.fleet import InstanceShape
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import metric_total, request

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]
HITS = "vllm:external_prefix_cache_hits_total"


def test_an_instance_with_other_rope_shares_nothing(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool-kv-identity")
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny", seed=11))
    shapes = (("x", InstanceShape(tp=1, block=64)), ("y", InstanceShape(tp=1, block=32)),
              ("z", InstanceShape(tp=1, block=32)))
    override = ["--hf-overrides", json.dumps({"rope_theta": 500000.0})]
    with pool_fleet(vllm_env, work, model, shapes, b"k" * 32, member_args={"z": override}) as (master, x, y, z):
        text, _, stored = stored_prompt(master, x, seed=5, length=200)
        assert stored > 0
        before_y, before_z = metric_total(y.url, HITS), metric_total(z.url, HITS)
        assert request(y.url, text, 4).ok
        assert metric_total(y.url, HITS) - before_y >= 192, "the plain reader did not load X's prefix"
        got = request(z.url, text, 4)
        assert got.ok, got.error
        assert metric_total(z.url, HITS) == before_z, "an instance with other RoPE loaded X's KV"
