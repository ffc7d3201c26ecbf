"""Block tables and keys -> the device side of store and load jobs (vLLM's connector scheduler)."""

from __future__ import annotations

import pytest

from kvbridge.offload.errors import SpecMismatch
from kvbridge.offload.scheduling import NULL, load_job, storable_keys, store_job
from kvbridge.offload.spec import split_groups

N = NULL
FULL = [10, 11, 12, 13, 14, 15, 16, 17]  # 8 device blocks, factor 4 -> offloaded blocks 0, 1
SLIDE = [N, N, N, N, N, N, 26, 27]  # a window that keeps the last 2 device blocks
KEYS = [["f0", "f1"], ["s0", "s1"]]


def test_store_skips_null_blocks_and_sets_block_indices():
    assert storable_keys(SLIDE, KEYS[1], 4, 0, 2) == ["s1"]  # s0 ends in a null block
    assert storable_keys(FULL, KEYS[0], 4, 0, 2) == ["f0", "f1"]
    gpu = store_job([FULL, SLIDE], KEYS, ["f0", "f1", "s1"], 4)
    assert gpu.block_ids.tolist() == FULL + [26, 27]
    assert (gpu.group_sizes, gpu.block_indices) == ((8, 2), (0, 6))
    # The worker consumes exactly the three slots the manager handed out for these keys.
    slices = split_groups(gpu, [5, 6, 7], 4, 2)
    assert [s.cpu_sub_blocks(4).tolist() for s in slices] == [[20, 21, 22, 23, 24, 25, 26, 27], [30, 31]]


def test_whole_blocks_blanks_every_offloaded_block_a_window_left_in_part():
    from kvbridge.offload.scheduling import whole_blocks
    assert whole_blocks(SLIDE, 4) == [N] * 8  # s1 kept its last two device blocks only
    assert whole_blocks([N, N, N, N, 24, 25, 26, 27, 28], 4) == [N, N, N, N, 24, 25, 26, 27, 28]
    assert whole_blocks(FULL, 4) == FULL and whole_blocks(SLIDE, 1) == SLIDE
    assert storable_keys(whole_blocks(SLIDE, 4), KEYS[1], 4, 0, 2) == []
    assert storable_keys(whole_blocks([N, N, N, N, 24, 25, 26, 27], 4), KEYS[1], 4, 0, 2) == ["s1"]


def test_store_of_a_later_key_only():
    gpu = store_job([FULL, SLIDE], KEYS, ["f1"], 4)
    assert (gpu.block_ids.tolist(), gpu.group_sizes, gpu.block_indices) == ([14, 15, 16, 17], (4, 0), (4, 0))


@pytest.mark.parametrize("to_store, message", [
    (["s0"], r"offloaded block 0 of group 1 is not full on the device"),
    (["s1", "f0"], r"group order"),
    (["x"], r"not one of the request's keys"),
])
def test_store_refuses_what_it_cannot_describe(to_store, message):
    with pytest.raises(SpecMismatch, match=message):
        store_job([FULL, SLIDE], KEYS, to_store, 4)


def test_load_starts_at_the_first_block_to_fill():
    # 32 cached tokens of block size 4: 8 blocks per group. Blocks 0-4 of group 0 are prefix-cache hits.
    have = [[True] * 5 + [False] * 3, [False] * 8]
    keys, gpu = load_job([FULL, SLIDE], KEYS, 32, 4, 4, have)
    assert keys == ["f1", "s1"]
    assert (gpu.block_ids.tolist(), gpu.group_sizes, gpu.block_indices) == ([15, 16, 17, 26, 27], (3, 2), (5, 6))
    slices = split_groups(gpu, [8, 9], 4, 2)
    assert [s.cpu_sub_blocks(4).tolist() for s in slices] == [[33, 34, 35], [38, 39]]


def test_load_of_a_partial_offloaded_block_and_of_nothing():
    keys, gpu = load_job([FULL, SLIDE], KEYS, 24, 4, 4)  # 6 blocks: f0 and the first half of f1
    assert keys == ["f0", "f1"] and gpu.group_sizes == (6, 0) and gpu.block_indices == (0, 0)
    keys, gpu = load_job([FULL], [KEYS[0]], 32, 4, 4, [[True] * 8])
    assert keys == [] and len(gpu) == 0 and gpu.group_sizes == (0,)


def test_load_refuses_short_tables_and_holes():
    with pytest.raises(SpecMismatch, match="need 9 blocks, the table has 8"):
        load_job([FULL], [KEYS[0]], 36, 4, 4)
    with pytest.raises(SpecMismatch, match=r"null block inside the range \[0, 3\)"):
        load_job([[1, N, 3]], [["k"]], 12, 4, 4)


STATE = [N, N, N, 43, N, N, N, 47, 48]  # align mode: checkpoints at tokens 16 and 32, the running state in 48
STATE_KEYS = [["f0", "f1"], ["r0", "r1"]]


def test_a_recurrent_group_stores_the_checkpoint_at_each_offloaded_block_end():
    assert storable_keys(STATE, STATE_KEYS[1], 4, 0, 2) == ["r0", "r1"]
    assert storable_keys([N, N, N, N, N, N, N, 47], STATE_KEYS[1], 4, 0, 2) == ["r1"]  # no checkpoint at 16
    gpu = store_job([FULL, STATE], STATE_KEYS, ["f0", "f1", "r0", "r1"], 4, state_groups={1})
    assert gpu.block_ids.tolist() == FULL + [43, 47]
    assert (gpu.group_sizes, gpu.block_indices) == ((8, 2), (0, 3))
    # One CPU slot per checkpoint, not `factor` sub-blocks: the slots the manager gave r0 and r1.
    slices = split_groups(gpu, [5, 6, 7, 8], 4, 2, state_groups={1})
    assert slices[1].state and slices[1].device_ids.tolist() == [43, 47] and slices[1].cpu_ids.tolist() == [7, 8]
    # Read as tokens, the second checkpoint would be taken for the first sub-block of r1's slot.
    as_tokens = split_groups(gpu, [5, 6, 7, 8], 4, 2)[1]
    assert not as_tokens.state and as_tokens.cpu_sub_blocks(4).tolist() == [31, 32]


def test_a_recurrent_group_loads_the_one_checkpoint_where_the_hit_ends():
    table = [N, N, N, N, N, N, N, 57]  # a reader's fresh table over 32 tokens: the state goes in its last block
    keys, gpu = load_job([FULL, table], STATE_KEYS, 32, 4, 4, state_groups={1})
    assert keys == ["f0", "f1", "r1"]
    assert (gpu.block_ids.tolist(), gpu.group_sizes, gpu.block_indices) == (FULL + [57], (8, 1), (0, 7))
    have = [[True] * 8, [False] * 7 + [True]]  # all of it a local prefix-cache hit: nothing to load
    keys, gpu = load_job([FULL, table], STATE_KEYS, 32, 4, 4, have, state_groups={1})
    assert keys == [] and gpu.group_sizes == (0, 0)
    with pytest.raises(SpecMismatch, match="must end on an offloaded block's end"):
        load_job([FULL, table], STATE_KEYS, 24, 4, 4, state_groups={1})
    with pytest.raises(SpecMismatch, match="no block at logical index 7"):
        load_job([FULL, [N] * 8], STATE_KEYS, 32, 4, 4, state_groups={1})
