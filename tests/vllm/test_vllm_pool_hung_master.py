"""A rank with a host tier goes on sharing through it while its master hangs (issue 42.3):
`vllm_pool_hung_master_probe.py` drives a real `PoolWorker` (threads, tiers, host tier, store
client) against a real `mooncake_master` it SIGSTOPs (see there).

Before, a rank's loads shared one thread and its stores another with their calls to the store: a
load of blocks the host tier held waited behind a load's `get` from the stopped master, and a
store behind the previous store's `put` (each until Mooncake's RPC timeout, a minute here). Now
the calls to the store have threads of their own (fetch, put), and nothing this host's memory
serves waits for them. These tests failed on the old design (`store_calls_returned_*` held the
timed-out get and put).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def seen(run_probe) -> dict:
    return run_probe("vllm_pool_hung_master_probe.py")


def test_before_the_outage_a_store_reaches_the_host_tier_and_the_store(seen):
    assert seen["a_released"] and seen["a_put"]


def test_a_host_tier_load_reaches_the_device_while_a_load_from_the_stopped_master_hangs(seen):
    assert seen["b_in_store_call"]
    assert seen["host_load_done"] and not seen["host_load_failed"]
    assert seen["host_load_bytes_equal"]  # byte-exact: what a stored, in other device blocks
    assert seen["store_calls_returned_by_host_load"] == []  # b's get had not returned: nothing waited for it


def test_stores_reach_the_host_tier_one_after_the_other_while_their_puts_hang(seen):
    assert seen["c_released"] and seen["d_released"] and seen["d_on_host"]
    assert seen["store_calls_returned_by_d"] == []  # c's put had not returned when d's blocks went
    assert seen["master_stopped_throughout"]


def test_after_the_outage_the_hung_calls_end_and_the_puts_settle(seen):
    assert seen["b_ended_after"] and seen["puts_settled_after"]
    assert seen["tally"].get("stores") == 3 and seen["tally"].get("loads") == 2  # the moved one and a-again


def test_a_host_tier_load_whose_blocks_went_before_it_ran_loads_from_the_store(seen):
    """Routed to the load thread while the host tier held its blocks, evicted before it ran: it
    moves to the fetch thread and loads from the store, byte-exact (it failed before the review fix)."""
    assert seen["a_gone_from_host"]
    assert seen["moved_done"] and not seen["moved_failed"]
    assert seen["moved_bytes_equal"]
