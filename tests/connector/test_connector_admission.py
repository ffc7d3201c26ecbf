"""Decode-side admission (`connector.admission`): destination blocks of in-flight requests are
exclusive; overlaps and blocks outside the cache are refused at `receive`, in one line naming
both requests and the blocks, and a finished request gives its blocks back."""

from __future__ import annotations

import time

import pytest
from connector_harness import Cluster

from kvbridge.connector.admission import BlockOwners, written_blocks
from kvbridge.core.layout import EngineLayout
from kvbridge.errors import InvalidRequest

L = EngineLayout(tp_size=1, block_size=16, num_blocks=64)


def test_overlapping_destination_blocks_refused_until_the_first_finishes() -> None:
    cl = Cluster(L, L)
    try:
        cl.connect()
        consumer = cl.consumers[0]
        consumer.receive("first", [[0, 1, 2]])
        with pytest.raises(InvalidRequest) as e:
            consumer.receive("second", [[5, 2, 1]])
        text = str(e.value)
        assert "'second'" in text and "'first'" in text and "blocks 2, 1" in text and "\n" not in text, text
        with pytest.raises(InvalidRequest, match="outside"):
            consumer.receive("third", [[3, 64]])
        with pytest.raises(InvalidRequest, match="twice"):
            consumer.receive("fourth", [[7, 8, 7]])
        assert consumer.active == ("first",)  # the refused ones left nothing behind
        consumer.receive("fifth", [[3, 4]])  # disjoint: admitted
        consumer.abort("first", "the test cancels it")
        cl.run_until(lambda: consumer.result("first") is not None, 5)
        consumer.receive("second", [[5, 2, 1]])  # its blocks are free again
    finally:
        cl.close()


def test_prefix_cached_blocks_may_be_shared_and_admission_is_linear() -> None:
    owners = BlockOwners()
    owners.admit("a", written_blocks([[5, 6, 7]], 32, 16, [False]))
    owners.admit("b", written_blocks([[5, 6, 8]], 32, 16, [False]))  # 5, 6: cached prefix, not written
    with pytest.raises(InvalidRequest, match="'c'.*'a'.*group 0 block 7"):
        owners.admit("c", written_blocks([[5, 6, 7]], 0, 16, [False]))
    with pytest.raises(InvalidRequest, match="block 9"):  # recurrent groups are written whole
        owners.admit("d", written_blocks([[1], [9]], 0, 16, [False, True]) + written_blocks([[], [9]], 0, 16,
                                                                                              [False, True]))
    owners.release("a")
    owners.release("b")
    assert len(owners) == 0
    # O(blocks): 64 requests of 8192 blocks each, admitted and released
    t0 = time.perf_counter()
    for i in range(64):
        owners.admit(f"r{i}", written_blocks([range(i * 8192, (i + 1) * 8192)], 0, 16, [False]))
    for i in range(64):
        owners.release(f"r{i}")
    assert time.perf_counter() - t0 < 5.0 and len(owners) == 0
