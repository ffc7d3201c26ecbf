"""Instances of different shapes on one host share prefixes through the pool's host tier (issue 42
point 1): X (TP 1, block 64) and Y (TP 2, block 32) map one host tier; Y loads what X stored out of
shared memory, no object fetched from the store, answering as X computed it (a plain instance's
answer: X computed the prompt itself). Z (TP 1, block 32) is another host: its own network
namespace, joined to this one by a veth pair, with a host tier of its own; it finds the prefix
through Mooncake, whose bytes cross the veth link (that a load from the store is kept in the
reader's host tier for its next reader: tests/pool/test_pool_host_tier.py)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from pool_fleet import greedy_logprobs, pool_fleet, stored_prompt

from kvbridge.integrations.vllm.fleet import InstanceShape
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.netns import Unavailable, namespace_beside_root
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


@pytest.fixture
def other_host():
    """(namespace, this host's address on the link, the namespace's address), or a skip saying why."""
    try:
        with namespace_beside_root() as found:
            yield found
    except Unavailable as e:
        pytest.skip(str(e))


def _rx_bytes(ns: str) -> int:
    """Bytes the namespace's end of the veth link received."""
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show"], capture_output=True, text=True, check=True)
    return sum(link["stats64"]["rx"]["bytes"] for link in json.loads(out.stdout) if link["ifname"] != "lo")


def test_instances_of_one_host_share_through_its_tier_and_another_host_through_the_store(vllm_env, tmp_path_factory,
                                                                                         other_host):
    ns, root_addr, ns_addr = other_host
    work = tmp_path_factory.mktemp("vllm-pool-host")
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny", seed=13))
    here, there = work / "host-a", work / "host-b"
    here.mkdir()
    there.mkdir()
    shapes = (("x", InstanceShape(tp=1, block=64)), ("y", InstanceShape(tp=2, block=32)),
              ("z", InstanceShape(tp=1, block=32)))
    tiers = {"x": {"host_mib": 64, "host_dir": str(here), "local_hostname": root_addr},
             "y": {"host_mib": 64, "host_dir": str(here), "local_hostname": root_addr},
             "z": {"host_mib": 64, "host_dir": str(there), "local_hostname": ns_addr}}
    with pool_fleet(vllm_env, work, model, shapes, b"h" * 32, member_kv=tiers, master_host=root_addr,
                    elsewhere={"z": (ns, ns_addr)}) as (master, x, y, z):
        assert z.url.startswith(f"http://{ns_addr}:")
        text, reference, stored = stored_prompt(master, x, seed=7, length=300)
        assert stored > 0 and _reported(x, "host_objects_put") > 0
        hits, from_store = metric_total(y.url, HITS), _count(y, "objects_got")
        assert [t for t, _ in greedy_logprobs(y.url, text)] == [t for t, _ in reference]
        assert metric_total(y.url, HITS) - hits >= 256, "Y did not load X's prefix"
        assert _count(y, "host_objects_got") > 0 and _count(y, "objects_got") == from_store, \
            "Y's load went to the store, not the host tier"
        hits_z, rx = metric_total(z.url, HITS), _rx_bytes(ns)
        assert [t for t, _ in greedy_logprobs(z.url, text)] == [t for t, _ in reference]
        assert metric_total(z.url, HITS) - hits_z >= 256, "Z (another host) did not find the prefix in the store"
        assert _count(z, "objects_got") > 0 and _count(z, "host_objects_got") == 0
        got = _count(z, "bytes_got")
        assert _rx_bytes(ns) - rx >= got > 0, "Z's objects did not cross the link to its host"

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
