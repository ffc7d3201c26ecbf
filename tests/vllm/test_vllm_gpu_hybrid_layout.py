"""`VllmGpuLayout` for a hybrid model (no vLLM or GPU needed): vLLM's hybrid allocator on GPU.

Every layer is its own tensor of `num_blocks` unified pages. An attention layer's block is the
GPU backend's `[N, H, C]` (LBNHC) or `[H, N, C]` (LBHNC) with C = K | V of one (token, head),
padded to the page; a Mamba2 layer's page is vLLM's state (conv `[kernel - 1, x | B | C local
channels]`, then SSM `[heads, head_dim, state]`), unpadded. The memory is written here the way
those kernels index it; a plan between two such engines of different TP must leave every
destination byte equal to what the destination's kernels would have written, and nothing else.
The state page itself is checked against vLLM's own code in `test_vllm_mamba_pages.py`, the
attention strides in `test_vllm_gpu_layouts.py`.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvbridge.core.plan import Request, plan_request
from kvbridge.core.spec import ModelSpec
from kvbridge.errors import InvalidRequest
from kvbridge.integrations.vllm.gpu_layouts import gpu_layout
from kvbridge.integrations.vllm.layout import vllm_conv_rows
from paged_move import execute_between

M_HEADS, M_DIM, GROUPS, STATE, KERNEL, H_KV, H_DIM = 4, 32, 2, 16, 4, 2, 32
N_TOKENS, BLOCKS = 70, 6


def hybrid_spec() -> ModelSpec:
    import transformers

    from kvbridge.models.config import spec_from_hf_config

    config = transformers.NemotronHConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, hybrid_override_pattern="M*M*",
        num_attention_heads=4, num_key_value_heads=H_KV, head_dim=H_DIM, mamba_num_heads=M_HEADS,
        mamba_head_dim=M_DIM, n_groups=GROUPS, ssm_state_size=STATE, conv_kernel=KERNEL)
    return vllm_conv_rows(spec_from_hf_config(config.to_dict(), dtype="float32", warn=False))


def engine(layout, spec, state, kv, ids) -> list[list[torch.Tensor]]:
    """Per rank, per layer, the float32 pages vLLM would hold: state[li] in block ids["m"], the
    attention K/V of every token in blocks ids["a"], written by the backend's indexing."""
    tp = layout.tp_size
    page = int(layout.addressing(spec, 0).block_stride.max()) // 4
    out = []
    for r in range(tp):
        tensors = []
        for li, layer in enumerate(spec.layers):
            pages = torch.zeros(BLOCKS, page)
            if layer.is_recurrent:
                conv, ssm = state[li]
                x, b, c = conv.split([M_HEADS * M_DIM, GROUPS * STATE, GROUPS * STATE], dim=1)
                local = torch.cat([t.chunk(tp, dim=1)[r] for t in (x, b, c)], dim=1).reshape(-1)
                s = ssm.chunk(tp)[r].reshape(-1)
                pages[ids["m"], : local.numel()] = local
                pages[ids["m"], local.numel(): local.numel() + s.numel()] = s
            else:
                hl, n = H_KV // tp, layout.group_block_size(spec.layer_group[li])
                cells = pages[:, : n * hl * 2 * H_DIM]
                view = (cells.view(BLOCKS, n, hl, 2 * H_DIM) if layout.cache_layout == "LBNHC"
                        else cells.view(BLOCKS, hl, n, 2 * H_DIM).transpose(1, 2))  # [B, N, H, C] either way
                for t in range(N_TOKENS):
                    blk = ids["a"][t // n]
                    for h in range(hl):
                        view[blk, t % n, h, :H_DIM] = kv[li, 0, t, r * hl + h]
                        view[blk, t % n, h, H_DIM:] = kv[li, 1, t, r * hl + h]
            tensors.append(pages.view(-1))
        out.append(tensors)
    return out


@pytest.mark.parametrize("p_tp,d_tp,cache_layout", [(1, 2, "LBNHC"), (2, 1, "LBHNC"), (2, 2, "LBNHC")])
def test_hybrid_gpu_pages_move_state_and_kv_where_the_kernels_read_them(p_tp, d_tp, cache_layout):
    spec = hybrid_spec()
    src = msgspec.structs.replace(gpu_layout("FLASH_ATTN", 32, BLOCKS, cache_layout=cache_layout, tp_size=p_tp),
                                  group_block_sizes=(512, 32))
    dst = msgspec.structs.replace(src, tp_size=d_tp)
    g = torch.Generator().manual_seed(p_tp * 10 + d_tp)
    state = {li: (torch.randn(KERNEL - 1, M_HEADS * M_DIM + 2 * GROUPS * STATE, generator=g),
                  torch.randn(M_HEADS, M_DIM, STATE, generator=g)) for li in (0, 2)}
    kv = torch.randn(4, 2, N_TOKENS, H_KV, H_DIM, generator=g)
    src_ids, dst_ids = {"m": 4, "a": [1, 3, 0]}, {"m": 0, "a": [5, 2, 4]}
    src_engine = engine(src, spec, state, kv, src_ids)
    want = engine(dst, spec, state, kv, dst_ids)
    request = Request(((src_ids["m"],), tuple(src_ids["a"])), ((dst_ids["m"],), tuple(dst_ids["a"])), N_TOKENS)
    plan = plan_request(spec, src, dst, request)
    got = execute_between(spec, src, dst, plan, src_engine, want)
    for r in range(d_tp):
        for li in range(4):
            assert torch.equal(got[r][li], want[r][li]), (r, li)
    state_bytes = 4 * ((KERNEL - 1) * (M_HEADS * M_DIM + 2 * GROUPS * STATE) + M_HEADS * M_DIM * STATE)
    assert plan.nbytes == 2 * state_bytes + 2 * 2 * N_TOKENS * H_KV * H_DIM * 4


def test_hybrid_pages_need_a_per_layer_layout_and_room():
    spec = hybrid_spec()
    with pytest.raises(InvalidRequest, match="L outermost"):
        gpu_layout("FLASH_ATTN", 32, BLOCKS, cache_layout="BLNHC").addressing(spec, 0)
    with pytest.raises(InvalidRequest, match="smaller than a layer's page"):
        gpu_layout("FLASH_ATTN", 32, BLOCKS, page_size_padded=1024).addressing(spec, 0)
