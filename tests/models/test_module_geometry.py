"""Where the modeling code, not the config, sizes a layer's K/V, kvbridge takes what transformers
builds (one decoder layer per layer type on the meta device)."""

from __future__ import annotations

from kvbridge.models import spec_from_hf_config
from kvbridge.models.modules import module_kv_geometry


def test_mimo_v2_sliding_layers_have_twice_the_kv_heads():
    cfg = {"model_type": "mimo_v2_flash", "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 2,
           "head_dim": 24, "v_head_dim": 16, "hidden_size": 64, "sliding_window": 9,
           "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}
    spec = spec_from_hf_config(cfg, warn=False)
    assert [(x.kind, x.num_kv_heads, x.key_dim, x.value_dim) for x in spec.layers] == [
        ("full", 2, 24, 16), ("sliding", 4, 24, 16), ("sliding", 4, 24, 16)]


def test_module_geometry_agrees_with_the_config_for_plain_attention():
    from transformers import LlamaConfig
    text = LlamaConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    assert module_kv_geometry(text, ("full_attention", "full_attention")) == {0: (2, 16, 16), 1: (2, 16, 16)}


def test_fused_qkv_modules_are_read_too():
    """GPT-2's fused c_attn (a Conv1D of 3 x n_embd) holds one KV head per query head."""
    from transformers import GPT2Config
    assert module_kv_geometry(GPT2Config(n_layer=1, n_head=4, n_embd=64), ("full_attention",)) == {0: (4, 16, 16)}
    assert spec_from_hf_config({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64}).layers[0].num_kv_heads == 4


def test_sizes_kept_per_layer_kind_shrink_with_the_tiny_config():
    """Inkling keeps its sliding layers' heads under swa_*; the sweep's tiny config left them at
    their defaults (16 KV heads against 12 tiny query heads: 'more KV heads than query heads')."""
    from kvbridge.proofs.model_sweep import tiny_config

    config = tiny_config("inkling_text")
    assert (config.swa_num_attention_heads, config.swa_num_key_value_heads, config.swa_head_dim) == (
        config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert tiny_config("zamba").attention_head_dim == 16  # no head_dim beside it: not a per-kind copy, derived
    # the sliding layers' K/V and the short convolutions over them take those tiny sizes too
    spec = spec_from_hf_config(config.to_dict(), view="transformers", warn=False)
    sliding = [layer for layer in spec.layers if layer.kind == "sliding"]
    assert sliding and all(layer.num_kv_heads == config.swa_num_key_value_heads for layer in sliding)
    assert any(layer.recurrent_type == "kv_conv" for layer in spec.layers)
