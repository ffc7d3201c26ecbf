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

import msgspec
import numpy as np
import pytest
import torch

from kvbridge.errors import IncompatibleEngines
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.local import LocalExecutor
from paged_move import execute_between
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
    assert vllm_cpu_spec(mla).layers == mla.layers  # an MLA latent is addressed as it is (see below)
    with pytest.raises(IncompatibleEngines, match="describe the model with vllm_cpu_spec"):
        layout.addressing(PLAIN, 0)


def test_spec_keeps_geometry_and_fingerprint():
    assert SPEC.fingerprint() == PLAIN.fingerprint()
    assert SPEC.bytes_per_token() == PLAIN.bytes_per_token()
    SPEC.check_compatible(PLAIN)
    assert [c.name for c in SPEC.layers[0].components][:2] == ["k0", "k1"]
    assert len(SPEC.layers[0].components) == DIM + 1


# --- hybrid (Mamba2 + attention) as vLLM CPU's hybrid allocator keeps it ---------------------------------------------
# Nemotron-H "M*M*": per block id one unified page per layer (vLLM pads the smaller kind to the
# larger); an attention block is [H_local, N, 2*D] (K^T | V per head), a Mamba page is the conv
# state [kernel-1, conv_local] (SD: row r holds every local channel's r-th value, channels
# x_local | B_local | C_local) then the SSM state [heads_local, head_dim, state], unpadded.
M_HEADS, M_DIM, GROUPS, STATE, KERNEL, H_KV, H_DIM = 4, 32, 2, 16, 4, 2, 32


def hybrid_spec() -> ModelSpec:
    import transformers

    from kvbridge.integrations.vllm.layout import vllm_conv_rows
    from kvbridge.models.config import spec_from_hf_config

    config = transformers.NemotronHConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, hybrid_override_pattern="M*M*",
        num_attention_heads=4, num_key_value_heads=H_KV, head_dim=H_DIM, mamba_num_heads=M_HEADS,
        mamba_head_dim=M_DIM, n_groups=GROUPS, ssm_state_size=STATE, conv_kernel=KERNEL)
    return vllm_cpu_spec(vllm_conv_rows(spec_from_hf_config(config.to_dict(), dtype="float32", warn=False)))


def hybrid_engine(layout: VllmCpuLayout, spec: ModelSpec, state: dict, kv: torch.Tensor, ids: dict) -> list:
    """Per rank, per layer, the flat float32 pages vLLM would hold after the prefill: `state[li]`
    (conv [KERNEL-1, x|B|C channels], ssm [heads, dim, state]) in request block `ids["m"]`, and
    `kv[li, k/v, token, head, :]` in the attention blocks `ids["a"]`."""
    tp, page = layout.tp_size, layout.addressing(spec, 0).block_stride.max() // 4
    out = []
    for r in range(tp):
        tensors = []
        for li, layer in enumerate(spec.layers):
            buf = torch.zeros(layout.num_blocks * page)
            pages = buf.view(layout.num_blocks, page)
            if layer.is_recurrent:
                conv, ssm = state[li]
                x, b, c = conv.split([M_HEADS * M_DIM, GROUPS * STATE, GROUPS * STATE], dim=1)
                local = torch.cat([t.chunk(tp, dim=1)[r] for t in (x, b, c)], dim=1)  # vLLM's x|B|C split per TP
                s = ssm.chunk(tp)[r].reshape(-1)
                pages[ids["m"], : local.numel()] = local.reshape(-1)
                pages[ids["m"], local.numel(): local.numel() + s.numel()] = s
            else:
                hl, n = H_KV // tp, layout.group_block_size(spec.layer_group[li])
                blocks = pages[:, : hl * n * 2 * H_DIM].view(layout.num_blocks, hl, n, 2 * H_DIM)
                for t in range(kv.shape[2]):
                    blk, off = ids["a"][t // n], t % n
                    for h in range(hl):
                        chunk = blocks[blk, h].view(2, n * H_DIM)
                        chunk[0].view(H_DIM, n)[:, off] = kv[li, 0, t, r * hl + h]  # K transposed
                        chunk[1].view(n, H_DIM)[off] = kv[li, 1, t, r * hl + h]
            tensors.append(buf)
        out.append(tensors)
    return out


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 2)])
def test_hybrid_plans_land_state_and_kv_where_vllm_reads_them(p_tp, d_tp):
    spec = hybrid_spec()
    assert [layer.kind for layer in spec.layers] == ["recurrent", "full", "recurrent", "full"]
    src = VllmCpuLayout(tp_size=p_tp, block_size=64, num_blocks=6, group_block_sizes=(512, 64), kv_order="HND",
                        kv_placement="blocks_first", layer_placement="per_layer")
    dst = msgspec.structs.replace(src, tp_size=d_tp)
    n = 70
    g = torch.Generator().manual_seed(p_tp * 10 + d_tp)
    state = {li: (torch.randn(KERNEL - 1, M_HEADS * M_DIM + 2 * GROUPS * STATE, generator=g),
                  torch.randn(M_HEADS, M_DIM, STATE, generator=g)) for li in (0, 2)}
    kv = torch.randn(4, 2, n, H_KV, H_DIM, generator=g)
    src_ids, dst_ids = {"m": 4, "a": [1, 3]}, {"m": 0, "a": [5, 2]}
    src_engine = hybrid_engine(src, spec, state, kv, src_ids)
    want = hybrid_engine(dst, spec, state, kv, dst_ids)
    # kvbridge's groups: (recurrent layers), (attention layers); per group its block ids
    request = Request(((src_ids["m"],), tuple(src_ids["a"])), ((dst_ids["m"],), tuple(dst_ids["a"])), n)
    plan = plan_request(spec, src, dst, request)
    got = execute_between(spec, src, dst, plan, src_engine, want)
    for r in range(d_tp):
        for li in range(4):
            assert torch.equal(got[r][li], want[r][li]), (r, li)  # every byte, and nothing else written
    state_bytes = 4 * ((KERNEL - 1) * (M_HEADS * M_DIM + 2 * GROUPS * STATE) + M_HEADS * M_DIM * STATE)
    assert plan.nbytes == 2 * state_bytes + 2 * 2 * n * H_KV * H_DIM * 4


@pytest.mark.parametrize("d_tp,d_block", [(2, 32), (1, 64)])
def test_a_hybrid_pool_block_and_its_checkpoint_round_trip_between_vllm_shapes(d_tp, d_block):
    """The pool's path for a hybrid in vLLM's `align` mode: a 64-token pool block of attention and
    the Mamba state at its end go from a TP 1 block 64 engine's unified pages into vLLM CPU staging
    (no page: `vllm_staging`) and back into an engine of another TP and block size. With the page
    given (`page_bytes`), each group's layers are addressed alone as in the whole model, which the
    offload planner needs; every byte lands where vLLM reads it, nothing else is written."""
    from kvbridge.integrations.vllm.layout import unified_page
    from kvbridge.offload.pool import CPUPool
    from kvbridge.offload.spec import CPULoadStoreSpec, GPULoadStoreSpec
    from kvbridge.offload.worker import OffloadWorker

    spec = hybrid_spec()
    src = VllmCpuLayout(tp_size=1, block_size=64, num_blocks=6, group_block_sizes=(64, 64), kv_order="HND",
                        kv_placement="blocks_first", layer_placement="per_layer")
    dst = msgspec.structs.replace(src, tp_size=d_tp, block_size=d_block, group_block_sizes=(d_block, d_block))
    g = torch.Generator().manual_seed(d_tp * 100 + d_block)
    state = {li: (torch.randn(KERNEL - 1, M_HEADS * M_DIM + 2 * GROUPS * STATE, generator=g),
                  torch.randn(M_HEADS, M_DIM, STATE, generator=g)) for li in (0, 2)}
    kv = torch.randn(4, 2, 64, H_KV, H_DIM, generator=g)
    n_dst = 64 // d_block
    src_ids, dst_ids = {"m": 4, "a": [1]}, {"m": 3, "a": [5, 2][:n_dst]}

    def caches(layout, pages):
        given = msgspec.structs.replace(layout, page_bytes=unified_page(spec, layout, 0))
        need = given.addressing(spec, 0).region_nbytes
        return [RankCache(spec, given, r, [t.view(torch.uint8)[:n] for t, n in zip(pages[r], need)])
                for r in range(layout.tp_size)]

    writer = caches(src, hybrid_engine(src, spec, state, kv, src_ids))
    reader_pages = [[torch.randn(t.numel(), generator=g) for t in rank]
                    for rank in hybrid_engine(dst, spec, state, kv, dst_ids)]
    before = [[t.clone() for t in rank] for rank in reader_pages]
    reader = caches(dst, reader_pages)
    staging_layout = msgspec.structs.replace(vllm_cpu_layout(1, 64, 2), page_bytes=0)  # pool_config.vllm_staging
    staging = CPUPool.allocate(spec, staging_layout, "canonical", pin_memory=False)
    # kvbridge's groups: 0 the Mamba layers (one checkpoint), 1 the attention layers
    with OffloadWorker(writer, staging) as w:
        w.wait([w.submit((GPULoadStoreSpec([src_ids["m"], *src_ids["a"]], (1, 1), (0, 0)), CPULoadStoreSpec([0, 1])))])
    for rc in reader:
        with OffloadWorker([rc], staging) as w:
            w.wait([w.submit((CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([dst_ids["m"], *dst_ids["a"]], (1, n_dst),
                                                                          (n_dst - 1, 0))))])
    want = hybrid_engine(dst, spec, state, kv, dst_ids)
    page = unified_page(spec, dst, 0) // 4
    for r, rc in enumerate(reader):
        for li in range(4):
            n = int(rc.addr.region_nbytes[li]) // 4
            got, expect, old = reader_pages[r][li][:n], want[r][li][:n], before[r][li][:n]
            mask = torch.zeros(n, dtype=torch.bool)
            blocks = [dst_ids["m"]] if spec.layers[li].is_recurrent else dst_ids["a"]
            for b in blocks:
                mask[b * page:min(n, (b + 1) * page)] = True
            written = mask & (expect != 0)  # the bytes vLLM would read: the state, the K/V rows
            assert torch.equal(got[written], expect[written]), (r, li)
            assert torch.equal(got[~written], old[~written]), (r, li)  # padding and other blocks untouched


MLA_DIM = 96  # a latent row: kv_lora_rank values, then the rope part


@pytest.mark.parametrize("p,d", [((1, 64), (2, 32)), ((2, 32), (1, 16)), ((1, 16), (4, 64))])
def test_mla_latents_land_where_the_backend_reads(p, d):
    """vLLM CPU's MLA backends keep `[blocks, block, latent]` per layer (CPU_MLA views it as rows
    of the latent; AMX_MLA's cache-write was probed to place them the same way, and the pool
    connector runs the layer's own cache-write at start): every rank holds every token's latent.
    A plan from one TP and block size into another lands each row at its token's slot on every
    destination rank, and nothing else is written."""
    spec = vllm_cpu_spec(ModelSpec.uniform(LAYERS, 1, MLA_DIM, "float32", kinds=("mla",)))
    src, dst = vllm_cpu_layout(p[0], p[1], 12), vllm_cpu_layout(d[0], d[1], 12)
    n = 150
    src_ids = list(range(11, 11 - -(-n // src.block_size), -1))
    dst_ids = list(range(-(-n // dst.block_size)))[::-1]
    values = torch.randn(LAYERS, n, MLA_DIM)

    def engine(layout):
        return [[torch.zeros(layout.num_kernel_blocks, layout.kernel_size, MLA_DIM) for _ in range(LAYERS)]
                for _ in range(layout.tp_size)]

    src_engine = engine(src)
    kb, off = slots(src, src_ids, np.arange(n))
    for tensors in src_engine:
        for li, t in enumerate(tensors):
            t[kb, off] = values[li]
    plan = plan_request(spec, src, dst, Request.single_group(src_ids, dst_ids, n))
    got = execute_between(spec, src, dst, plan, src_engine, engine(dst))
    kb, off = slots(dst, dst_ids, np.arange(n))
    for tensors in got:
        for li, t in enumerate(tensors):
            assert torch.equal(t[kb, off], values[li])
            t[kb, off] = 0
            assert not t.any()  # nothing outside the request's slots
