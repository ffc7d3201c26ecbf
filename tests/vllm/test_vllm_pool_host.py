"""Instances of different shapes on one host share prefixes through the pool's host tier (issue 42
point 1): X (TP 1, block 64) and Y (TP 2, block 32) map one host tier; Y loads what X stored out of
shared memory, no object fetched from the store, answering as X computed it (a plain instance's
answer: X computed the prompt itself). Z (TP 1, block 32), with a host tier of its own standing for
another host's, finds the prefix through Mooncake (that a load from the store is kept in the
reader's host tier for its next reader: tests/pool/test_pool_host_tier.py)."""

from __future__ import annotations

import time

import pytest

from pool_fleet import greedy_logprobs, pool_fleet, stored_prompt

from kvbridge.integrations.vllm.fleet import InstanceShape
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import metric_total, prompt_text

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]
HITS = "vllm:external_prefix_cache_hits_total"


def _count(m, name: str) -> float:
    return metric_total(m.url, f"vllm:kvbridge_pool_{name}_total")


def _reported(m, name: str, timeout_s: float = 300.0) -> float:
    """`name` once the instance reported it: a rank's counts reach /metrics with an engine step,
    and a store ends after its request's last step, so short requests drive steps until it shows."""
    end = time.monotonic() + timeout_s
    seed = 900
    while _count(m, name) == 0 and time.monotonic() < end:
        greedy_logprobs(m.url, prompt_text(seed, 8), max_tokens=1)
        seed += 1
        time.sleep(0.5)
    return _count(m, name)


def test_instances_of_one_host_share_through_its_tier_and_another_host_through_the_store(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool-host")
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny", seed=13))
    here, there = work / "host-a", work / "host-b"
    here.mkdir()
    there.mkdir()
    shapes = (("x", InstanceShape(tp=1, block=64)), ("y", InstanceShape(tp=2, block=32)),
              ("z", InstanceShape(tp=1, block=32)))
    tiers = {"x": {"host_mib": 64, "host_dir": str(here)}, "y": {"host_mib": 64, "host_dir": str(here)},
             "z": {"host_mib": 64, "host_dir": str(there)}}
    with pool_fleet(vllm_env, work, model, shapes, b"h" * 32, member_kv=tiers) as (master, x, y, z):
        text, reference, stored = stored_prompt(master, x, seed=7, length=300)
        assert stored > 0 and _reported(x, "host_objects_put") > 0
        hits, from_store = metric_total(y.url, HITS), _count(y, "objects_got")
        assert [t for t, _ in greedy_logprobs(y.url, text)] == [t for t, _ in reference]
        assert metric_total(y.url, HITS) - hits >= 256, "Y did not load X's prefix"
        assert _count(y, "host_objects_got") > 0 and _count(y, "objects_got") == from_store, \
            "Y's load went to the store, not the host tier"
        hits_z = metric_total(z.url, HITS)
        assert [t for t, _ in greedy_logprobs(z.url, text)] == [t for t, _ in reference]
        assert metric_total(z.url, HITS) - hits_z >= 256, "Z (another host) did not find the prefix in the store"
        assert _count(z, "objects_got") > 0 and _count(z, "host_objects_got") == 0

        # The master goes: the host tier goes on. Y's next lookup beyond the host tier fails and
        # opens its breakers; X's store puts into the host tier (its put to the store fails);
        # Y, its store away, still loads X's new prefix from the host tier.
        master.stop()
        opened = _count(y, "breaker_opened")
        greedy_logprobs(y.url, prompt_text(77, 300), max_tokens=1)  # in no tier: the store is asked
        assert _reported_above(y, "breaker_opened", opened) > opened, "Y never noticed the master gone"
        put = _count(x, "host_objects_put")
        text2 = prompt_text(78, 300)
        reference2 = greedy_logprobs(x.url, text2)
        assert _reported_above(x, "host_objects_put", put) > put, "X stored nothing into the host tier"
        hits, got = metric_total(y.url, HITS), _count(y, "host_objects_got")
        assert [t for t, _ in greedy_logprobs(y.url, text2)] == [t for t, _ in reference2]
        assert metric_total(y.url, HITS) - hits >= 256, "Y did not load X's prefix with the store away"
        assert _count(y, "host_objects_got") > got


def _reported_above(m, name: str, before: float, timeout_s: float = 300.0) -> float:
    """`name` once it passed `before` (short requests drive the steps that report it: `_reported`)."""
    end = time.monotonic() + timeout_s
    seed = 1900
    while _count(m, name) <= before and time.monotonic() < end:
        greedy_logprobs(m.url, prompt_text(seed, 8), max_tokens=1)
        seed += 1
        time.sleep(0.5)
    return _count(m, name)
