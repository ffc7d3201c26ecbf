"""`spec_from_hf_config` on config dicts modeled on real Hugging Face hub configs (only the
fields that matter for the KV cache, values as published), groups and fingerprints."""

from __future__ import annotations

import json

import pytest

from kvbridge import ConfigError, LayerSpec, ModelSpec
from kvbridge.models import spec_from_hf_config

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "_name_or_path": "meta-llama/Meta-Llama-3-8B",
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "sliding_window": 4096, "torch_dtype": "bfloat16",
}
MISTRAL_7B_V03 = {**MISTRAL_7B_V01, "sliding_window": None}
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28, "torch_dtype": "bfloat16",
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "head_dim": 128,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28, "torch_dtype": "bfloat16",
}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "head_dim": 256,
    "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
    "sliding_window": 4096, "cache_implementation": "hybrid", "torch_dtype": "float32",
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152, "head_dim": 256,
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
}
GEMMA3_27B_NESTED = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376, "num_attention_heads": 32,
        "num_hidden_layers": 62, "num_key_value_heads": 16, "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "head_dim": 64,
    "num_attention_heads": 64, "num_hidden_layers": 24, "num_key_value_heads": 8, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "torch_dtype": "bfloat16",
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 27,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "num_attention_heads": 128, "num_key_value_heads": 128, "num_hidden_layers": 61,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "first_k_dense_replace": 3, "torch_dtype": "bfloat16",
}


def kinds(spec: ModelSpec) -> list[str]:
    return [layer.kind for layer in spec.layers]


def test_llama3_8b():
    spec = spec_from_hf_config(LLAMA3_8B)
    assert spec.num_layers == 32 and spec.dtype == "bfloat16" and spec.itemsize == 2
    assert set(spec.layers) == {LayerSpec("full", 8, 128, 128)}
    assert spec.groups == (tuple(range(32)),)
    assert spec.total_kv_heads == 8 and not spec.is_mla
    assert spec.name == "meta-llama/Meta-Llama-3-8B"
    # 32 layers * (K + V) * 8 heads * 128 * 2 B = 128 KiB per token
    assert spec.bytes_per_token() == 32 * 2 * 8 * 128 * 2 == 131072


def test_mistral_7b_v01_sliding_window():
    spec = spec_from_hf_config(MISTRAL_7B_V01)
    assert set(spec.layers) == {LayerSpec("sliding", 8, 128, 128, 4096)}
    assert spec.groups == (tuple(range(32)),)
    assert spec.layers[0].tokens_kept(10000) == 10000 - 4095
    assert spec.layers[0].tokens_kept(100) == 0


def test_mistral_without_window_is_full():
    assert kinds(spec_from_hf_config(MISTRAL_7B_V03)) == ["full"] * 32


def test_qwen2_use_sliding_window_false():
    spec = spec_from_hf_config(QWEN2_7B)
    assert set(spec.layers) == {LayerSpec("full", 4, 128, 128)}  # 3584 / 28 = 128
    assert spec.groups == (tuple(range(28)),)


def test_qwen2_use_sliding_window_true_uses_max_window_layers():
    spec = spec_from_hf_config({**QWEN2_7B, "use_sliding_window": True, "sliding_window": 4096,
                                     "max_window_layers": 21})
    assert kinds(spec) == ["full"] * 21 + ["sliding"] * 7
    assert spec.groups == (tuple(range(21)), tuple(range(21, 28)))
    assert spec.layers[27].window == 4096


def test_qwen3_explicit_head_dim():
    spec = spec_from_hf_config(QWEN3_06B)
    # head_dim 128 although hidden_size / heads = 64
    assert set(spec.layers) == {LayerSpec("full", 8, 128, 128)}
    assert spec.num_layers == 28


def test_gemma2_alternating_layer0_sliding():
    spec = spec_from_hf_config(GEMMA2_9B)
    assert spec.dtype == "float32" and spec.itemsize == 4
    assert kinds(spec) == ["sliding", "full"] * 21
    assert spec.layers[0] == LayerSpec("sliding", 8, 256, 256, 4096)
    assert spec.layers[1] == LayerSpec("full", 8, 256, 256)
    assert spec.groups == (tuple(range(0, 42, 2)), tuple(range(1, 42, 2)))
    assert spec.layer_group[:4] == (0, 1, 0, 1)


def test_gemma3_pattern_6():
    spec = spec_from_hf_config(GEMMA3_1B)
    assert [i for i, k in enumerate(kinds(spec)) if k == "full"] == [5, 11, 17, 23]
    assert spec.layers[0] == LayerSpec("sliding", 1, 256, 256, 512)
    assert spec.groups[0] == tuple(i for i in range(26) if i not in (5, 11, 17, 23))
    assert spec.groups[1] == (5, 11, 17, 23)
    assert spec.describe().startswith("gemma3_text: 26 layers [22xsliding(w=512), 4xfull]")


def test_gemma3_custom_pattern():
    spec = spec_from_hf_config({**GEMMA3_1B, "sliding_window_pattern": 2, "num_hidden_layers": 4})
    assert kinds(spec) == ["sliding", "full", "sliding", "full"]


def test_gemma3_text_config_on_its_own():
    spec = spec_from_hf_config({**GEMMA3_27B_NESTED["text_config"], "torch_dtype": "bfloat16"})
    assert spec.num_layers == 62 and spec.layers[0] == LayerSpec("sliding", 16, 128, 128, 1024)
    assert [i for i, k in enumerate(kinds(spec)) if k == "full"] == list(range(5, 62, 6))


def test_gemma3_nested_text_config():
    # The multimodal hub form (gemma-3-4b/12b/27b): model_type 'gemma3' with the text fields in
    # text_config; 'gemma3' is itself a known architecture, which used to stop the unwrapping.
    spec = spec_from_hf_config(GEMMA3_27B_NESTED)
    assert spec.num_layers == 62 and spec.dtype == "bfloat16"
    assert spec.layers[0] == LayerSpec("sliding", 16, 128, 128, 1024)
    assert [i for i, k in enumerate(kinds(spec)) if k == "full"] == list(range(5, 62, 6))


def test_nested_text_config_of_unknown_wrapper_is_unwrapped():
    # A wrapper whose own model_type is unknown (e.g. a VLM) falls back to its text_config, and
    # takes the top-level dtype.
    cfg = {"model_type": "llava", "torch_dtype": "float16", "text_config": {**LLAMA3_8B, "torch_dtype": None}}
    spec = spec_from_hf_config(cfg)
    assert spec.dtype == "float16" and spec.num_layers == 32


def test_gpt_oss_layer_types():
    spec = spec_from_hf_config(GPT_OSS_20B)
    assert kinds(spec) == ["sliding", "full"] * 12
    assert spec.layers[0] == LayerSpec("sliding", 8, 64, 64, 128)
    assert spec.layers[1] == LayerSpec("full", 8, 64, 64)
    assert len(spec.groups) == 2 and spec.groups[0] == tuple(range(0, 24, 2))


def test_layer_types_length_must_match():
    with pytest.raises(ConfigError, match="layer_types has 3 entries but num_hidden_layers is 24"):
        spec_from_hf_config({**GPT_OSS_20B, "layer_types": ["full_attention"] * 3})


def test_sliding_layer_type_without_window():
    with pytest.raises(ConfigError, match="layer 0 is sliding_attention but config has no sliding_window"):
        spec_from_hf_config({**GPT_OSS_20B, "sliding_window": None})


def test_unsupported_layer_type_named():
    types = ["full_attention"] * 23 + ["linear_attention"]
    with pytest.raises(ConfigError, match="layer 23 has type 'linear_attention'"):
        spec_from_hf_config({**GPT_OSS_20B, "layer_types": types})


@pytest.mark.parametrize("cfg", [DEEPSEEK_V2_LITE, DEEPSEEK_V3])
def test_deepseek_mla_latent(cfg):
    spec = spec_from_hf_config(cfg)
    assert spec.num_layers == cfg["num_hidden_layers"]
    assert set(spec.layers) == {LayerSpec("mla", 1, 576)}  # kv_lora_rank 512 + qk_rope 64
    assert spec.is_mla and spec.total_kv_heads == 1
    layer = spec.layers[0]
    assert layer.replicated
    assert [(c.name, c.heads, c.dim) for c in layer.components] == [("latent", 1, 576)]
    assert spec.groups == (tuple(range(cfg["num_hidden_layers"])),)
    assert spec.bytes_per_token() == cfg["num_hidden_layers"] * 576 * 2


@pytest.mark.parametrize("cfg", [DEEPSEEK_V2_LITE, DEEPSEEK_V3])
def test_deepseek_transformers_view_splits_latent_and_rope(cfg):
    # transformers >= 5 caches the normalized latent and the rotated rope part as two
    # single-head tensors; both are replicated on every TP rank, like vLLM's 576-wide row.
    spec = spec_from_hf_config(cfg, view="transformers")
    assert set(spec.layers) == {LayerSpec("mla", 1, 512, 64)}
    comps = spec.layers[0].components
    assert [(c.name, c.heads, c.dim) for c in comps] == [("latent", 1, 512), ("rope", 1, 64)]
    assert spec.is_mla and spec.layers[0].replicated
    assert spec_from_hf_config(cfg, mla_view="heads") == spec
    assert spec.bytes_per_token() == spec_from_hf_config(cfg).bytes_per_token()


def test_dtype_override_and_aliases():
    assert spec_from_hf_config(LLAMA3_8B, dtype="fp8").dtype == "float8_e4m3fn"
    assert spec_from_hf_config({**LLAMA3_8B, "torch_dtype": None, "dtype": "float16"}).dtype == "float16"
    assert spec_from_hf_config({**LLAMA3_8B, "torch_dtype": "torch.bfloat16"}).dtype == "bfloat16"
    assert spec_from_hf_config({k: v for k, v in LLAMA3_8B.items() if k != "torch_dtype"}).dtype == "bfloat16"


def test_kv_heads_default_to_attention_heads():
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}
    assert spec_from_hf_config(cfg).layers[0].num_kv_heads == 32


def test_unmovable_layer_refused_by_index_and_kind_not_by_name_list():
    # issue 11: a refusal names the layer and its state kind, never the list of known model types.
    with pytest.raises(ConfigError, match="no model_type"):
        spec_from_hf_config({"num_hidden_layers": 2})
    # Zamba (refused here before its multi-head Mamba1 mixer was known): heads but no B/C groups
    zamba = spec_from_hf_config({"model_type": "zamba", "num_hidden_layers": 2, "layers_block_type": ["mamba", "mamba"]})
    assert [layer.recurrent_type for layer in zamba.layers] == ["mamba1_heads"] * 2
    with pytest.raises(ConfigError, match="no config class in the installed transformers"):
        spec_from_hf_config({**LLAMA3_8B, "model_type": "not-a-model"})


def test_compressed_cache_layers_from_this_configs_cache_layers():
    # DeepSeek-V4 (refused until rows per several tokens were planned): each compressed layer is its
    # K=V window, one layer per compressor at one row per `compress_rate` tokens, and its open window,
    # from the cache layer transformers builds (rates and window below are this config's, not the
    # class defaults).
    from kvbridge.core.layout import EngineLayout
    from kvbridge.errors import IncompatibleEngines
    cfg = {**LLAMA3_8B, "model_type": "deepseek_v4", "num_hidden_layers": 2, "sliding_window": 6,
           "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
           "compress_rates": {"compressed_sparse_attention": 3, "heavily_compressed_attention": 16}}
    spec = spec_from_hf_config(cfg, warn=False)
    assert [(x.kind, x.window, x.tokens_per_row) for x in spec.layers] == [
        ("mla", 6, 1), ("mla", None, 3), ("mla", None, 3), ("recurrent", None, 1),
        ("mla", 6, 1), ("mla", None, 16), ("recurrent", None, 1)]
    assert [c.name for c in spec.layers[6].state] == ["compressor_buffer_kv", "compressor_buffer_gate"]
    assert len(spec.layers[3].state) == 8  # buffers and overlaps of 'compressor' and 'indexer'
    with pytest.raises(IncompatibleEngines, match="not a multiple of its 3 tokens per row"):
        EngineLayout(block_size=16).addressing(spec, 0)
    EngineLayout(block_size=48).addressing(spec, 0)


MISSING = [(LLAMA3_8B, "num_hidden_layers"), (LLAMA3_8B, "num_attention_heads"), (LLAMA3_8B, "hidden_size"),
           (DEEPSEEK_V3, "kv_lora_rank"), (DEEPSEEK_V3, "qk_rope_head_dim")]


@pytest.mark.parametrize(("cfg", "field"), MISSING)
def test_missing_field_takes_transformers_default(cfg, field):
    # Hub configs omit fields left at their defaults; kvbridge must see the geometry transformers builds.
    from transformers import CONFIG_MAPPING
    broken = {k: v for k, v in cfg.items() if k != field}
    expected = CONFIG_MAPPING[cfg["model_type"]](**{k: v for k, v in broken.items() if k != "model_type"})
    assert spec_from_hf_config(broken) == spec_from_hf_config({**expected.to_dict(), **broken,
                                                                         field: getattr(expected, field)})


@pytest.mark.parametrize(("cfg", "field"), [m for m in MISSING if m[1] != "hidden_size"])  # head_dim is given
def test_missing_field_named_on_stderr(cfg, field, capsys):
    broken = {k: v for k, v in cfg.items() if k != field}
    spec_from_hf_config(broken)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and field in err and "omits" in err
    spec_from_hf_config(cfg)
    assert capsys.readouterr().err == ""


def test_sparse_gemma3_hub_config_uses_transformers_defaults():
    # gemma-3-4b's text_config omits head counts and head_dim (transformers defaults: 8, 4, 256).
    cfg = {"model_type": "gemma3", "torch_dtype": "bfloat16",
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34,
                           "sliding_window": 1024, "intermediate_size": 10240}}
    spec = spec_from_hf_config(cfg)
    assert spec.num_layers == 34 and spec.layers[5].kind == "full" and spec.layers[0].kind == "sliding"
    assert (spec.layers[0].num_kv_heads, spec.layers[0].key_dim) == (4, 256)


def test_config_from_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert spec_from_hf_config(tmp_path) == spec_from_hf_config(LLAMA3_8B)
    assert spec_from_hf_config(str(tmp_path / "config.json")) == spec_from_hf_config(LLAMA3_8B)
    with pytest.raises(ConfigError, match="no config.json"):
        spec_from_hf_config(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        spec_from_hf_config(tmp_path / "bad.json")


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------

def test_groups_in_order_of_first_appearance():
    layers = (LayerSpec("full", 2, 8, 8), LayerSpec("sliding", 2, 8, 8, 16), LayerSpec("sliding", 2, 8, 8, 32),
              LayerSpec("full", 2, 8, 8), LayerSpec("sliding", 2, 8, 8, 16))
    spec = ModelSpec(layers)
    assert spec.groups == ((0, 3), (1, 4), (2,))  # each window is its own group
    assert spec.layer_group == (0, 1, 2, 0, 1)
    assert spec.group_layer(2).window == 32


def test_uniform_alternating_kinds():
    spec = ModelSpec.uniform(5, 4, 16, kinds=("sliding", "sliding", "full"), window=8)
    assert kinds(spec) == ["sliding", "sliding", "full", "sliding", "sliding"]
    assert spec.groups == ((0, 1, 3, 4), (2,))


# --------------------------------------------------------------------------------------------
# Fingerprint
# --------------------------------------------------------------------------------------------

def test_fingerprint_stable_and_name_independent():
    a = spec_from_hf_config(LLAMA3_8B)
    b = spec_from_hf_config({**LLAMA3_8B, "_name_or_path": "someone/else"})
    assert a.name != b.name
    assert a.fingerprint() == a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16
    assert a.fingerprint() == ModelSpec.uniform(32, 8, 128).fingerprint()


@pytest.mark.parametrize("other", [
    ModelSpec.uniform(31, 8, 128), ModelSpec.uniform(32, 4, 128), ModelSpec.uniform(32, 8, 64),
    ModelSpec.uniform(32, 8, 128, "float16"), ModelSpec.uniform(32, 8, 128, kinds=("sliding", "full"), window=4096),
    ModelSpec.uniform(32, 1, 128, kinds=("mla",)),
])
def test_fingerprint_differs_with_geometry(other):
    assert ModelSpec.uniform(32, 8, 128).fingerprint() != other.fingerprint()


def test_fingerprint_differs_with_window_and_value_dim():
    a = ModelSpec.uniform(2, 8, 128, kinds=("sliding",), window=4096)
    b = ModelSpec.uniform(2, 8, 128, kinds=("sliding",), window=1024)
    assert a.fingerprint() != b.fingerprint()
    c = ModelSpec((LayerSpec("full", 8, 192, 128),))
    d = ModelSpec((LayerSpec("full", 8, 192, 192),))
    assert c.fingerprint() != d.fingerprint()


def test_a_layer_count_spelled_as_a_pattern_is_not_a_missing_field(capsys):
    """Nemotron-H's config.json spells its layers as `layers_block_type` (transformers derives
    num_hidden_layers from it): nothing was filled in, so nothing is named on stderr."""
    cfg = {"model_type": "nemotron_h", "layers_block_type": ["mamba", "attention", "mlp", "mamba"],
           "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4,
           "torch_dtype": "float32"}
    spec = spec_from_hf_config(cfg)
    assert spec.num_layers == 4 and "num_hidden_layers" not in capsys.readouterr().err
