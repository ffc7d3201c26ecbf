"""Layers that hold attention K/V and recurrent state together (issue 11): transformers'
`LinearAttentionAnd{Full,SlidingWindow}AttentionLayer` (Zamba2's shared-attention layers, every
Falcon-H1 layer). The spec describes each as two logical layers, the attention part then the
recurrent part, as vLLM registers them (an attention and a Mamba cache per decoder layer); the
transformers bridge maps both back to the one cache layer by its class. Zamba's multi-head Mamba1
mixer (no B/C groups) is sharded by head, and so is Kimi delta attention. A layer with a sparse-attention
indexer (DeepSeek-V3.2) is likewise its attention, then its indexer keys as an "mla" layer (one
replicated row per token, vLLM's `DeepseekV32IndexerCache`)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Zamba2Config

from kvbridge import ConfigError
from kvbridge.core.layout import EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.hf_cache import layer_map

ZAMBA2 = {  # Zamba2-style: Mamba2 layers with a shared-attention ("hybrid") layer every few
    "model_type": "zamba2", "num_hidden_layers": 4, "hidden_size": 96, "num_attention_heads": 12,
    "num_key_value_heads": 6, "attention_head_dim": 16, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_ngroups": 6, "n_mamba_heads": 12, "mamba_headdim": 16, "hybrid_layer_ids": [2],
    "layers_block_type": ["mamba", "mamba", "hybrid", "mamba"], "torch_dtype": "float32",
}
FALCON_H1 = {
    "model_type": "falcon_h1", "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 12,
    "num_key_value_heads": 6, "head_dim": 8, "mamba_n_heads": 12, "mamba_d_head": 16, "mamba_d_ssm": 192,
    "mamba_n_groups": 6, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "torch_dtype": "float32",
}
ZAMBA = {"model_type": "zamba", "num_hidden_layers": 2, "hidden_size": 96, "n_mamba_heads": 12, "mamba_expand": 2,
         "mamba_d_state": 8, "mamba_d_conv": 4, "layers_block_type": ["mamba", "hybrid"], "num_attention_heads": 12,
         "num_key_value_heads": 6, "attention_head_dim": 16, "torch_dtype": "float32"}


def test_zamba2_hybrid_layer_is_attention_then_state():
    spec = spec_from_hf_config(ZAMBA2, view="transformers")
    assert [x.kind for x in spec.layers] == ["recurrent", "recurrent", "full", "recurrent", "recurrent"]
    attn = spec.layers[2]
    assert (attn.num_kv_heads, attn.key_dim, attn.value_dim) == (6, 16, 16)  # attention_head_dim, not hidden/heads
    assert spec.layers[3] == spec.layers[0]  # the recurrent part: the same Mamba2 state as the Mamba layers


def test_falcon_h1_every_layer_is_two():
    spec = spec_from_hf_config(FALCON_H1)
    assert [x.kind for x in spec.layers] == ["full", "recurrent", "full", "recurrent"]
    names = [(c.name, c.heads) for c in spec.layers[1].state]
    assert names == [("conv_x", 12), ("conv_b", 6), ("conv_c", 6), ("ssm", 12)]


def test_zamba_multi_head_mamba1_shards_by_head():
    spec = spec_from_hf_config(ZAMBA, view="transformers")
    rec = spec.layers[0]
    assert rec.recurrent_type == "mamba1_heads" and [(c.name, c.heads, c.dim) for c in rec.state] == [
        ("conv_x", 12, 16 * 4), ("ssm", 12, 16 * 8)]
    assert [x.kind for x in spec.layers] == ["recurrent", "full", "recurrent"]
    EngineLayout(tp_size=3, block_size=4, num_blocks=2).check_model(spec)  # 12 heads, 6 KV heads: TP 3 splits both
    with pytest.raises(Exception, match="units"):
        EngineLayout(tp_size=5, block_size=4, num_blocks=2).check_model(spec)


def test_layer_map_counts_a_hybrid_cache_layer_twice_and_checks_the_order():
    spec = spec_from_hf_config(ZAMBA2, view="transformers")
    config = Zamba2Config(**{k: v for k, v in ZAMBA2.items() if k not in ("model_type", "torch_dtype")})
    cache = DynamicCache(config=config)
    assert layer_map(cache, spec) == (0, 1, 2, 2, 3)
    swapped = spec.layers[:2] + (spec.layers[3], spec.layers[2]) + spec.layers[4:]
    with pytest.raises(ConfigError, match="attention part, then its recurrent part"):
        layer_map(cache, type(spec)(swapped, spec.dtype))
    with pytest.raises(ConfigError, match="count\\s+twice"):
        layer_map(cache, type(spec)(spec.layers[:4], spec.dtype))


def test_kimi_linear_kda_state_is_sharded_by_head():
    spec = spec_from_hf_config({"model_type": "kimi_linear", "num_hidden_layers": 2, "hidden_size": 96,
                                "layer_types": ["linear_attention", "full_attention"], "linear_num_heads": 6,
                                "linear_head_dim": 8, "linear_conv_kernel_dim": 4, "num_attention_heads": 12,
                                "kv_lora_rank": 32, "qk_rope_head_dim": 8, "num_experts": 4,
                                "num_experts_per_token": 2}, view="transformers")
    rec = spec.layers[0]
    assert rec.recurrent_type == "kda" and [(c.name, c.heads, c.dim) for c in rec.state] == [
        ("conv_q", 6, 32), ("conv_k", 6, 32), ("conv_v", 6, 32), ("recurrent", 6, 64)]
    assert spec.layers[1].kind == "mla"
    EngineLayout(tp_size=3, block_size=4, num_blocks=2).check_model(spec)
    with pytest.raises(Exception, match="units"):
        EngineLayout(tp_size=4, block_size=4, num_blocks=2).check_model(spec)


def test_deepseek_v32_indexer_is_a_replicated_layer_after_its_attention():
    from kvbridge.proofs.cache_compare import cache_differences
    from kvbridge.proofs.model_sweep import tiny_config

    config = tiny_config("deepseek_v32")
    spec = spec_from_hf_config(config.to_dict(), view="transformers", warn=False)
    assert spec.num_layers == 2 * config.num_hidden_layers
    main, indexer = spec.layers[0], spec.layers[1]
    assert (main.kind, main.key_dim, main.value_dim) == ("mla", config.kv_lora_rank, config.qk_rope_head_dim)
    assert (indexer.kind, indexer.num_kv_heads, indexer.key_dim, indexer.value_dim) == ("mla", 1, config.index_head_dim, 0)
    engine = spec_from_hf_config(config.to_dict(), warn=False)
    assert engine.layers[1] == indexer  # the indexer row is the same in both views
    cache = DynamicCache(config=config)
    assert layer_map(cache, spec) == tuple(i // 2 for i in range(spec.num_layers))
    a, b = DynamicCache(config=config), DynamicCache(config=config)
    for c in (a, b):
        for li in range(len(c.layers)):
            c.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 2), li)
            c.layers[li].update_indexer(torch.zeros(1, 3, config.index_head_dim))
    assert cache_differences(a, b) == []
    b.layers[1].indexer_keys[0, 2, 0] = 1.0
    assert cache_differences(a, b) == [f"layer 1 indexer_keys: 1 of {3 * config.index_head_dim} elements differ"]


def test_hy_v4_shared_indexer_layers_keep_no_indexer_keys():
    """HY-V4's "shared" layers reuse an earlier layer's top-k selection: transformers builds them no
    indexer, so they never write indexer keys and are their attention layer alone."""
    from kvbridge.models.modules import module_indexer_dims
    from kvbridge.proofs.model_sweep import tiny_config

    config = tiny_config("hy_v4")
    assert config.indexer_types == ["full", "full", "shared", "shared"]
    assert module_indexer_dims(config, tuple(config.layer_types)) == {0: config.index_head_dim,
                                                                      1: config.index_head_dim, 2: 0, 3: 0}
    spec = spec_from_hf_config(config.to_dict(), view="transformers", warn=False)
    indexer = ("mla", config.index_head_dim, 0)
    attention = ("mla", config.kv_lora_rank, config.qk_rope_head_dim)
    assert [(x.kind, x.key_dim, x.value_dim) for x in spec.layers] == [attention, indexer, attention, indexer,
                                                                      attention, attention]
    assert layer_map(DynamicCache(config=config), spec) == (0, 0, 1, 1, 2, 3)
    with pytest.raises(ConfigError, match="engine view"):  # the latent row is not taken for an indexer
        layer_map(DynamicCache(config=config), spec_from_hf_config(config.to_dict(), warn=False))


def test_shared_layer_holding_indexer_keys_is_refused_on_export():
    from kvbridge.proofs.hf_cache import _check_no_indexer
    from kvbridge.proofs.model_sweep import tiny_config

    config = tiny_config("hy_v4")
    spec = spec_from_hf_config(config.to_dict(), view="transformers", warn=False)
    cache = DynamicCache(config=config)
    hf = layer_map(cache, spec)
    _check_no_indexer(cache, hf, 4)  # layer 2 (spec layer 4): no indexer keys, none expected
    cache.layers[2].update_indexer(torch.zeros(1, 3, config.index_head_dim))
    with pytest.raises(ConfigError, match="no indexer layer after it"):
        _check_no_indexer(cache, hf, 4)


def test_qwen4_exp_indexer_width_is_the_one_its_module_builds():
    """Qwen4-Exp names the indexer's key width `indexer_head_dim` (no `index_head_dim`); the width is
    read from the indexer module transformers builds (its causal-LM class names no decoder layer,
    its text model does)."""
    from kvbridge.models.modules import _decoder_layer_class, module_indexer_dims
    from kvbridge.proofs.model_sweep import tiny_config

    config = tiny_config("qwen4_exp_text")
    assert not hasattr(config, "index_head_dim") and config.indexer_head_dim == 16
    assert _decoder_layer_class(config).__name__ == "Qwen4ExpTextDecoderLayer"
    assert module_indexer_dims(config, tuple(config.layer_types)) == {3: 16}
    spec = spec_from_hf_config(config.to_dict(), view="transformers", warn=False)
    assert [x.kind for x in spec.layers] == ["recurrent"] * 3 + ["full", "mla"]
    assert (spec.layers[4].num_kv_heads, spec.layers[4].key_dim, spec.layers[4].value_dim) == (1, 16, 0)
    assert layer_map(DynamicCache(config=config), spec) == (0, 1, 2, 3, 3)


def test_indexer_position_history_is_rebuilt_from_the_text_positions():
    """Qwen4-Exp keeps its M-RoPE positions beside the first layer's indexer keys; the decode side
    derives them from the prompt (0..N-1 on every row for text), and the proof compares them."""
    from kvbridge.proofs.cache_compare import cache_differences, restore_position_history
    from kvbridge.proofs.model_sweep import tiny_config

    config = tiny_config("qwen4_exp_text")
    reference, imported = DynamicCache(config=config), DynamicCache(config=config)
    reference.layers[3].indexer_position_ids = torch.arange(5).expand(3, 1, -1)
    assert cache_differences(reference, imported) == ["layer 3 indexer_position_ids: present != missing"]
    restore_position_history(imported, reference, 5)
    assert torch.equal(imported.layers[3].indexer_position_ids, reference.layers[3].indexer_position_ids)
    assert cache_differences(reference, imported) == []
    reference.layers[3].indexer_position_ids = torch.tensor([[[0, 1, 1, 1, 2]]] * 3)  # an image's positions
    with pytest.raises(ConfigError, match="not the text positions"):
        restore_position_history(DynamicCache(config=config), reference, 5)


def test_zaya_cca_state_is_its_conv_q_k_and_the_delayed_value():
    """ZAYA's convolutional attention: conv `[Q | K]` by head, `(t0 - 1) + (t1 - 1)` columns in both
    views (transformers keeps exactly what a step needs), and the last token's delayed value
    projection, half a value head per KV head."""
    from kvbridge.proofs.hf_states import hf_state_shapes
    from kvbridge.proofs.model_sweep import tiny_config

    config = tiny_config("zaya")
    config.cca_time0, config.cca_time1 = 3, 2
    specs = [spec_from_hf_config(config.to_dict(), view=v, warn=False) for v in ("engine", "transformers")]
    assert specs[0] == specs[1]
    spec = specs[1]
    assert [x.kind for x in spec.layers] == ["full", "recurrent"] * config.num_hidden_layers
    rec = spec.layers[1]
    assert rec.recurrent_type == "cca" and rec.conv_rows == 3
    assert [(c.name, c.heads, c.dim) for c in rec.state] == [("conv_q", 12, 8 * 3), ("conv_k", 6, 8 * 3),
                                                             ("v_delayed", 6, 4)]
    assert hf_state_shapes(rec) == (((1, (12 + 6) * 8, 3),), (1, 6 * 4))
    EngineLayout(tp_size=6, block_size=4, num_blocks=2).check_model(spec)


INKLING = {"model_type": "inkling_text", "num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 12,
           "num_key_value_heads": 3, "head_dim": 16, "swa_num_attention_heads": 12, "swa_num_key_value_heads": 6,
           "swa_head_dim": 8, "layer_types": ["hybrid_sliding", "hybrid"], "sliding_window_size": 8,
           "conv_kernel_size": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}


def test_inkling_convolves_each_layers_own_k_and_v_and_its_residual_stream():
    """Inkling keeps four conv states in each attention cache layer: its K and V convs, sized like
    that layer's K/V (sliding and full layers differ) and sharded by KV head, then two convs over
    the residual stream that every TP rank holds whole; all float32, as the model runs them."""
    spec = spec_from_hf_config(INKLING, view="transformers")
    assert [x.kind for x in spec.layers] == ["sliding", "recurrent", "full", "recurrent"]
    for attn, rec in (spec.layers[0:2], spec.layers[2:4]):
        assert rec.recurrent_type == "kv_conv" and rec.conv_rows == 4 and rec.conv_states == (1, 1, 1, 1)
        assert [(c.name, c.heads, c.dim, c.dtype) for c in rec.state] == [
            ("conv_k", attn.num_kv_heads, attn.key_dim * 4, "float32"),
            ("conv_v", attn.num_kv_heads, attn.value_dim * 4, "float32"),
            ("conv_h2", 1, 96 * 4, "float32"), ("conv_h3", 1, 96 * 4, "float32")]
    assert (spec.layers[0].num_kv_heads, spec.layers[2].num_kv_heads) == (6, 3)
    assert spec_from_hf_config(INKLING).layers[1].conv_rows == 3  # the engine view: kernel - 1
    EngineLayout(tp_size=3, block_size=4, num_blocks=2).check_model(spec)


def test_several_conv_states_map_to_components_and_back():
    """Each conv state of a layer is its own tensor; components come out and go back bit for bit,
    and a layer keeping another number of states than the spec is refused."""
    from transformers import AutoConfig

    from kvbridge.proofs.hf_states import hf_state_shapes, hf_state_tensors, state_components

    spec = spec_from_hf_config(INKLING, view="transformers")
    config = AutoConfig.for_model(**{k: v for k, v in INKLING.items() if k != "torch_dtype"})
    cache = DynamicCache(config=config)
    layer = cache.layers[0]
    assert layer.number_of_states == 4
    shapes, rec_shape = hf_state_shapes(spec.layers[1])
    assert shapes == ((1, 6 * 8, 4), (1, 6 * 8, 4), (1, 96, 4), (1, 96, 4)) and rec_shape is None
    torch.manual_seed(0)
    held = [torch.randn(shape) for shape in shapes]
    for si, t in enumerate(held):
        cache.update_conv_state(t, 0, state_idx=si)
    comps = state_components(layer, spec, 1)
    assert [tuple(c.shape) for c in comps] == [(6, 32), (6, 32), (1, 384), (1, 384)]
    assert torch.equal(comps[0][1], held[0][0, 8:16].reshape(-1))  # KV head 1: its channels' 4 values each
    convs, rec = hf_state_tensors(spec.layers[1], comps)
    assert rec is None and all(torch.equal(a, b) for a, b in zip(convs, held))
    one = spec_from_hf_config(FALCON_H1, view="transformers", dtype="float32")
    with pytest.raises(ConfigError, match="keeps 4 conv/recurrent states"):
        state_components(layer, type(one)((one.layers[1],), "float32"), 0)


def test_conv_states_must_cover_the_conv_components():
    from kvbridge.core.spec import Component, LayerSpec

    state = (Component("conv_k", 2, 8), Component("conv_v", 2, 8))
    assert LayerSpec("recurrent", state=state, conv_rows=4, conv_states=(1, 1)).conv_states == (1, 1)
    with pytest.raises(ConfigError, match="do not cover"):
        LayerSpec("recurrent", state=state, conv_rows=4, conv_states=(1,))


def test_vllm_row_order_goes_round_within_each_conv_state():
    """vLLM's conv layout ("SD": row r of every channel, then row r + 1) is per state tensor: with
    several conv states the rows of one never interleave with another's."""
    from kvbridge.integrations.vllm.layout import vllm_conv_rows

    spec = spec_from_hf_config(INKLING)  # engine view: 3 rows
    rec = vllm_conv_rows(spec).layers[1]
    names = [c.name for c in rec.state]
    assert names == [f"{n}@{r}" for n in ("conv_k", "conv_v", "conv_h2", "conv_h3") for r in range(3)]
    assert rec.conv_states == (3, 3, 3, 3)
