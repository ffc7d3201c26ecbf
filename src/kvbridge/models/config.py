"""Model geometry from a Hugging Face `config.json`: the one place kvbridge reads configs.

The core (`kvbridge.core.spec`) describes geometry; this module derives it from a config, filling
missing fields from transformers' own config classes, so the core never imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from kvbridge.core.spec import LayerSpec, ModelSpec, normalize_dtype
from kvbridge.errors import ConfigError


def spec_from_hf_config(config: dict[str, Any] | str | Path, *, dtype: str | None = None,
                        mla_view: Literal["latent", "heads"] = "latent",
                        view: Literal["engine", "transformers"] = "engine",
                        state_dtype: str | None = None) -> ModelSpec:
    """Geometry from a Hugging Face `config.json` (dict, file or model directory).

    `view="engine"` describes the cache as serving engines (vLLM) hold it: MLA as one latent
    row (kv_lora_rank + rope dims), conv states with `kernel - 1` columns. `view="transformers"`
    as `transformers` >= 5 holds it: MLA as two replicated single-head tensors (the normalized
    latent and the rotated rope part), conv states with `kernel` columns.
    `mla_view="heads"` alone selects the transformers view of MLA. `state_dtype` is the SSM /
    recurrent state dtype when it differs from the KV dtype (vLLM's mamba_ssm_cache_dtype).
    """
    if view == "transformers":
        mla_view = "heads"
    cfg = _load_config(config)
    try:
        return _from_config(cfg, dtype, mla_view, view, state_dtype)
    except ConfigError as missing:
        filled = _with_transformers_defaults(cfg)  # hub configs often omit fields left at defaults
        if filled is None or filled == cfg:
            raise
        try:
            return _from_config(filled, dtype, mla_view, view, state_dtype)
        except ConfigError:
            raise missing from None

def _from_config(cfg: dict[str, Any], dtype: str | None, mla_view: str, view: str,
                 state_dtype: str | None) -> ModelSpec:
    arch = str(cfg.get("model_type", "")).lower()
    if "text_config" in cfg and ("num_hidden_layers" not in cfg or arch not in _ATTENTION_ARCHS | _MLA_ARCHS | _HYBRID_ARCHS):
        cfg = {**cfg["text_config"], "torch_dtype": cfg.get("torch_dtype", cfg.get("dtype"))}
        arch = str(cfg.get("model_type", "")).lower()
    name = cfg.get("_name_or_path") or arch or "model"
    dtype = normalize_dtype(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    num_layers = _field(cfg, "num_hidden_layers", arch)
    if arch in _MLA_ARCHS:
        if mla_view == "latent":
            latent = _field(cfg, "kv_lora_rank", arch) + _field(cfg, "qk_rope_head_dim", arch)
            return ModelSpec(tuple(LayerSpec("mla", 1, latent) for _ in range(num_layers)), dtype, str(name))
        lora, rope = _field(cfg, "kv_lora_rank", arch), _field(cfg, "qk_rope_head_dim", arch)
        return ModelSpec(tuple(LayerSpec("mla", 1, lora, rope) for _ in range(num_layers)), dtype, str(name))
    if arch in _HYBRID_ARCHS:
        from kvbridge.models.recurrent import hybrid_layers
        conv_rows_extra = 0 if view == "transformers" else -1
        return ModelSpec(hybrid_layers(cfg, arch, num_layers, conv_rows_extra, state_dtype), dtype, str(name))
    if arch not in _ATTENTION_ARCHS:
        known = ", ".join(sorted(_ATTENTION_ARCHS | _MLA_ARCHS | _HYBRID_ARCHS))
        raise ConfigError(f"unsupported architecture {arch or '(no model_type)'!r}; kvbridge knows: {known}")
    q_heads = _field(cfg, "num_attention_heads", arch)
    kv_heads = int(cfg.get("num_key_value_heads") or q_heads)
    head_dim = int(cfg.get("head_dim") or _field(cfg, "hidden_size", arch) // q_heads)
    layer_types = _layer_types(cfg, arch, num_layers)
    window = cfg.get("sliding_window")
    layers = []
    for i, lt in enumerate(layer_types):
        if lt == "full_attention":
            layers.append(LayerSpec("full", kv_heads, head_dim, head_dim))
        elif lt == "sliding_attention":
            if not window:
                raise ConfigError(f"layer {i} is sliding_attention but config has no sliding_window")
            layers.append(LayerSpec("sliding", kv_heads, head_dim, head_dim, int(window)))
        else:
            raise ConfigError(f"layer {i} has type {lt!r}, which kvbridge does not move yet")
    return ModelSpec(tuple(layers), dtype, str(name))


_ATTENTION_ARCHS = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text",
                    "gpt_oss", "phi3", "granite", "olmo2", "smollm3"}
_MLA_ARCHS = {"deepseek_v2", "deepseek_v3", "kimi_k2"}
_HYBRID_ARCHS = {"bamba", "granitemoehybrid", "qwen3_next", "lfm2"}


def _with_transformers_defaults(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """`cfg` (and its `text_config`) completed with the architecture's transformers defaults."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None

    arch = cfg.get("model_type")
    if arch not in CONFIG_MAPPING:
        return None
    try:  # the config class fills defaults and derives fields (layer_types ...) as transformers would
        out = CONFIG_MAPPING[arch](**{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
    except Exception:  # noqa: BLE001 - a config transformers itself rejects: keep the original error
        return None
    return {**out, "model_type": arch}


def _load_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _field(cfg: dict[str, Any], key: str, arch: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise ConfigError(f"config of {arch or 'model'!r} lacks {key!r}")
    return int(value)


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    """Per-layer attention type, following each architecture's transformers convention."""
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
        if len(types) != num_layers:
            raise ConfigError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
        return types
    window = cfg.get("sliding_window")
    if arch == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if arch in ("gemma3", "gemma3_text"):
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if arch in ("qwen2", "qwen3"):
        if window and cfg.get("use_sliding_window"):
            first = int(cfg.get("max_window_layers", num_layers))
            return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return ["full_attention"] * num_layers
    if window and cfg.get("use_sliding_window", True):
        return ["sliding_attention"] * num_layers
    return ["full_attention"] * num_layers
