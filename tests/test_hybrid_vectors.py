"""vLLM's hybrid-model vectors (../shared/reference/nixl_hma.md §2-3, topology.md §2.8, §2.10,
§3.5, §4.B-4.F): kernel blocks per logical block, conv splits, block-id expansion with the remote
ratio, prefix-cache trimming, the handshake refusal, and source ranks for attention vs recurrent
state. Inputs and expected values are copied from vLLM's unit tests where the reference says so.
"""

from __future__ import annotations

import pytest

from kvbridge.core.blocks import (apply_prefix_caching, check_prefix_caching, compute_physical_blocks_per_logical,
                             logical_to_kernel_block_ids)
from kvbridge.errors import InvalidRequest
from kvbridge.core.shard import conv_split
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import Component, LayerSpec, ModelSpec
from kvbridge.core.topology import TransferTopology
from kvbridge.models import spec_from_hf_config

R = lambda a, b: list(range(a, b))  # noqa: E731


# --- 4.C compute_physical_blocks_per_logical = ceil(sum(ssm_sizes) / block_len) --------------


@pytest.mark.parametrize("ssm_sizes, block_len, expected", [
    ((36864, 2097152), 8192, 261),   # Nemotron-30B TP1
    ((18432, 1048576), 4096, 261),   # TP2
    ((9216, 524288), 4096, 131),     # TP4: R depends on TP
    ((600, 600, 600, 1024), 2824, 1),  # KDA 4-tuple (exact fit)
    ((600, 600, 600, 1024), 1024, 3),
])
def test_compute_physical_blocks_per_logical(ssm_sizes, block_len, expected) -> None:
    assert compute_physical_blocks_per_logical(ssm_sizes, block_len) == expected


def test_compute_physical_blocks_per_logical_rejects_empty_pages() -> None:
    with pytest.raises(InvalidRequest, match="block_len"):
        compute_physical_blocks_per_logical((1, 2), 0)


# --- 4.D conv splits (engine view: conv_rows = kernel - 1 = 3) -------------------------------


def _mamba2(n_heads: int, head_dim: int, groups: int, d_state: int) -> LayerSpec:
    # hidden_size follows from the heads (expand 2), as transformers' BambaConfig checks.
    cfg = {"model_type": "bamba", "num_hidden_layers": 1, "attn_layer_indices": [], "hidden_size": n_heads * head_dim // 2,
           "mamba_n_heads": n_heads, "mamba_d_head": head_dim, "mamba_n_groups": groups, "mamba_d_state": d_state,
           "mamba_d_conv": 4, "torch_dtype": "bfloat16"}
    return spec_from_hf_config(cfg).layers[0]


def _gdn(k_heads: int, v_heads: int, k_dim: int = 128, v_dim: int = 128) -> LayerSpec:
    cfg = {"model_type": "qwen3_next", "num_hidden_layers": 1, "layer_types": ["linear_attention"],
           "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads, "linear_key_head_dim": k_dim,
           "linear_value_head_dim": v_dim, "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16"}
    return spec_from_hf_config(cfg).layers[0]


def _local_units(layer: LayerSpec, comp: str, tp: int) -> int:
    c = next(c for c in layer.state if c.name == comp)
    return c.heads // tp if tp <= c.heads else 1


# id, layer, local_tp, conv_dim_local, temporal shape (local heads, a, b), expected local_proj_dims
CONV_SPLITS = [
    # nemotron_h_8b: 128 heads of 64 (x = 8192) and 8 groups of d_state 128 (B = C = 1024).
    ("nemotron_h_8b_tp1", _mamba2(128, 64, 8, 128), 1, 10240, (128, 64, 128), (8192, 1024, 1024)),
    ("nemotron_h_8b_tp4", _mamba2(128, 64, 8, 128), 4, 2560, (32, 64, 128), (2048, 256, 256)),
    ("nemotron_nano_30b_tp1", _mamba2(64, 64, 8, 128), 1, 6144, (64, 64, 128), (4096, 1024, 1024)),
    # Qwen3.5 GDN: (key, key, value); value = v_heads * 128, key = k_heads * 128.
    ("qwen35_08b_tp1", _gdn(16, 16), 1, 6144, (16, 128, 128), (2048, 2048, 2048)),
    ("qwen35_08b_tp4", _gdn(16, 16), 4, 1536, (4, 128, 128), (512, 512, 512)),
    ("qwen35_4b_tp1", _gdn(16, 32), 1, 8192, (32, 128, 128), (2048, 2048, 4096)),
    ("qwen35_27b_tp1", _gdn(16, 48), 1, 10240, (48, 128, 128), (2048, 2048, 6144)),
    ("qwen35_27b_tp8", _gdn(16, 48), 8, 1280, (6, 128, 128), (256, 256, 768)),
]


@pytest.mark.parametrize("case", CONV_SPLITS, ids=[c[0] for c in CONV_SPLITS])
def test_conv_split_matches_vllm(case) -> None:
    _, layer, tp, conv_dim_local, temporal, expected = case
    assert layer.conv_rows == 3
    split = conv_split(layer, tp)
    assert split == expected
    assert sum(split) == conv_dim_local
    state = layer.state[-1]
    heads = state.heads // tp
    assert (heads, state.dim) == (temporal[0], temporal[1] * temporal[2])
    # each conv segment is its own component: units x (channels per unit * rows)
    assert [c.dim % layer.conv_rows for c in layer.state[:3]] == [0, 0, 0]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_conv_split_qwen35_397b(tp: int) -> None:
    """Older x/B/C API: GDN with 64 value heads and 16 key heads of 128: x_local = 8192/tp, b_local = 2048/tp."""
    assert conv_split(_gdn(16, 64), tp) == (2048 // tp, 2048 // tp, 8192 // tp)


def test_conv_split_gdn_32v_4k_head64_tp2() -> None:
    assert conv_split(_gdn(4, 32, 64, 64), 2) == (128, 128, 1024)


def test_conv_split_replicates_groups_beyond_their_count() -> None:
    """TP 16 over 8 B/C groups: each rank holds one whole group (replicated), x keeps sharding."""
    layer = _mamba2(128, 64, 8, 128)
    assert conv_split(layer, 16) == (512, 128, 128)
    assert _local_units(layer, "conv_b", 16) == 1


def test_conv_split_is_never_the_flat_concatenation() -> None:
    layer = _mamba2(128, 64, 8, 128)
    flat = sum(conv_split(layer, 1)) // 4
    assert conv_split(layer, 4) != (flat, 0, 0)
    assert sum(conv_split(layer, 4)) == flat


# --- 4.F logical -> kernel block ids ----------------------------------------------------------


@pytest.mark.parametrize("name, ratio, ids, recurrent, expected", [
    ("with_hma_local", 2, ([0, 1, 2], [3, 4]), (), [R(0, 6), R(6, 10)]),
    ("qwen35_4p2d", 10, ([0], [10]), (1,), [R(0, 10), [10]]),
    ("qwen35_2p4d", 6, ([0, 1], [10]), (1,), [R(0, 12), [10]]),
    ("homo_tp", 10, ([0], [10]), (1,), [R(0, 10), [10]]),
    ("mamba_remote_physical_per_logical_1", 1, ([0, 1, 2], [5]), (1,), [[0, 1, 2], [5]]),
    ("pure_fa", 4, ([0, 1],), (), [R(0, 8)]),
    ("fa_swa", 3, ([0, 1], [2, 3]), (), [R(0, 6), R(6, 12)]),
    ("dense_fa_swa", 2, ([0, 1, 2], [3, 4]), (), [R(0, 6), R(6, 10)]),
    ("mamba_fa_ssm", 34, ([5, 6], [2]), (1,), [R(170, 238), [2]]),
])
def test_logical_to_kernel_block_ids(name, ratio, ids, recurrent, expected) -> None:
    assert logical_to_kernel_block_ids(ids, ratio, recurrent) == expected


def test_remote_ids_expand_with_the_remote_ratio_not_the_local_one() -> None:
    """The seed case: P TP=4 (R 34) -> D TP=1 (R 66); FA [5, 6] lies at remote kernel blocks 170..237."""
    remote = logical_to_kernel_block_ids(([5, 6], [2]), 34, recurrent_groups=(1,))
    assert remote == [list(range(170, 238)), [2]]
    wrong = logical_to_kernel_block_ids(([5, 6], [2]), 66, recurrent_groups=(1,))
    assert wrong[0][:1] == [330] and wrong[1] == [2]
    # the superseded "remote stride x local count" rule is not what kvbridge does
    assert logical_to_kernel_block_ids(([0, 1, 2], [10, 11]), 261, (1,))[0] != [0, 1, 261, 262, 522, 523]


def test_logical_to_kernel_rejects_ratio_zero() -> None:
    with pytest.raises(InvalidRequest):
        logical_to_kernel_block_ids(([0],), 0)


# --- §3 prefix-cache trimming -----------------------------------------------------------------


def test_dense_end_trim_keeps_the_last_remote_ids() -> None:
    local, remote = apply_prefix_caching([[7, 8], [9]], [[1, 2, 3, 4], [5, 6]])
    assert local == [[7, 8], [9]] and remote == [[3, 4], [6]]


def test_dense_empty_local_group_takes_none() -> None:
    """vLLM's `remote[-0:]` keeps the whole list; kvbridge takes none (nixl_hma.md §3.1 quirk)."""
    local, remote = apply_prefix_caching([[], [4]], [[1, 2], [3, 4]])
    assert local == [[], [4]] and remote == [[], [4]]
    assert apply_prefix_caching([[]], [[]]) == ([[]], [[]])


def test_dense_more_local_than_remote_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="group 0: 3 local block ids but only 2 remote"):
        apply_prefix_caching([[1, 2, 3]], [[1, 2]])


def test_group_count_mismatch_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="local has 1 KV-cache groups, remote 2"):
        apply_prefix_caching([[1]], [[1], [2]])


@pytest.mark.parametrize("local_ratio, remote_ratio, local_ids, remote_ids", [
    (6, 10, R(0, 12), R(0, 10)),   # local6_remote10: both front-trimmed to 10
    (10, 6, R(0, 10), R(0, 12)),   # local10_remote6
])
def test_mamba_front_trim_to_the_common_kernel_blocks(local_ratio, remote_ratio, local_ids, remote_ids) -> None:
    local, remote = apply_prefix_caching([local_ids, [42]], [remote_ids, [42]], local_ratio, remote_ratio,
                                         recurrent_groups=(1,), has_recurrent=True)
    assert local == [R(0, 10), [42]] and remote == [R(0, 10), [42]]


def test_mamba_640_tokens_kernel_64() -> None:
    """640 tokens in kernel blocks of 64: remote R=10 -> 10 kernel blocks, local R=6 -> 2 logical = 12."""
    local, remote = apply_prefix_caching([R(100, 112)], [R(0, 10)], 6, 10, (), True)
    assert local == [R(100, 110)] and remote == [R(0, 10)]


def test_mamba_ssm_placeholders_keep_the_last_remote_state() -> None:
    local, remote = apply_prefix_caching([R(0, 4), [9]], [R(0, 4), [0, 0, 7]], 4, 4, (1,), True)
    assert local == [R(0, 4), [9]] and remote == [R(0, 4), [7]]
    with pytest.raises(InvalidRequest, match="one local block"):
        apply_prefix_caching([R(0, 4), [8, 9]], [R(0, 4), [0, 0, 7]], 4, 4, (1,), True)


def test_mamba_equal_ratios_end_trim_a_partial_prefix_hit() -> None:
    local, remote = apply_prefix_caching([R(20, 24), [9]], [R(0, 8), [7]], 4, 4, (1,), True)
    assert local == [R(20, 24), [9]] and remote == [R(4, 8), [7]]
    local, remote = apply_prefix_caching([[], [9]], [R(0, 8), [7]], 4, 4, (1,), True)
    assert remote == [[], [7]]  # the empty-group guard holds here too


def test_mamba_max_padding_assertion() -> None:
    with pytest.raises(InvalidRequest, match=r"Group 0: \|4 - 10\| >= max_padding 6"):
        apply_prefix_caching([R(0, 4)], [R(0, 10)], 6, 4, (), True)


def test_front_trim_with_a_prefix_hit_is_the_corruption_vllm_refuses() -> None:
    """local6_remote10 with the first local logical block cached: the front-trim pairs remote
    [0..5] with local [6..11] (the right pairing is remote [6..9] -> local [6..9]) ..."""
    local, remote = apply_prefix_caching([R(6, 12), [42]], [R(0, 10), [42]], 6, 10, (1,), True)
    assert local == [R(6, 12), [42]] and remote == [R(0, 6), [42]]
    # ... which is why the handshake refuses that combination, naming both ratios:
    with pytest.raises(RuntimeError, match="Local: 6, Remote: 10") as e:
        check_prefix_caching(6, 10, has_recurrent=True, prefix_caching=True)
    assert "physical_blocks_per_logical" in str(e.value) and "prefix caching" in str(e.value)


@pytest.mark.parametrize("local_ratio, remote_ratio, has_recurrent, prefix_caching", [
    (6, 6, True, True), (6, 10, False, True), (6, 10, True, False)])
def test_check_prefix_caching_allows_the_rest(local_ratio, remote_ratio, has_recurrent, prefix_caching) -> None:
    check_prefix_caching(local_ratio, remote_ratio, has_recurrent, prefix_caching)


def test_topology_refuses_kernel_ids_with_prefix_caching_and_different_ratios() -> None:
    spec = _hybrid(2)
    topo = TransferTopology("D", spec, EngineLayout(tp_size=1, block_size=66, kernel_block_size=1), prefix_caching=True,
                            block_ids="kernel")
    with pytest.raises(RuntimeError, match="Local: 66, Remote: 34"):
        topo.register_remote_engine("P", EngineLayout(tp_size=4, block_size=34, kernel_block_size=1))
    logical = TransferTopology("D", spec, EngineLayout(tp_size=1, block_size=66, kernel_block_size=1),
                               prefix_caching=True)  # logical ids are planned per token: accepted
    logical.register_remote_engine("P", EngineLayout(tp_size=4, block_size=34, kernel_block_size=1))


# --- §3.5 / 4.B source ranks: attention (one per distinct head) vs recurrent state (every overlap) --


def _hybrid(kv_heads: int, mamba_heads: int = 8, groups: int = 2) -> ModelSpec:
    state = (Component("conv_x", mamba_heads, 64 * 3), Component("conv_b", groups, 128 * 3),
             Component("conv_c", groups, 128 * 3), Component("ssm", mamba_heads, 64 * 128))
    rec = LayerSpec("recurrent", state=state, recurrent_type="mamba2", conv_rows=3)
    attn = LayerSpec("full", kv_heads, 128, 128)
    return ModelSpec((rec, attn, rec, rec), "bfloat16", "nemotron-like")


def _sources(spec: ModelSpec, d_tp: int, d_rank: int, p_tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    topo = TransferTopology("D", spec, EngineLayout(tp_size=d_tp), d_rank)
    topo.register_remote_engine("P", EngineLayout(tp_size=p_tp))
    return topo.attention_source_ranks("P"), topo.recurrent_source_ranks("P")


@pytest.mark.parametrize("d_tp, d_rank, p_tp, attention, recurrent", [
    (1, 0, 4, (0, 2), (0, 1, 2, 3)),   # §3.5: K=2, P TP 4 replicated: attention [0,2], state from all four
    (1, 0, 2, (0, 1), (0, 1)),         # 2p1d
    (2, 0, 4, (0,), (0, 1)),           # 4p2d
    (2, 1, 4, (2,), (2, 3)),
    (4, 0, 1, (0,), (0,)),             # 1p4d
    (4, 3, 1, (0,), (0,)),
    (4, 2, 2, (1,), (1,)),             # 2p4d: [r // 2]
    (4, 3, 2, (1,), (1,)),
])
def test_hybrid_source_ranks_k2(d_tp, d_rank, p_tp, attention, recurrent) -> None:
    assert _sources(_hybrid(2), d_tp, d_rank, p_tp) == (attention, recurrent)


def test_hybrid_source_ranks_gqa_dedup_p16_d2() -> None:
    """topology.md §3.6: P TP 16 -> D TP 2, K=8: attention one rank per distinct head, state from all 8."""
    spec = _hybrid(8, mamba_heads=16, groups=8)
    assert _sources(spec, 2, 0, 16) == ((0, 2, 4, 6), tuple(range(8)))
    assert _sources(spec, 2, 1, 16) == ((8, 10, 12, 14), tuple(range(8, 16)))


def test_topology_describe_shows_recurrent_sources() -> None:
    topo = TransferTopology("D", _hybrid(2), EngineLayout(tp_size=1))
    topo.register_remote_engine("P", EngineLayout(tp_size=4))
    assert "recurrent state from [0, 1, 2, 3]" in topo.describe()
