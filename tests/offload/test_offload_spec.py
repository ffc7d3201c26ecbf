"""The per-group mapping of GPU blocks to CPU sub-blocks: vLLM's vectors and the consumption checks."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.errors import KVBridgeError
from kvbridge.offload.errors import SpecMismatch
from kvbridge.offload.spec import CPULoadStoreSpec, GPULoadStoreSpec, split_groups


def pairs(gpu: GPULoadStoreSpec, cpu: list[int], factor: int) -> list[tuple[int, int]]:
    out = []
    for s in split_groups(gpu, CPULoadStoreSpec(cpu), factor, len(gpu.group_sizes)):
        out += list(zip(s.device_ids.tolist(), s.cpu_sub_blocks(factor).tolist()))
    return out


def test_worked_example_two_groups_factor_4():
    """Reference 2.3: sizes (5, 3), indices (1, 0), factor 4, CPU blocks [7, 2 | 9]."""
    gpu = GPULoadStoreSpec([10, 11, 12, 13, 14, 20, 21, 22], (5, 3), (1, 0))
    slices = split_groups(gpu, CPULoadStoreSpec([7, 2, 9]), 4, 2)
    assert [(s.group, s.skip, s.cpu_ids.tolist()) for s in slices] == [(0, 1, [7, 2]), (1, 0, [9])]
    assert pairs(gpu, [7, 2, 9], 4) == [(10, 29), (11, 30), (12, 31), (13, 8), (14, 9), (20, 36), (21, 37), (22, 38)]


@pytest.mark.parametrize("gpu, cpu, factor, expected", [
    # test_transfer, bsf 1 (seed 0 samples)
    (GPULoadStoreSpec([49, 53, 5], (3,), (0,)), [132, 248, 207], 1, [(49, 132), (53, 248), (5, 207)]),
    # test_transfer, bsf 3: the first skip = 2 sampled GPU blocks are dropped, block_indices (2,)
    (GPULoadStoreSpec([56, 26, 2, 16, 32, 31, 25], (7,), (2,)), [155, 244, 183], 3,
     [(56, 467), (26, 732), (2, 733), (16, 734), (32, 549), (31, 550), (25, 551)]),
    # test_transfer_multi_group, bsf 1, group 1 empty
    (GPULoadStoreSpec([49, 53, 5, 33], (2, 0, 2), (0, 0, 0)), [248, 207, 155, 244], 1,
     [(49, 248), (53, 207), (5, 155), (33, 244)]),
    # test_transfer_multi_group, bsf 3, group 2 trimmed at both ends (skip 2, 2 blocks over 2 CPU blocks)
    (GPULoadStoreSpec([49, 48, 56, 26, 2, 16, 25, 50], (6, 0, 2), (0, 0, 2)), [244, 183, 111, 71], 3,
     [(49, 732), (48, 733), (56, 734), (26, 549), (2, 550), (16, 551), (25, 335), (50, 213)]),
])
def test_vllm_transfer_vectors(gpu, cpu, factor, expected):
    assert pairs(gpu, cpu, factor) == expected


def test_cdiv_and_truncation():
    # 3 blocks from logical index 6 with factor 4: skip 2, cdiv(3 + 2, 4) = 2 CPU blocks, last one cut after 1 sub-block
    (s,) = split_groups(GPULoadStoreSpec([1, 2, 3], (3,), (6,)), [5, 9], 4)
    assert s.skip == 2 and s.cpu_sub_blocks(4).tolist() == [22, 23, 36]


def test_block_indices_are_required():
    with pytest.raises(TypeError):
        GPULoadStoreSpec([1, 2], (2,))  # type: ignore[call-arg]
    with pytest.raises(SpecMismatch, match=r"one entry per group \(2 groups, empty ones included\)"):
        GPULoadStoreSpec([1, 2], (2, 0), (0,))


@pytest.mark.parametrize("make, message", [
    (lambda: GPULoadStoreSpec([1, 2, 3], (2, 0), (0, 0)), r"group_sizes \(2, 0\) sum to 2, but the spec has 3"),
    (lambda: GPULoadStoreSpec([1], (-1, 2), (0, 0)), r"group_sizes must be >= 0"),
    (lambda: GPULoadStoreSpec([1], (1,), (-3,)), r"block_indices must be >= 0, got \(-3,\)"),
    (lambda: CPULoadStoreSpec([4, -1]), r"negative block id -1"),
    (lambda: CPULoadStoreSpec([[1, 2]]), r"must be 1-D"),
])
def test_malformed_specs_name_the_values(make, message):
    with pytest.raises(SpecMismatch, match=message):
        make()


def test_every_id_is_consumed_exactly():
    gpu = GPULoadStoreSpec([10, 11, 12, 13, 14, 20, 21, 22], (5, 3), (1, 0))
    with pytest.raises(SpecMismatch, match=r"group 1 .* needs CPU ids \[2, 3\), but the CPU spec has only 2"):
        split_groups(gpu, [7, 2], 4, 2)
    with pytest.raises(SpecMismatch, match=r"consume 3 CPU ids, the CPU spec has 4"):
        split_groups(gpu, [7, 2, 9, 1], 4, 2)
    with pytest.raises(SpecMismatch, match=r"describes 2 KV-cache groups .* the model has 3"):
        split_groups(gpu, [7, 2, 9], 4, 3)
    with pytest.raises(KVBridgeError, match="block_size_factor must be >= 1, got 0"):
        split_groups(gpu, [7, 2, 9], 0, 2)


def test_empty_groups_consume_nothing():
    gpu = GPULoadStoreSpec([], (0, 0), (0, 5))
    assert split_groups(gpu, [], 3, 2) == []
    with pytest.raises(SpecMismatch, match="consume 0 CPU ids, the CPU spec has 1"):
        split_groups(gpu, [3], 3, 2)


def test_specs_compare_by_value():
    assert GPULoadStoreSpec([1, 2], (2,), (0,)) == GPULoadStoreSpec(np.array([1, 2]), [2], [0])
    assert GPULoadStoreSpec([1, 2], (2,), (0,)) != GPULoadStoreSpec([1, 2], (2,), (1,))
    assert CPULoadStoreSpec([1]).medium() == "CPU" and GPULoadStoreSpec([], (), ()).medium() == "GPU"
