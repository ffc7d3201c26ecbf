"""`VllmCpuLayout` + `VllmCpuLayerSpec` against vLLM CPU attention's cache bytes (no vLLM needed).

vLLM 0.32's CPU backend receives a layer cache `[B, H, N, 2*D]`, splits each (block, head)
chunk in two halves (`kv.view(B, H, 2*N, D).chunk(2, dim=2)`), and its `vec` kernel
(`cpu_attn_reshape_and_cache`, checked against the real op by `check_cpu_kv_layout` in the
connector and by the vLLM tests) writes K transposed (`[D, N]`) into the first half and V by rows
(`[N, D]`) into the second. These tests write K/V that way and check that kvbridge's addressing
finds every element, and that plans between two such engines of different TP and block sizes land
every element where the decode engine's kernel will read it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.errors import IncompatibleEngines
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.local import LocalExecutor
from kvbridge.integrations.vllm.layout import VllmCpuLayout, as_vllm_cpu, vllm_cpu_layout, vllm_cpu_spec

HEADS, DIM, LAYERS = 4, 32, 2
PLAIN = ModelSpec.uniform(LAYERS, HEADS, DIM, "float32")
SPEC = vllm_cpu_spec(PLAIN)


def vllm_engine(layout: VllmCpuLayout) -> list[list[torch.Tensor]]:
    """Per rank, per layer: the `[B, H, N, 2*D]` tensor vLLM CPU allocates (zeros)."""
    local = max(1, HEADS // layout.tp_size)
    return [[torch.zeros(layout.num_kernel_blocks, local, layout.kernel_size, 2 * DIM) for _ in range(LAYERS)]
            for _ in range(layout.tp_size)]


def backend_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K as the vec kernel stores it, indexed [block, head, token, dim] (a view of K^T), and V."""
    b, h, n, _ = kv.shape
    halves = kv.view(b, h, 2, n * DIM)
    k = halves[:, :, 0].view(b, h, DIM, n).transpose(2, 3)
    v = halves[:, :, 1].view(b, h, n, DIM)
    return k, v


def rank_cache(layout: VllmCpuLayout, rank: int, tensors: list[torch.Tensor]) -> RankCache:
    return RankCache(SPEC, layout, rank, [t.view(-1) for t in tensors])


def slots(layout: EngineLayout, block_ids: list[int], positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return layout.kernel_slots(np.asarray(block_ids), positions)


def fill(engine, layout, block_ids, num_tokens, values):
    """Write values[layer, kv, token, head, :] through the backend's K and V views."""
    pos = np.arange(num_tokens)
    kb, off = slots(layout, block_ids, pos)
    for r, tensors in enumerate(engine):
        lo = r * HEADS // layout.tp_size
        for li, kv in enumerate(tensors):
            k, v = backend_kv(kv)
            for h in range(k.shape[1]):
                k[kb, h, off] = values[li, 0, :, lo + h]
                v[kb, h, off] = values[li, 1, :, lo + h]


def read(engine, layout, block_ids, num_tokens) -> torch.Tensor:
    pos = np.arange(num_tokens)
    kb, off = slots(layout, block_ids, pos)
    out = torch.zeros(LAYERS, 2, num_tokens, HEADS, DIM)
    for r, tensors in enumerate(engine):
        lo = r * HEADS // layout.tp_size
        for li, kv in enumerate(tensors):
            k, v = backend_kv(kv)
            for h in range(k.shape[1]):
                out[li, 0, :, lo + h] = k[kb, h, off]
                out[li, 1, :, lo + h] = v[kb, h, off]
    return out


@pytest.mark.parametrize("tp,block,kernel", [(1, 32, None), (2, 64, None), (4, 64, 32)])
def test_addressing_finds_every_row_the_backend_wrote(tp, block, kernel):
    layout = vllm_cpu_layout(tp, block, 8, kernel)
    engine = vllm_engine(layout)
    n = 150
    ids = [6, 0, 7, 2, 5][: -(-n // block)]
    values = torch.randn(LAYERS, 2, n, HEADS, DIM)
    fill(engine, layout, ids, n, values)
    for r in range(tp):
        cache = rank_cache(layout, r, engine[r])
        lo = r * HEADS // tp
        for li in range(LAYERS):
            k = torch.cat([cache.read_tokens(li, d, np.asarray(ids), np.arange(n)) for d in range(DIM)], dim=2)
            v = cache.read_tokens(li, DIM, np.asarray(ids), np.arange(n))
            assert torch.equal(k, values[li, 0, :, lo:lo + k.shape[1]]), (r, li)
            assert torch.equal(v, values[li, 1, :, lo:lo + v.shape[1]]), (r, li)


@pytest.mark.parametrize("p,d", [((1, 32), (1, 32)), ((1, 32), (1, 64)), ((1, 64), (2, 32)), ((2, 32), (1, 128)),
                                 ((4, 32), (2, 64))])
def test_plans_between_vllm_cpu_engines_land_where_the_backend_reads(p, d):
    src, dst = vllm_cpu_layout(p[0], p[1], 8), vllm_cpu_layout(d[0], d[1], 8)
    n = 173
    src_ids = list(range(7, 7 - -(-n // src.block_size), -1))
    dst_ids = list(range(-(-n // dst.block_size)))[::-1]
    values = torch.randn(LAYERS, 2, n, HEADS, DIM)
    src_engine, dst_engine = vllm_engine(src), vllm_engine(dst)
    fill(src_engine, src, src_ids, n, values)
    plan = plan_request(SPEC, src, dst, Request.single_group(src_ids, dst_ids, n))
    LocalExecutor([rank_cache(src, r, t) for r, t in enumerate(src_engine)],
                  [rank_cache(dst, r, t) for r, t in enumerate(dst_engine)]).execute(plan)
    assert torch.equal(read(dst_engine, dst, dst_ids, n), values)
    assert plan.nbytes == LAYERS * 2 * n * HEADS * DIM * 4
    if p == d:  # a whole block is contiguous on both sides: at most one run per block and layer
        full = n // src.block_size
        whole = plan_request(SPEC, src, dst, Request.single_group(src_ids[:full], dst_ids[:full], full * src.block_size))
        assert len(whole) <= LAYERS * full


def test_peer_layout_round_trip_and_refusals():
    layout = vllm_cpu_layout(2, 64, 10)
    import msgspec
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=EngineLayout)
    assert type(wire) is EngineLayout and as_vllm_cpu(wire) == layout
    # the subclass is what places K/V right
    assert not np.array_equal(layout.addressing(SPEC, 1).head_stride, wire.addressing(PLAIN, 1).head_stride[:, :1])
    with pytest.raises(IncompatibleEngines, match="not a vLLM CPU cache"):
        as_vllm_cpu(EngineLayout(tp_size=2, block_size=64, kv_order="NHD"))
    with pytest.raises(IncompatibleEngines, match="HND, blocks_first, per_layer"):
        VllmCpuLayout(tp_size=1, kv_order="NHD", kv_placement="blocks_first")
    mla = ModelSpec.uniform(2, 1, 64, "float32", kinds=("mla",))
    with pytest.raises(IncompatibleEngines, match="K/V attention layers only"):
        vllm_cpu_spec(mla)
    with pytest.raises(IncompatibleEngines, match="describe the model with vllm_cpu_spec"):
        layout.addressing(PLAIN, 0)


def test_spec_keeps_geometry_and_fingerprint():
    assert SPEC.fingerprint() == PLAIN.fingerprint()
    assert SPEC.bytes_per_token() == PLAIN.bytes_per_token()
    SPEC.check_compatible(PLAIN)
    assert [c.name for c in SPEC.layers[0].components][:2] == ["k0", "k1"]
    assert len(SPEC.layers[0].components) == DIM + 1
