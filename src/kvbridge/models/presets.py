"""Geometry of well-known models (the `config.json` fields kvbridge reads), so that `plan` and
`bench` can describe real deployments without downloading anything."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"},
    "llama-3-70b": {"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "hidden_size": 8192, "torch_dtype": "bfloat16"},
    "mistral-7b": {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096,
                   "torch_dtype": "bfloat16"},
    "qwen3-8b": {"model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096, "torch_dtype": "bfloat16"},
    "gemma-2-9b": {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584, "sliding_window": 4096,
                   "torch_dtype": "bfloat16"},
    "gpt-oss-20b": {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 12, "torch_dtype": "bfloat16"},
    "deepseek-v3": {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
                    "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 128, "v_head_dim": 128, "hidden_size": 7168, "torch_dtype": "bfloat16"},
    "qwen3-next-80b": {"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16,
                       "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048, "linear_num_key_heads": 16,
                       "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                       "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "torch_dtype": "bfloat16"},
    "bamba-9b": {"model_type": "bamba", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "hidden_size": 4096, "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64,
                 "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "torch_dtype": "bfloat16"},
}
