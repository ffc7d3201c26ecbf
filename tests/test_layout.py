"""Addressing invariants of `EngineLayout` / `Addressing` / `RankCache` and vLLM's registration
sizes (shared/reference/topology.md §2.8, §2.9, §4.I, §4.J)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge import EngineLayout, LayerSpec, ModelSpec, RankCache

SPEC = ModelSpec((LayerSpec("full", 4, 64, 32), LayerSpec("full", 4, 64, 32)), "float16")  # K dim 64, V dim 32


def comp_block(addr, layout, li, ci):
    return int(addr.heads[li, ci]) * layout.kernel_size * int(addr.row_bytes[li, ci])


@pytest.mark.parametrize("kernel", [None, 4])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_hnd_strides(tp, kernel):
    layout = EngineLayout(tp_size=tp, block_size=16, num_blocks=3, kernel_block_size=kernel, kv_order="HND")
    kbs = layout.kernel_size
    for rank in range(tp):
        a = layout.addressing(SPEC, rank)
        for li in range(2):
            for ci, dim in enumerate((64, 32)):
                row = dim * 2
                assert a.row_bytes[li, ci] == row
                assert a.token_stride[li, ci] == row
                assert a.head_stride[li, ci] == kbs * row  # head stride = block_size * row (kernel block)
                assert a.heads[li, ci] == max(1, 4 // tp)
                assert a.first_head[li, ci] == rank * 4 // tp


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_nhd_strides(tp):
    layout = EngineLayout(tp_size=tp, block_size=8, num_blocks=3, kv_order="NHD")
    a = layout.addressing(SPEC, 0)
    heads = 4 // tp
    for ci, dim in enumerate((64, 32)):
        row = dim * 2
        assert a.head_stride[0, ci] == row
        assert a.token_stride[0, ci] == heads * row  # token stride = heads * row


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_kv_first_positions_and_region_sizes(order):
    layout = EngineLayout(tp_size=2, block_size=16, num_blocks=5, kv_order=order, kv_placement="kv_first")
    a = layout.addressing(SPEC, 1)
    k_block, v_block = 2 * 16 * 64 * 2, 2 * 16 * 32 * 2
    for li in range(2):
        assert a.region[li, 0] == a.region[li, 1] == li  # one region per layer
        assert a.base[li, 0] == 0 and a.block_stride[li, 0] == k_block  # all K blocks first
        assert a.base[li, 1] == 5 * k_block and a.block_stride[li, 1] == v_block  # then all V blocks
        assert comp_block(a, layout, li, 0) == k_block and comp_block(a, layout, li, 1) == v_block
    assert a.region_nbytes == (5 * (k_block + v_block),) * 2


@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_blocks_first_positions(order):
    layout = EngineLayout(tp_size=1, block_size=16, num_blocks=5, kv_order=order, kv_placement="blocks_first")
    a = layout.addressing(SPEC, 0)
    k_block, v_block = 4 * 16 * 64 * 2, 4 * 16 * 32 * 2
    for li in range(2):
        assert a.base[li, 0] == 0 and a.base[li, 1] == k_block  # [K | V] inside each block
        assert a.block_stride[li, 0] == a.block_stride[li, 1] == k_block + v_block
    assert a.region_nbytes == (5 * (k_block + v_block),) * 2


def test_cross_layer():
    layout = EngineLayout(tp_size=1, block_size=16, num_blocks=5, kv_placement="blocks_first",
                          layer_placement="cross_layer")
    a = layout.addressing(SPEC, 0)
    k_block, v_block = 4 * 16 * 64 * 2, 4 * 16 * 32 * 2
    per_block = 2 * (k_block + v_block)
    assert a.region_nbytes == (5 * per_block,)
    assert np.all(a.region == 0)
    assert np.all(a.block_stride == per_block)
    assert a.base.tolist() == [[0, k_block], [k_block + v_block, 2 * k_block + v_block]]


def test_mla_addressing_replicated():
    spec = ModelSpec.uniform(3, 1, 576, kinds=("mla",))
    layout = EngineLayout(tp_size=4, block_size=16, num_blocks=2)
    for rank in range(4):
        a = layout.addressing(spec, rank)
        assert a.num_components.tolist() == [1, 1, 1]
        assert a.heads[:, 0].tolist() == [1, 1, 1] and a.first_head[:, 0].tolist() == [0, 0, 0]
        assert a.region_nbytes == (2 * 16 * 576 * 2,) * 3


@pytest.mark.parametrize(("block", "kernel"), [(16, 16), (16, 8), (16, 4), (12, 4), (6, 1)])
def test_kernel_slots(block, kernel):
    layout = EngineLayout(block_size=block, kernel_block_size=kernel, num_blocks=10)
    ratio = block // kernel
    assert layout.kernel_blocks_per_block == ratio and layout.num_kernel_blocks == 10 * ratio
    ids = np.array([7, 2, 9, 0])
    positions = np.arange(len(ids) * block)
    kb, off = layout.kernel_slots(ids, positions)
    b, t = positions // block, positions % block
    assert np.array_equal(kb, ids[b] * ratio + t // kernel)
    assert np.array_equal(off, t % kernel)


def test_kernel_block_region_size_is_unchanged():
    # Smaller kernel blocks split the same memory differently; total bytes are the same.
    a = EngineLayout(block_size=16, num_blocks=4).addressing(SPEC, 0)
    b = EngineLayout(block_size=16, kernel_block_size=4, num_blocks=4).addressing(SPEC, 0)
    assert a.region_nbytes == b.region_nbytes
    assert b.block_stride[0, 0] * 4 == a.block_stride[0, 0]


# --------------------------------------------------------------------------------------------
# vLLM registration sizes (§4.I): block 16, 4 heads, head dim 64, fp16, num_blocks 2
# --------------------------------------------------------------------------------------------

SPEC_4I = ModelSpec.uniform(2, 4, 64, "float16")


def test_registration_kv_first():
    # FLASH_ATTN (2, N, B, H, D): tensor[0] (all K blocks) = 2*16*4*64*2 = 16384; per block 8192.
    layout = EngineLayout(block_size=16, num_blocks=2, kv_placement="kv_first")
    a = layout.addressing(SPEC_4I, 0)
    assert comp_block(a, layout, 0, 0) == 16 * 4 * 64 * 2 == 8192
    assert a.block_stride[0, 0] == 8192
    assert a.base[0, 1] == 16384  # the K "tensor[0]" is 16384 B, V follows
    assert a.region_nbytes == (32768, 32768)


def test_registration_blocks_first():
    # FLASHINFER (N, 2, B, H, D): 32768 per layer tensor, descriptor len 32768/2/2 = 8192.
    layout = EngineLayout(block_size=16, num_blocks=2, kv_placement="blocks_first")
    a = layout.addressing(SPEC_4I, 0)
    assert a.region_nbytes == (32768, 32768)
    assert a.block_stride[0, 0] == 16384 and a.base[0, 1] == 8192
    assert comp_block(a, layout, 0, 0) == comp_block(a, layout, 0, 1) == 32768 // 2 // 2


def test_registration_cross_layer():
    # 32 layers, 8 blocks: one region, per block size/8.
    spec = ModelSpec.uniform(32, 4, 64, "float16")
    layout = EngineLayout(block_size=16, num_blocks=8, kv_placement="blocks_first", layer_placement="cross_layer")
    a = layout.addressing(spec, 0)
    assert len(a.region_nbytes) == 1
    assert a.region_nbytes[0] == 8 * 32 * 2 * 8192
    assert np.all(a.block_stride == a.region_nbytes[0] // 8)


# --------------------------------------------------------------------------------------------
# Layout invariants through RankCache (§4.J)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_physical_order_of_heads_and_tokens(order):
    # HND puts heads before tokens inside a block; NHD tokens before heads.
    spec = ModelSpec.uniform(1, 2, 4, "float32")
    layout = EngineLayout(block_size=3, num_blocks=2, kv_order=order)
    cache = RankCache.allocate(spec, layout, 0)
    view = cache.logical_view(0, 0)  # [block, token, head, dim]
    view.copy_(torch.arange(view.numel(), dtype=torch.float32).reshape(view.shape))
    k_part = cache.regions[0][:2 * 3 * 2 * 4].reshape(2, -1)  # K of both blocks (kv_first)
    block0 = k_part[0]
    if order == "HND":
        expected = view[0].permute(1, 0, 2).reshape(-1)  # [head, token, dim]
    else:
        expected = view[0].reshape(-1)  # [token, head, dim]
    assert torch.equal(block0, expected)


@pytest.mark.parametrize("placement", [("kv_first", "per_layer"), ("blocks_first", "per_layer"),
                                       ("blocks_first", "cross_layer")])
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_logical_views_tile_the_regions_exactly(placement, order):
    # Every byte of every region belongs to exactly one (layer, comp, block, token, head, dim) element.
    layout = EngineLayout(tp_size=2, block_size=4, kernel_block_size=2, num_blocks=3, kv_order=order,
                          kv_placement=placement[0], layer_placement=placement[1])
    cache = RankCache.allocate(SPEC, layout, 1)
    marks = [torch.zeros(r.numel(), dtype=torch.int32) for r in cache.regions]
    for li in range(2):
        for ci in range(2):
            region = int(cache.addr.region[li, ci])
            view = cache.logical_view(li, ci)
            idx = torch.arange(cache.regions[region].numel()).as_strided(view.shape, view.stride(),
                                                                          view.storage_offset())
            marks[region].index_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.int32))
    for m in marks:
        assert torch.all(m == 1)


def test_write_then_read_tokens_roundtrip():
    layout = EngineLayout(tp_size=2, block_size=4, kernel_block_size=2, num_blocks=4, kv_order="NHD")
    cache = RankCache.allocate(SPEC, layout, 0)
    ids = np.array([3, 1])
    pos = np.array([0, 3, 5, 6])
    vals = torch.arange(4 * 2 * 64, dtype=torch.float16).reshape(4, 2, 64)
    cache.write_tokens(1, 0, ids, pos, vals)
    assert torch.equal(cache.read_tokens(1, 0, ids, pos), vals)
    # token 5 of the request is logical block 1 (id 1), offset 1 -> kernel block 1*2 + 0, offset 1
    assert torch.equal(cache.logical_view(1, 0)[2, 1], vals[2])


def test_a_layer_of_another_pp_stage_has_no_view():
    """Its region is -1: a view would have indexed this rank's last region (the wrong layer's bytes)."""
    cache = RankCache.allocate(SPEC, EngineLayout(tp_size=1, pp_size=2, block_size=4, num_blocks=4), 1)
    with pytest.raises(IndexError, match="layer 0 is not held by this rank"):
        cache.logical_view(0, 0)
    assert cache.logical_view(SPEC.num_layers - 1, 0).numel() > 0


def test_logical_view_of_regions_sliced_from_one_buffer():
    """Regions may be views into a larger allocation (one arena, vLLM's shared pools): views must
    start where each region starts, not at the start of the underlying storage."""
    import random as _random

    from kvbridge.proofs.verify import fill_source, mismatch_report, random_request

    spec = ModelSpec.uniform(3, 4, 8, "bfloat16")
    layout = EngineLayout(tp_size=2, block_size=4, num_blocks=6)
    sizes = layout.addressing(spec, 0).region_nbytes
    arena = torch.zeros(sum(sizes) // 2 + 64, dtype=torch.bfloat16)
    regions, start = [], 32  # leave a gap so no region starts at offset 0
    for n in sizes:
        regions.append(arena[start:start + n // 2])
        start += n // 2
    cache = RankCache(spec, layout, 0, regions)
    req = random_request(spec, layout, layout, 10, 0, _random.Random(0))
    fill_source([cache], req.src_block_ids, 10)
    assert torch.count_nonzero(arena[:32]) == 0  # nothing written before the first region
    separate = RankCache.allocate(spec, layout, 0)
    fill_source([separate], req.src_block_ids, 10)
    assert mismatch_report([cache], [separate]) == []
