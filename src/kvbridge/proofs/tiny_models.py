"""Tiny random-weight transformers models, one per cache geometry, and the spec transformers caches them with.

Every proof needs a real model that runs offline in a second on a CPU. Each built-in config
covers one geometry a plan must handle (GQA, MQA, KV heads that TP 2 and 3 both shard, sliding
window, alternating sliding/full, QK-norm, MLA, MoE, attention sinks, and the hybrids: Mamba2
with sharded and replicated groups, gated delta net, short conv). Weights are drawn from a seed,
so two processes that load the same name and seed hold bit-identical models.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch
from transformers import (AutoModelForCausalLM, BambaConfig, DeepseekV3Config, Gemma2Config, GptOssConfig,
                          GraniteMoeHybridConfig, Lfm2Config, LlamaConfig, MistralConfig, PretrainedConfig,
                          PreTrainedModel, Qwen2Config, Qwen3Config, Qwen3NextConfig)

from kvbridge.core.spec import ModelSpec, normalize_dtype
from kvbridge.errors import ConfigError
from kvbridge.models import spec_from_hf_config

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, vocab_size=256, max_position_embeddings=512, head_dim=16,
    # Larger than the usual 0.02 so that random models' greedy tokens depend on the whole context
    # (with tiny weights they repeat one token, and a broken cache could go unnoticed).
    initializer_range=0.2,
    # No EOS/BOS/PAD: every oracle run decodes exactly the requested number of tokens.
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
    tie_word_embeddings=False, dtype="float32",
)
_NO_SIZES = {k: v for k, v in _COMMON.items() if k not in ("hidden_size", "intermediate_size", "head_dim")}


def _tiny(config_class: type[PretrainedConfig], base: dict[str, Any] = _COMMON,
          **kwargs: Any) -> Callable[[], PretrainedConfig]:
    """A fresh config of `config_class` per call: the common tiny settings, overridden by `kwargs`
    (copied per call, so no two configs share a list)."""
    settings = {**base, **kwargs}
    return lambda: config_class(**copy.deepcopy(settings))


BUILTIN_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    # GQA: 8 query heads, 4 KV heads (TP 1, 2, 4 shard; 8 replicates).
    "tiny-llama": _tiny(LlamaConfig, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4),
    # 6 KV heads: TP 2 and 3 both shard it, so 3 -> 2 and 2 -> 3 are legal non-divisible pairs
    # (hidden 96: transformers wants hidden_size divisible by the query heads).
    "tiny-llama-6kv": _tiny(LlamaConfig, hidden_size=96, num_hidden_layers=2, num_attention_heads=12,
                            num_key_value_heads=6),
    # MQA: one KV head, replicated on every rank of any TP > 1.
    "tiny-llama-mqa": _tiny(LlamaConfig, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1),
    # Every layer slides over 8 tokens: the cache keeps only the last 7.
    "tiny-mistral": _tiny(MistralConfig, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                          sliding_window=8),
    # Qwen2 (QKV bias) with its own hybrid rule: layers >= max_window_layers slide (full, sliding, sliding).
    "tiny-qwen2": _tiny(Qwen2Config, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                        use_sliding_window=True, sliding_window=12, max_window_layers=1),
    # Qwen3: QK-norm, full attention.
    "tiny-qwen3": _tiny(Qwen3Config, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4),
    # Gemma2: alternating sliding (window 8) / full layers, logit soft-capping.
    "tiny-gemma2": _tiny(Gemma2Config, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         sliding_window=8, query_pre_attn_scalar=16),
    # gpt-oss: alternating sliding (window 8) / full layers, attention sinks, a 4-expert MoE. YaRN scales
    # 32x from 4096 original positions: max_position_embeddings must agree or transformers warns.
    "tiny-gpt-oss": _tiny(GptOssConfig, max_position_embeddings=4096 * 32, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=4, sliding_window=8, num_local_experts=4,
                          num_experts_per_tok=2),
    # DeepSeek-V3: MLA (transformers caches the normalized latent and the rotated rope part, one head each,
    # replicated on every TP rank) and a small routed MoE.
    "tiny-deepseek-v3": _tiny(DeepseekV3Config, {k: v for k, v in _COMMON.items() if k != "head_dim"},
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                              first_k_dense_replace=1, n_group=1, topk_group=1),
    # Bamba (Mamba2): 8 heads of 16, 2 groups of d_state 8, conv 4; layer 1 attends with 8 query / 4 KV
    # heads. TP 1, 2, 4 (and 8) shard it; TP 4 and 8 replicate the B/C groups.
    "tiny-bamba": _tiny(BambaConfig, _NO_SIZES, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        attn_layer_indices=[1], num_attention_heads=8, num_key_value_heads=4, mamba_n_heads=8,
                        mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                        mamba_chunk_size=16),
    # GraniteMoeHybrid (Mamba2 + MoE): 12 heads, one group, 12 KV heads: TP 1, 2, 3, 4 (so 3 <-> 2) all shard.
    "tiny-granite-hybrid": _tiny(GraniteMoeHybridConfig, _NO_SIZES, hidden_size=48, intermediate_size=32,
                                 shared_intermediate_size=32, num_hidden_layers=3,
                                 layer_types=["linear_attention", "full_attention", "linear_attention"],
                                 num_attention_heads=12, num_key_value_heads=12, num_local_experts=4,
                                 num_experts_per_tok=2, mamba_n_heads=12, mamba_d_head=8, mamba_n_groups=1,
                                 mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16),
    # Qwen3-Next: gated delta net (2 key / 4 value heads of 8, conv 4) + gated attention (2 KV heads) + MoE.
    # TP 1, 2, 4 are legal; at TP 4 the Q/K conv segments and attention heads replicate while V shards.
    "tiny-qwen3-next": _tiny(Qwen3NextConfig, _NO_SIZES, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                             layer_types=["linear_attention", "full_attention", "linear_attention"],
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                             linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32),
    # LFM2: short conv (48 channels, L_cache 3) and attention (12 KV heads): TP 1, 2, 3, 4 all shard.
    "tiny-lfm2": _tiny(Lfm2Config, _NO_SIZES, hidden_size=48, intermediate_size=96, block_auto_adjust_ff_dim=False,
                       num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_attention_heads=12,
                       num_key_value_heads=12, conv_L_cache=3),
}
"""Random-weight configs (float32, hidden <= 96, vocab 256) by name; `tiny-llama` is the default."""

HYBRID_MODELS = ("tiny-bamba", "tiny-granite-hybrid", "tiny-qwen3-next", "tiny-lfm2")

DEFAULT_MODEL = "tiny-llama"


def load_model(name_or_dir: str, seed: int = 0) -> tuple[PreTrainedModel, PretrainedConfig]:
    """A float32 model in eval mode: a built-in config with weights drawn from `seed`, or a local
    directory (its weights, or random ones when it holds config.json alone: `model_dir`; never the
    Hub, so the proofs run offline)."""
    name = str(name_or_dir)
    if name in BUILTIN_MODELS:
        config = BUILTIN_MODELS[name]()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif Path(name).is_dir():
        from kvbridge.proofs.model_dir import load_dir_model
        model = load_dir_model(name, seed)
    else:
        raise ConfigError(f"unknown model {name!r}: not a local model directory; builtin models: "
                          f"{', '.join(BUILTIN_MODELS)}")
    model = model.float().eval()
    model.config.dtype = torch.float32
    model.config.name_or_path = name
    return model, model.config


def spec_for(config: PretrainedConfig, dtype: str | torch.dtype | None = None,
             state_dtype: str | torch.dtype | None = None) -> ModelSpec:
    """The KV geometry as transformers caches it (MLA as the replicated latent and rope part, conv states
    with `kernel` values per channel), in the model's dtype; `state_dtype` when the recurrent state differs.
    No warnings: a model directory's were written when its config.json was read (`model_dir.checked_config`)."""
    if dtype is None:
        dtype = getattr(config, "dtype", None) or "float32"
    spec = spec_from_hf_config(config.to_dict(), view="transformers", dtype=normalize_dtype(str(dtype)),
                               state_dtype=normalize_dtype(str(state_dtype)) if state_dtype else None, warn=False)
    name = Path(str(getattr(config, "name_or_path", "") or "")).name
    return msgspec.structs.replace(spec, name=name) if name else spec


__all__ = ["BUILTIN_MODELS", "DEFAULT_MODEL", "HYBRID_MODELS", "load_model", "spec_for"]
