"""Geometry of well-known models (the `config.json` fields kvbridge reads), so that `plan` and
`bench` can describe real deployments without downloading anything.

`preset_spec(name)` reads the `ModelSpec` each preset gives from `preset_specs.json` beside this
file instead of deriving it through transformers' config classes at every call: importing
transformers costs seconds, and `kvbridge plan llama-3-8b` should answer at once. The file is
written by `python -m kvbridge.models.presets` and a test re-derives every entry through
transformers and requires it equal, so it cannot drift from `spec_from_hf_config`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec

from kvbridge.core.spec import ModelSpec
from kvbridge.errors import ConfigError

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


_SPECS = Path(__file__).with_name("preset_specs.json")


def preset_spec(name: str) -> ModelSpec:
    """The `ModelSpec` of preset `name`, as `spec_from_hf_config` derives it (stored, see above)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    stored = _stored()
    if name not in stored:  # pragma: no cover - the test keeps the file complete
        from kvbridge.models.config import spec_from_hf_config
        return spec_from_hf_config({**PRESETS[name], "_name_or_path": name})
    return stored[name]


@lru_cache(maxsize=1)
def _stored() -> dict[str, ModelSpec]:
    try:
        return msgspec.json.decode(_SPECS.read_bytes(), type=dict[str, ModelSpec])
    except (OSError, msgspec.DecodeError):  # pragma: no cover - a broken install derives them instead
        return {}


def derive_all() -> dict[str, ModelSpec]:
    """Every preset's spec through transformers (what `preset_specs.json` must hold)."""
    from kvbridge.models.config import spec_from_hf_config
    return {name: spec_from_hf_config({**cfg, "_name_or_path": name}) for name, cfg in PRESETS.items()}


if __name__ == "__main__":
    specs = derive_all()  # one preset per line: diffs stay readable
    _SPECS.write_bytes(b"{\n" + b",\n".join(msgspec.json.encode(k) + b": " + msgspec.json.encode(v)
                                            for k, v in specs.items()) + b"\n}\n")
    print(f"wrote {_SPECS} ({len(PRESETS)} presets)")
