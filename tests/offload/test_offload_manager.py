"""The CPU-slot catalogue against vLLM's test_cpu_manager vectors (LRU, ARC, reuse filter)."""

from __future__ import annotations

import pytest

from kvbridge.offload.errors import OffloadStateError
from kvbridge.offload.keys import make_offload_key, split_offload_key
from kvbridge.offload.manager import FilterReusedManager, LookupResult, OffloadingManager
from kvbridge.offload.policy import ARCPolicy


def h(*xs: int) -> list[bytes]:
    return [str(x).encode() for x in xs]


def stored(m, *xs: int):
    out = m.prepare_store(h(*xs))
    m.complete_store(h(*xs))
    return out


def ids(out) -> list[int]:
    spec = getattr(out, "store_spec", out)  # a PrepareStoreOutput or a CPULoadStoreSpec
    return spec.block_ids.tolist()


def events(m) -> list[tuple[bool, set[bytes]]]:
    return [(e.removed, set(e.keys)) for e in m.take_events()]


def test_lru_vector():
    """vLLM's current test_cpu_manager: a completed load makes 2 and 3 recent, so 4, 5, 2 go first."""
    m = OffloadingManager(4, "lru", block_size=256)
    out = m.prepare_store(h(1, 2))  # 1
    assert (out.keys_to_store, ids(out), out.evicted_keys) == (h(1, 2), [0, 1], [])
    assert m.lookup(h(1, 2)) == 0 and m.take_events() == []  # 2: not ready, no events yet
    assert [m.lookup_result(k) for k in h(1, 2)] == [LookupResult.HIT_PENDING] * 2
    m.complete_store(h(1, 2))  # 3
    assert events(m) == [(False, set(h(1, 2)))]
    assert (m.lookup(h(1)), m.lookup(h(1, 2)), m.lookup(h(1, 2, 3))) == (1, 2, 2)  # 4
    assert [m.lookup_result(k) for k in h(1, 2, 3)] == [LookupResult.HIT] * 2 + [LookupResult.MISS]
    out = m.prepare_store(h(2, 3, 4, 5))  # 5
    assert (out.keys_to_store, ids(out), out.evicted_keys) == (h(3, 4, 5), [2, 3, 0], h(1))
    assert events(m) == [(True, set(h(1)))]
    assert m.prepare_store(h(1, 6)) is None  # 6: only 2 is evictable, 3, 4, 5 are not ready
    m.complete_store(h(2, 3, 4, 5))  # 7
    assert ids(m.prepare_load(h(2, 3))) == [1, 2]  # 8
    assert m.prepare_store(h(6, 7, 8)) is None  # 9: 2 and 3 are being read
    m.complete_load(h(2, 3))  # 10: the completed load is a use
    out = m.prepare_store(h(6, 7, 8))
    assert (out.keys_to_store, ids(out), out.evicted_keys) == (h(6, 7, 8), [1, 0, 3], h(4, 5, 2))
    m.complete_store(h(6, 7, 8))  # 11
    m.touch(h(3, 6, 7))
    assert list(m.policy.evictable) == h(8, 7, 6, 3)
    out = m.prepare_store(h(9))  # 12
    assert (ids(out), out.evicted_keys) == ([3], h(8))
    m.complete_store(h(7, 9), success=False)  # 13
    assert (m.lookup(h(7)), m.lookup(h(9))) == (1, 0)
    assert events(m) == [(False, set(h(3, 4, 5))), (True, set(h(4, 5, 2))), (False, set(h(6, 7, 8))),
                         (True, set(h(8)))]  # 14


def test_lru_touch_skips_blocks_in_flight():
    """A block being written or read is not on the eviction list; touch leaves it, and it joins
    the most-recent end when its store (or its last load) completes."""
    m = OffloadingManager(4, "lru")
    stored(m, 1, 2)
    m.prepare_store(h(3))
    m.touch(h(3, 1))  # 3 is pending: only 1 moves
    assert list(m.policy.evictable) == h(2, 1)
    m.complete_store(h(3))
    assert list(m.policy.evictable) == h(2, 1, 3)
    m.prepare_load(h(2))
    m.prepare_load(h(2))  # two readers
    m.touch(h(2))
    assert list(m.policy.evictable) == h(1, 3)
    m.complete_load(h(2))
    assert list(m.policy.evictable) == h(1, 3)  # still read by one
    m.complete_load(h(2))
    assert list(m.policy.evictable) == h(1, 3, 2)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_pending_store_answers_retry(policy):
    """vLLM's HIT_PENDING: the per-key lookup says "ask again" (None) until the store completes."""
    from kvbridge.offload.lookup import request_hits

    m = OffloadingManager(8, policy)
    stored(m, 1)
    m.prepare_store(h(2))
    assert (m.lookup_key(h(1)[0]), m.lookup_key(h(2)[0]), m.lookup_key(h(3)[0])) == (True, None, False)
    assert request_hits([h(1, 2)], [None], 16, 40, m.lookup_key) is None
    m.complete_store(h(2))
    assert request_hits([h(1, 2)], [None], 16, 40, m.lookup_key) == 32
    f = FilterReusedManager(m)
    assert f.lookup_key(h(2)[0]) is True


def test_failed_store_frees_the_slot():
    m = OffloadingManager(2, "lru")
    out = m.prepare_store(h(1, 2))
    m.complete_store(h(1, 2), success=False)
    assert m.num_free_blocks == 2 and m.lookup(h(1)) == 0 and m.take_events() == []
    assert ids(m.prepare_store(h(3))) == [1]  # the LIFO free list hands back the last freed slot


def test_none_changes_nothing():
    m = OffloadingManager(2, "lru")
    stored(m, 1, 2)
    m.take_events()
    m.prepare_load(h(1))
    before = (list(m.policy.blocks), m.num_free_blocks)
    assert m.prepare_store(h(3, 4)) is None  # needs 2 evictions, only 2 is evictable
    assert (list(m.policy.blocks), m.num_free_blocks, m.take_events()) == (*before, [])


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_already_stored_block_not_evicted_during_prepare_store(policy):
    m = OffloadingManager(4, policy)
    stored(m, 1, 2)
    m.touch(h(1))
    out = m.prepare_store(h(2, 3, 4, 5))
    assert (out.keys_to_store, ids(out), out.evicted_keys) == (h(3, 4, 5), [2, 3, 0], h(1))
    m.complete_store(h(3, 4, 5))
    assert m.lookup(h(2)) == 1


def test_arc_basic_and_promotion():
    m = OffloadingManager(4, "arc")
    assert ids(stored(m, 1, 2)) == [0, 1]
    assert (m.lookup(h(1)), m.lookup(h(1, 2)), m.lookup(h(1, 2, 3))) == (1, 2, 2)
    assert (len(m.policy.t1), len(m.policy.t2)) == (2, 0)
    m.touch(h(1))
    assert list(m.policy.t1) == h(2) and list(m.policy.t2) == h(1)


def test_arc_touch_keeps_unready_block_in_t1():
    m = OffloadingManager(4, "arc")
    m.prepare_store(h(1, 2))
    m.touch(h(1))
    assert list(m.policy.t1) == h(2, 1) and not m.policy.t2


def test_arc_eviction_with_load():
    m = OffloadingManager(4, "arc")
    assert ids(stored(m, 1, 2, 3, 4)) == [0, 1, 2, 3]
    assert ids(m.prepare_load(h(2, 3))) == [1, 2]
    assert m.prepare_store(h(5, 6, 7)) is None
    m.complete_load(h(2, 3))
    out = m.prepare_store(h(5, 6, 7))
    assert out is not None and len(out.evicted_keys) >= 1


def test_arc_adaptive_target():
    m = OffloadingManager(2, "arc")
    stored(m, 1, 2)
    out = stored(m, 3)
    assert out.evicted_keys == h(1) and list(m.policy.b1) == h(1)
    m.touch(h(1))
    assert m.policy.target_t1_size == 1


def test_arc_t1_t2_eviction_policy():
    m = OffloadingManager(4, "arc")
    stored(m, 1, 2, 3, 4)
    m.touch(h(3, 4))
    assert list(m.policy.t1) == h(1, 2) and set(m.policy.t2) == set(h(3, 4))
    m.policy.target_t1_size = 1
    out = m.prepare_store(h(5))
    assert out.evicted_keys == h(1) and h(1)[0] in m.policy.b1 and h(5)[0] in m.policy.t1


def test_arc_evicts_from_t2_when_t1_is_below_target():
    m = OffloadingManager(3, "arc")
    stored(m, 1, 2, 3)
    m.touch(h(2, 3))  # T1 {1}, T2 {3, 2} (reverse walk)
    m.policy.target_t1_size = 2  # |T1| = 1 < 2: take T2's least recent
    out = m.prepare_store(h(4))
    assert out.evicted_keys == h(3) and list(m.policy.b2) == h(3)


def test_arc_ghost_list_bounds():
    m = OffloadingManager(2, "arc")
    for i in range(1, 20):
        stored(m, i)
        assert len(m.policy.b1) <= 2 and len(m.policy.b2) <= 2


def test_arc_touch_ordering():
    m = OffloadingManager(4, "arc")
    stored(m, 1, 2, 3, 4)
    m.touch(h(3, 4))
    m.touch(h(1, 3, 4))
    assert list(m.policy.t1) == h(2) and set(m.policy.t2) == set(h(1, 3, 4))
    out = m.prepare_store(h(5))
    assert (ids(out), out.evicted_keys) == ([1], h(2))


def test_arc_failed_store():
    m = OffloadingManager(4, "arc")
    stored(m, 1, 2, 3, 4)
    out = m.prepare_store(h(5))
    assert out.evicted_keys == h(1)
    m.complete_store(h(5), success=False)
    assert m.lookup(h(5)) == 0 and h(5)[0] not in m.policy.t1 and h(5)[0] not in m.policy.t2
    assert h(1)[0] in m.policy.b1 and h(5)[0] not in m.policy.b1


def test_arc_full_scenario():
    m = OffloadingManager(4, "arc")
    stored(m, 1, 2)
    out = stored(m, 3, 4, 5)
    assert out.evicted_keys == h(1)
    m.touch(h(2, 3))
    assert set(m.policy.t1) == set(h(4, 5)) and set(m.policy.t2) == set(h(2, 3))
    stored(m, 6)
    assert m.lookup(h(2)) == 1 and m.lookup(h(3)) == 1 and m.take_events()


def test_arc_ghost_hit_in_b2_lowers_target():
    p = ARCPolicy(4)
    p.b2["x"] = None
    p.target_t1_size = 3
    p.touch(["x"])
    assert p.target_t1_size == 2


def test_filter_reused():
    m = FilterReusedManager(OffloadingManager(4, "lru"), store_threshold=2, max_tracker_size=3)
    assert m.lookup(h(1, 2)) == 0
    assert m.prepare_store(h(1, 2)).keys_to_store == []
    assert m.lookup(h(1)) == 0
    assert m.prepare_store(h(1, 2)).keys_to_store == h(1)
    assert m.lookup(h(3, 4)) == 0
    assert h(2)[0] not in m.counts  # evicted from the tracker by 3 and 4
    assert m.lookup(h(2)) == 0 and m.counts[h(2)[0]] == 1
    assert m.prepare_store(h(2)).keys_to_store == []
    m.complete_store(h(1))  # delegated
    assert m.lookup(h(1)) == 1


def test_load_life_cycle_errors_name_the_block():
    m = OffloadingManager(4)
    with pytest.raises(OffloadStateError, match=r"b'7': not offloaded"):
        m.prepare_load(h(7))
    m.prepare_store(h(1, 2))
    with pytest.raises(OffloadStateError, match=r"b'1': not ready"):
        m.prepare_load(h(1))
    m.complete_store(h(1))
    with pytest.raises(OffloadStateError):
        m.prepare_load(h(1, 2))  # all or nothing: 1 must not stay pinned
    assert m.policy.get(h(1)[0]).ref_cnt == 0
    with pytest.raises(OffloadStateError, match="not being loaded"):
        m.complete_load(h(1))


def test_keys_carry_the_group_and_events_expose_hashes():
    k = make_offload_key(b"abc", 258)
    assert k == b"abc\x00\x00\x01\x02" and split_offload_key(k) == (b"abc", 258)
    m = OffloadingManager(2, block_size=32)
    keys = [make_offload_key(b"h1", 0), make_offload_key(b"h1", 1)]
    out = m.prepare_store(keys)
    assert ids(out) == [0, 1]  # the same prefix has a slot per group
    m.complete_store(keys)
    (e,) = m.take_events()
    assert (e.block_hashes(), e.block_size, e.medium, e.removed) == ((b"h1", b"h1"), 32, "CPU", False)


def test_manager_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        OffloadingManager(4, "fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        OffloadingManager(0)
    with pytest.raises(ValueError, match="store_threshold must be >= 2"):
        FilterReusedManager(OffloadingManager(1), store_threshold=1)
