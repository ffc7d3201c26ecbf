"""A vLLM engine's KV identity (`core.kv_identity`): what its K and V mean, from its configs.

What goes in, and why each: the weights (`weights`: a digest of the model directory's weight
files, or the hub id and revision where vLLM serves one not on disk, and the load format:
vLLM's `dummy` weights are not the files'); how they are applied (`model_class_overrides`,
`quantization` and its config); the dtypes K and V are computed and kept in (`dtype`, the KV
cache dtype, its skipped layers and whether scales are computed, the Mamba state dtypes);
`disable_sliding_window` (vLLM then attends fully where the config slides); and every value of
the model's text config *after* vLLM applied `--hf-overrides` (`config.*`: RoPE parameters,
windows, attention scaling and softcaps, norms, partial rotary, ...), less the few that name
things rather than compute them (`IGNORED_CONFIG`). A value kvbridge does not know is kept:
an unknown field can only make two instances refuse each other, never share wrongly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbridge.core.kv_identity import KVIdentity

if TYPE_CHECKING:
    from vllm.config import VllmConfig

IGNORED_CONFIG = frozenset({
    "_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "tokenizer_class", "id2label", "label2id",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "task_specific_params", "problem_type",
    "finetuning_task", "prefix", "_attn_implementation", "_attn_implementation_autoset", "_experts_implementation",
    "architectures", "auto_map", "model_type_path", "chunk_size_feed_forward", "tie_word_embeddings",
    "max_position_embeddings_original_unused",
})
"""Config keys that name or route things, never change a K or V value (the architecture is
in the layer classes and the weights; token ids and output switches act after the cache)."""


def _weights(model: str, revision: str | None) -> str:
    path = Path(model)
    if path.is_dir():
        from kvbridge.models.weights_digest import weights_digest

        return weights_digest(path)
    return f"{model}@{revision or 'default'}"  # a hub id: its revision names the weights


def vllm_kv_identity(vllm_config: VllmConfig) -> KVIdentity:
    """The identity every instance sharing KV with this one must state too (see the module)."""
    mc, cc, lc = vllm_config.model_config, vllm_config.cache_config, vllm_config.load_config
    values: dict[str, Any] = {
        "weights": _weights(str(mc.model), mc.revision),
        "load_format": str(lc.load_format),
        "model_class_overrides": dict(getattr(mc, "model_class_overrides", {}) or {}),
        "quantization": str(mc.quantization),
        "quantization_config": _plain(getattr(mc, "quantization_config", None)),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "kv_cache_dtype_skip_layers": list(getattr(cc, "kv_cache_dtype_skip_layers", []) or []),
        "calculate_kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
        "mamba_cache_dtype": str(getattr(cc, "mamba_cache_dtype", "auto")),
        "mamba_ssm_cache_dtype": str(getattr(cc, "mamba_ssm_cache_dtype", "auto")),
        "disable_sliding_window": bool(mc.disable_sliding_window),
    }
    for key, value in mc.hf_text_config.to_dict().items():
        if key not in IGNORED_CONFIG:
            values[f"config.{key}"] = value
    return KVIdentity.of(values)


def _plain(value: Any) -> Any:
    """A config object as plain data (its dict, else its repr) for the identity's JSON."""
    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return value
    to_dict = getattr(value, "to_dict", None) or getattr(value, "model_dump", None)
    return to_dict() if callable(to_dict) else repr(value)


__all__ = ["IGNORED_CONFIG", "vllm_kv_identity"]
