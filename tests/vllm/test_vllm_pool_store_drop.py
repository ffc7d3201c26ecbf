"""A rank drops exactly the stores whose device blocks a step hands out again (issue 29, stores as
blocks fill): `vllm_pool_store_drop_probe.py` drives a real `PoolWorker` in .venv-vllm (see there).

* a running request's store reading a block the step hands out, or a load writes, is dropped
  before the step goes on, without waiting for the device copy it is in the middle of: what that
  copy read is thrown away and the next copy does not read (the engine thread never waits on the
  nice +10 store thread, issue 43.3);
* a finished request's store is never dropped, though its blocks are in the step's list (a
  prefix-cache hit on blocks vLLM holds for the store);
* a store whose blocks the step leaves alone runs to its end;
* a request's blocks are reported free (`finished_sending`) only once it finished and none of its
  stores is still in flight, whether they ended or were dropped;
* whatever the store does, a finished request's blocks are free within `release_ms` (issue 42.3):
  at once when its store has read them all (it goes on putting), else its store is dropped.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def seen(run_probe) -> dict:
    return run_probe("vllm_pool_store_drop_probe.py")


def test_a_running_requests_store_is_dropped_without_waiting_for_the_copy_in_progress(seen):
    assert seen["running_reads"] == [True, False]
    assert seen["drop_returned_during_copy"] is True  # the copy was still held when the drop returned
    assert seen["held_copy_kept"] is False  # and what it read is never put


def test_a_finished_requests_store_is_never_dropped(seen):
    assert seen["finished_reads"] == [True, True]


def test_a_loads_blocks_count_as_written_and_other_stores_run_on(seen):
    assert seen["a_reads"] == [True, False]
    assert seen["b_reads"] == [True, True]
    assert seen["dropped"] == 2


def test_blocks_are_released_only_when_finished_and_no_store_is_in_flight(seen):
    assert seen["finished_sending_1"] == ["finished", "running"]
    assert seen["finished_sending_2"] == ["a", "b"]
    assert seen["finished_sending_3"] == []
    assert seen["finished_sending_4"] == ["c"]


def test_a_finished_requests_blocks_are_free_once_read_or_within_the_release_bound(seen):
    assert seen["released_after_its_copy"] == ["early"] and seen["early_still_putting"] is True
    assert seen["released_while_queued"] == ["queued"] and seen["queued_never_read"] is True
    assert seen["queued_read_after_drop"] in (False, "never run")  # dropped: it read nothing once the thread got to it
    assert seen["release_dropped"] == 1
