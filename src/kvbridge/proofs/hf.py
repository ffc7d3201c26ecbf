"""The transformers bridge: an end-to-end oracle for kvbridge plans.

A plan is only right if a model that decodes from the moved cache produces exactly what it
would have produced without the move. This module runs that experiment on a real
`transformers` model: prefill on a TP=P engine layout, move the paged KV cache with the planner
and the local executor to a TP=D engine layout, rebuild a `DynamicCache` from the destination
ranks and continue greedy decoding. The tokens must equal plain `generate` and the rebuilt cache
must be bit-identical to the prefill cache.

Hybrid models (Mamba2, gated delta net, short conv) keep per-request recurrent state next to
their attention layers. transformers holds it per layer as `conv_states[0]` `[1, conv_dim, kernel]`
(channel-major: Mamba2 `[x | B | C]`, GDN `[Q | K | V]`, LFM2 `[hidden]`, `kernel` values per
channel) and `recurrent_states[0]` (Mamba2 `[1, heads, head_dim, d_state]`, GDN
`[1, v_heads, k_head_dim, v_head_dim]`; LFM2 has none). kvbridge's spec describes each conv segment
and the recurrent state as its own component of `units x dim` (`spec_from_hf_config(...,
view="transformers")`), so a segment of `units * dim / kernel` channels is exactly
`conv[channels].reshape(units, dim)`: unit u holds its channels' `kernel` values back to back, and a
recurrent state is `state.reshape(units, a * b)`. Export writes every component of every prefill
rank at the request's recurrent slot (the last block id of the recurrent group), import takes each
unit from the first decode rank that holds it and rebuilds the transformers cache as a prefill
would have left it (`has_previous_state` set).

Built-in models are tiny random-weight configs (no download): each covers one cache geometry
(GQA, MQA, sliding window, alternating sliding/full, QK-norm, MoE, and the hybrids: Mamba2 with
sharded and replicated groups, gated delta net, short conv).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from transformers import (AutoModelForCausalLM, BambaConfig, DeepseekV3Config, DynamicCache, Gemma2Config,
                          GenerationConfig,
                          GptOssConfig, GraniteMoeHybridConfig, Lfm2Config, LlamaConfig, MistralConfig,
                          PretrainedConfig, PreTrainedModel, Qwen2Config, Qwen3Config, Qwen3NextConfig)
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from kvbridge.core.blocks import compute_physical_blocks_per_logical
from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache, TORCH_DTYPES
from kvbridge.core.plan import plan_request
from kvbridge.core.spec import LayerSpec, ModelSpec, normalize_dtype
from kvbridge.transport.local import LocalExecutor
from kvbridge.proofs.verify import random_bytes, random_request
from kvbridge.models import spec_from_hf_config

# --------------------------------------------------------------------------------------------
# Built-in tiny models
# --------------------------------------------------------------------------------------------

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, vocab_size=256, max_position_embeddings=512, head_dim=16,
    # Larger than the usual 0.02 so that random models' greedy tokens depend on the whole context
    # (with tiny weights they repeat one token, and a broken cache could go unnoticed).
    initializer_range=0.2,
    # No EOS/BOS/PAD: every oracle run decodes exactly the requested number of tokens.
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
    tie_word_embeddings=False, dtype="float32",
)


def _tiny_llama() -> PretrainedConfig:
    """GQA: 8 query heads, 4 KV heads (TP 1, 2, 4 shard; 8 replicates)."""
    return LlamaConfig(**_COMMON, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)


def _tiny_llama_6kv() -> PretrainedConfig:
    """6 KV heads: TP 2 and 3 both shard it, so 3 -> 2 and 2 -> 3 are legal non-divisible pairs."""
    cfg = {**_COMMON, "hidden_size": 96}  # transformers wants hidden_size divisible by the query heads
    return LlamaConfig(**cfg, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=6)


def _tiny_llama_mqa() -> PretrainedConfig:
    """MQA: one KV head, replicated on every rank of any TP > 1."""
    return LlamaConfig(**_COMMON, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1)


def _tiny_mistral() -> PretrainedConfig:
    """Every layer slides over 8 tokens: the cache keeps only the last 7."""
    return MistralConfig(**_COMMON, num_hidden_layers=2, num_attention_heads=8,
                                           num_key_value_heads=4, sliding_window=8)


def _tiny_qwen2() -> PretrainedConfig:
    """Qwen2 (QKV bias) with its own hybrid rule: layers >= max_window_layers slide (full, sliding, sliding)."""
    return Qwen2Config(**_COMMON, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                       use_sliding_window=True, sliding_window=12, max_window_layers=1)


def _tiny_qwen3() -> PretrainedConfig:
    """Qwen3: QK-norm, full attention."""
    return Qwen3Config(**_COMMON, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)


def _tiny_deepseek_v3() -> PretrainedConfig:
    """DeepSeek-V3: MLA (transformers caches the normalized latent and the rotated rope part, one head each,
    replicated on every TP rank) and a small routed MoE."""
    cfg = {k: v for k, v in _COMMON.items() if k != "head_dim"}
    return DeepseekV3Config(**cfg, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                            first_k_dense_replace=1, n_group=1, topk_group=1)


def _tiny_gemma2() -> PretrainedConfig:
    """Gemma2: alternating sliding (window 8) / full layers, logit soft-capping."""
    return Gemma2Config(**_COMMON, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                         sliding_window=8, query_pre_attn_scalar=16)


def _tiny_gpt_oss() -> PretrainedConfig:
    """gpt-oss: alternating sliding (window 8) / full layers, attention sinks, a 4-expert MoE."""
    # YaRN scaling 32x from 4096 original positions: max_position_embeddings must agree or transformers warns.
    cfg = {**_COMMON, "max_position_embeddings": 4096 * 32}
    return GptOssConfig(**cfg, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, sliding_window=8,
                        num_local_experts=4, num_experts_per_tok=2)


_HYBRID_COMMON: dict[str, Any] = {k: v for k, v in _COMMON.items() if k not in ("hidden_size", "intermediate_size",
                                                                                 "head_dim")}


def _tiny_bamba() -> PretrainedConfig:
    """Bamba (Mamba2): 8 heads of 16, 2 groups of d_state 8, conv 4; layer 1 attends with 8 query / 4 KV heads.

    TP 1, 2, 4 (and 8) shard it; TP 4 and 8 replicate the B/C groups.
    """
    return BambaConfig(**_HYBRID_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       attn_layer_indices=[1], num_attention_heads=8, num_key_value_heads=4, mamba_n_heads=8,
                       mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                       mamba_chunk_size=16)


def _tiny_granite_hybrid() -> PretrainedConfig:
    """GraniteMoeHybrid (Mamba2 + MoE): 12 heads, one group, 12 KV heads: TP 1, 2, 3, 4 (so 3 <-> 2) all shard."""
    return GraniteMoeHybridConfig(**_HYBRID_COMMON, hidden_size=48, intermediate_size=32, shared_intermediate_size=32,
                                  num_hidden_layers=3,
                                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                                  num_attention_heads=12, num_key_value_heads=12, num_local_experts=4,
                                  num_experts_per_tok=2, mamba_n_heads=12, mamba_d_head=8, mamba_n_groups=1,
                                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)


def _tiny_qwen3_next() -> PretrainedConfig:
    """Qwen3-Next: gated delta net (2 key / 4 value heads of 8, conv 4) + gated attention (2 KV heads) + MoE.

    TP 1, 2, 4 are legal; at TP 4 the Q/K conv segments and attention heads replicate while V shards.
    """
    return Qwen3NextConfig(**_HYBRID_COMMON, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                           layer_types=["linear_attention", "full_attention", "linear_attention"],
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                           linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32)


def _tiny_lfm2() -> PretrainedConfig:
    """LFM2: short conv (48 channels, L_cache 3) and attention (12 KV heads): TP 1, 2, 3, 4 all shard."""
    return Lfm2Config(**_HYBRID_COMMON, hidden_size=48, intermediate_size=96, block_auto_adjust_ff_dim=False,
                      num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_attention_heads=12,
                      num_key_value_heads=12, conv_L_cache=3)


BUILTIN_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-llama-6kv": _tiny_llama_6kv,
    "tiny-llama-mqa": _tiny_llama_mqa,
    "tiny-mistral": _tiny_mistral,
    "tiny-qwen2": _tiny_qwen2,
    "tiny-qwen3": _tiny_qwen3,
    "tiny-gemma2": _tiny_gemma2,
    "tiny-gpt-oss": _tiny_gpt_oss,
    "tiny-deepseek-v3": _tiny_deepseek_v3,
    "tiny-bamba": _tiny_bamba,
    "tiny-granite-hybrid": _tiny_granite_hybrid,
    "tiny-qwen3-next": _tiny_qwen3_next,
    "tiny-lfm2": _tiny_lfm2,
}
"""Random-weight configs (float32, hidden <= 96, vocab 256) by name; `tiny-llama` is the default."""

HYBRID_MODELS = ("tiny-bamba", "tiny-granite-hybrid", "tiny-qwen3-next", "tiny-lfm2")

DEFAULT_MODEL = "tiny-llama"


def load_model(name_or_dir: str, seed: int = 0) -> tuple[PreTrainedModel, PretrainedConfig]:
    """A float32 model in eval mode: a built-in config with weights drawn from `seed`, or a local
    `save_pretrained` directory (never the Hub, so the oracle runs offline)."""
    name = str(name_or_dir)
    if name in BUILTIN_MODELS:
        config = BUILTIN_MODELS[name]()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif Path(name).is_dir():
        if not (Path(name) / "config.json").is_file():
            raise ConfigError(f"{name} is a directory without config.json; builtin models: "
                              f"{', '.join(BUILTIN_MODELS)}")
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=True)
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
    with `kernel` values per channel), in the model's dtype; `state_dtype` when the recurrent state differs."""
    if dtype is None:
        dtype = getattr(config, "dtype", None) or "float32"
    spec = spec_from_hf_config(config.to_dict(), view="transformers", dtype=normalize_dtype(str(dtype)),
                                    state_dtype=normalize_dtype(str(state_dtype)) if state_dtype else None)
    name = Path(str(getattr(config, "name_or_path", "") or "")).name
    return msgspec.structs.replace(spec, name=name) if name else spec


# --------------------------------------------------------------------------------------------
# transformers caches <-> paged rank caches
# --------------------------------------------------------------------------------------------

BlockIds = tuple[tuple[int, ...], ...]


def _is_linear(layer: Any) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _is_attention(layer: Any) -> bool:
    return isinstance(layer, CacheLayerMixin)


def _check_layer_kind(layer: Any, lspec: LayerSpec, li: int) -> None:
    """The transformers cache layer must hold what the spec says: K/V or recurrent state, not both."""
    if _is_linear(layer) and _is_attention(layer):
        raise ConfigError(f"layer {li}: transformers cache layer {type(layer).__name__} holds attention K/V and "
                          f"recurrent state in one layer; kvbridge describes a layer as one or the other")
    if lspec.is_recurrent and not _is_linear(layer):
        raise ConfigError(f"layer {li}: the spec says recurrent ({lspec.recurrent_type}) but transformers caches it "
                          f"as {type(layer).__name__}")
    if not lspec.is_recurrent and _is_linear(layer):
        raise ConfigError(f"layer {li}: the spec says {lspec.kind!r} attention but transformers caches it as "
                          f"{type(layer).__name__} (recurrent state)")


def _cached_length(layer: Any) -> int:
    """Tokens the layer has seen (a sliding layer's cumulative length, not what it still holds)."""
    return int(getattr(layer, "cumulative_length", None) or layer.get_seq_length())


def _check_layer(cache: DynamicCache, spec: ModelSpec, li: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's [H, T, D] key and value tensors, after checking them against the spec."""
    lspec = spec.layers[li]
    layer = cache.layers[li]
    if lspec.kind == "mla" and not lspec.value_dim:
        raise ConfigError(f"layer {li} describes MLA as one latent row (the engine view); transformers keeps the "
                          f"latent and the rope part apart: build the spec with view='transformers'")
    if lspec.kind not in ("full", "sliding", "mla"):
        raise ConfigError(f"layer {li} is a {lspec.kind!r} layer; the transformers bridge moves attention "
                          f"K/V (full, sliding, MLA latent) here")
    _check_layer_kind(layer, lspec, li)
    if bool(getattr(layer, "is_sliding", False)) != (lspec.kind == "sliding"):
        raise ConfigError(f"layer {li}: transformers cache layer {type(layer).__name__} "
                          f"(is_sliding={getattr(layer, 'is_sliding', False)}) but the spec says {lspec.kind!r}")
    if getattr(layer, "keys", None) is None or not getattr(layer, "is_initialized", True):
        raise InvalidRequest(f"layer {li} of the cache is empty; run a prefill with use_cache=True first")
    keys, values = layer.keys, layer.values
    if keys.dim() != 4 or keys.shape[0] != 1:
        raise InvalidRequest(f"layer {li}: expected keys [1, heads, tokens, dim] (batch 1), got {tuple(keys.shape)}")
    want_k = (lspec.num_kv_heads, lspec.key_dim)
    want_v = (lspec.num_kv_heads, lspec.value_dim)
    if (keys.shape[1], keys.shape[3]) != want_k or (values.shape[1], values.shape[3]) != want_v:
        raise ConfigError(f"layer {li}: cache keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match "
                          f"the spec's {lspec.num_kv_heads} heads of dim {lspec.key_dim}/{lspec.value_dim}")
    if keys.dtype != values.dtype or normalize_dtype(str(keys.dtype)) != spec.dtype:
        raise ConfigError(f"layer {li}: cache dtype {keys.dtype}/{values.dtype}, spec dtype {spec.dtype}")
    seen = _cached_length(layer)
    if seen != num_tokens:
        raise InvalidRequest(f"layer {li} has seen {seen} tokens, the request says {num_tokens}")
    held = keys.shape[2]
    first = lspec.tokens_kept(num_tokens)
    if held != num_tokens - first or values.shape[2] != held:
        raise ConfigError(
            f"layer {li} ({lspec.kind}, window {lspec.window}, sliding_window "
            f"{getattr(layer, 'sliding_window', None)} in transformers) holds {held} of {num_tokens} tokens, "
            f"kvbridge keeps {num_tokens - first} (positions from {first})")
    return keys[0], values[0]


# -- recurrent state ------------------------------------------------------------------------


def _conv_components(lspec: LayerSpec) -> list[int]:
    return [ci for ci, c in enumerate(lspec.state) if c.name.startswith("conv")]


def hf_state_shapes(lspec: LayerSpec) -> tuple[tuple[int, int, int], tuple[int, int, int, int] | None]:
    """Shapes transformers gives a recurrent layer's `conv_states[0]` and `recurrent_states[0]` (batch 1).

    conv: `[1, sum of segment channels, conv_rows]`. Recurrent: Mamba2 `[1, heads, head_dim, d_state]`
    (head_dim = conv_x's channels per head), GDN `[1, v_heads, k_head_dim, v_head_dim]` (k_head_dim =
    conv_q's channels per head); short conv (LFM2) keeps none.
    """
    rows = lspec.conv_rows
    convs = _conv_components(lspec)
    others = [ci for ci in range(len(lspec.state)) if ci not in convs]
    if rows < 1 or not convs:
        raise ConfigError(f"recurrent layer ({lspec.recurrent_type}) needs conv components and conv_rows >= 1")
    for ci in convs:
        c = lspec.state[ci]
        if c.dim % rows:
            raise ConfigError(f"conv component {c.name!r}: dim {c.dim} is not a multiple of conv_rows {rows}")
    conv_shape = (1, sum(lspec.state[ci].heads * lspec.state[ci].dim // rows for ci in convs), rows)
    if not others:
        return conv_shape, None
    if len(others) != 1 or others[0] != len(lspec.state) - 1:
        raise ConfigError(f"recurrent layer: expected conv components then one state, got "
                          f"{[c.name for c in lspec.state]}")
    if lspec.recurrent_type not in ("mamba2", "gdn"):
        raise ConfigError(f"transformers recurrent-state layout of {lspec.recurrent_type!r} layers is not known")
    s = lspec.state[others[0]]
    a = lspec.state[convs[0]].dim // rows  # mamba2: conv_x per head = head_dim; gdn: conv_q per head = k_head_dim
    if s.dim % a:
        raise ConfigError(f"state {s.name!r} dim {s.dim} does not split into {a} x {s.dim / a}")
    return conv_shape, (1, s.heads, a, s.dim // a)


def _hf_states(cache: DynamicCache, spec: ModelSpec, li: int) -> list[torch.Tensor]:
    """The layer's state as spec components `[units, dim]`, after checking it against the spec."""
    lspec, layer = spec.layers[li], cache.layers[li]
    _check_layer_kind(layer, lspec, li)
    if getattr(layer, "number_of_states", 1) != 1:
        raise ConfigError(f"layer {li} keeps {layer.number_of_states} conv/recurrent states; kvbridge moves one")
    if not (layer.is_conv_states_initialized.get(0) and layer.has_previous_state.get(0)):
        raise InvalidRequest(f"layer {li} has no conv state yet; run a prefill with use_cache=True first")
    conv_shape, rec_shape = hf_state_shapes(lspec)
    conv = layer.conv_states[0]
    rec = layer.recurrent_states[0] if layer.is_recurrent_states_initialized.get(0) else None
    convs = _conv_components(lspec)
    if tuple(conv.shape) != conv_shape:
        raise ConfigError(
            f"layer {li}: transformers caches conv state {tuple(conv.shape)}, kvbridge's spec says {conv_shape} "
            f"({' | '.join(f'{lspec.state[ci].name} {lspec.state[ci].heads}x{lspec.state[ci].dim}' for ci in convs)}, "
            f"{lspec.conv_rows} rows)")
    if (rec is None) != (rec_shape is None) or (rec is not None and tuple(rec.shape) != rec_shape):
        raise ConfigError(f"layer {li}: transformers caches recurrent state "
                          f"{None if rec is None else tuple(rec.shape)}, kvbridge's spec says {rec_shape}")
    out = []
    offset = 0
    for ci in convs:
        c = lspec.state[ci]
        channels = c.heads * c.dim // lspec.conv_rows
        out.append(conv[0, offset:offset + channels].reshape(c.heads, c.dim))
        offset += channels
    if rec is not None:
        s = lspec.state[-1]
        out.append(rec[0].reshape(s.heads, s.dim))
    for c, t in zip(lspec.state, out):
        if normalize_dtype(str(t.dtype)) != spec.component_dtype(c):
            raise ConfigError(f"layer {li}: transformers keeps {c.name!r} as {t.dtype}, kvbridge's spec says "
                              f"{spec.component_dtype(c)} (set the state dtype to match)")
    return out


def _hf_from_components(lspec: LayerSpec, comps: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of `_hf_states`: transformers' conv and recurrent state tensors from components."""
    conv_shape, rec_shape = hf_state_shapes(lspec)
    convs = _conv_components(lspec)
    conv = torch.cat([comps[ci].reshape(-1, lspec.conv_rows) for ci in convs])[None]
    if tuple(conv.shape) != conv_shape:  # pragma: no cover - guarded by hf_state_shapes
        raise ConfigError(f"rebuilt conv state {tuple(conv.shape)} != {conv_shape}")
    rec = comps[-1].reshape(rec_shape) if rec_shape is not None else None
    return conv, rec


def _check_caches(caches: Sequence[RankCache], spec: ModelSpec, block_ids: BlockIds) -> None:
    if len(block_ids) != len(spec.groups):
        raise InvalidRequest(f"{len(block_ids)} block-id lists for {len(spec.groups)} KV-cache groups")
    for rc in caches:
        if rc.spec.fingerprint() != spec.fingerprint():
            raise ConfigError(f"rank {rc.rank} cache was allocated for another geometry ({rc.spec.describe()})")


def _state_slot(spec: ModelSpec, layout: EngineLayout, block_ids: BlockIds, li: int) -> int:
    """A request's recurrent slot: the last block id of the layer's group (vLLM puts placeholders before it)."""
    ids = block_ids[spec.layer_group[li]]
    if not ids:
        raise InvalidRequest(f"layer {li}: the recurrent group has no block ids")
    if not 0 <= ids[-1] < layout.num_blocks:
        raise InvalidRequest(f"layer {li}: state block id {ids[-1]} outside [0, {layout.num_blocks})")
    return int(ids[-1])


def export_tokens(cache: DynamicCache, spec: ModelSpec, caches: Sequence[RankCache], block_ids: BlockIds,
                  num_tokens: int, start: int = 0, stop: int | None = None) -> None:
    """Write the attention K/V of positions `[start, stop)` (default all) of a batch-1 prefill cache
    of `num_tokens` tokens into paged rank caches; positions before a sliding window are skipped.

    Each rank gets its own head shard of every attention layer, through the layout's addressing,
    the way a serving engine's attention kernel would have written them.
    """
    if len(cache.layers) != spec.num_layers:
        raise ConfigError(f"cache has {len(cache.layers)} layers, spec {spec.num_layers}")
    _check_caches(caches, spec, block_ids)
    stop = num_tokens if stop is None else stop
    if not 0 <= start <= stop <= num_tokens:
        raise InvalidRequest(f"need 0 <= start <= stop <= {num_tokens}, got {start} and {stop}")
    for li in range(spec.num_layers):
        if spec.layers[li].is_recurrent:
            continue
        kv = _check_layer(cache, spec, li, num_tokens)
        first = spec.layers[li].tokens_kept(num_tokens)
        lo = max(first, start)
        if lo >= stop:
            continue
        positions = np.arange(lo, stop, dtype=np.int64)
        ids = np.asarray(block_ids[spec.layer_group[li]], dtype=np.int64)
        for rc in caches:
            for ci, tensor in enumerate(kv):
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                rc.write_tokens(li, ci, ids, positions, tensor[h0:h0 + nh, lo - first:stop - first].transpose(0, 1))


def export_states(cache: DynamicCache, spec: ModelSpec, caches: Sequence[RankCache], block_ids: BlockIds) -> None:
    """Write every recurrent layer's state into each rank's shard of each component, at the
    request's slot (the last block id of the layer's group)."""
    if len(cache.layers) != spec.num_layers:
        raise ConfigError(f"cache has {len(cache.layers)} layers, spec {spec.num_layers}")
    _check_caches(caches, spec, block_ids)
    for li in range(spec.num_layers):
        if not spec.layers[li].is_recurrent:
            continue
        comps = _hf_states(cache, spec, li)
        for rc in caches:
            slot = _state_slot(spec, rc.layout, block_ids, li)
            for ci, full in enumerate(comps):
                u0, nu = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                rc.write_state(li, ci, slot, full[u0:u0 + nu])


def export_cache(cache: DynamicCache, spec: ModelSpec, caches: Sequence[RankCache], block_ids: BlockIds,
                 num_tokens: int) -> None:
    """Write a batch-1 prefill cache into the prefill engine's paged rank caches: attention K/V at
    the positions each layer keeps (`[tokens_kept(N), N)`) and recurrent state at its slot."""
    export_tokens(cache, spec, caches, block_ids, num_tokens)
    export_states(cache, spec, caches, block_ids)


def _check_rank_order(caches: Sequence[RankCache]) -> None:
    if not caches:
        raise InvalidRequest("no rank caches to import from")
    layout = caches[0].layout
    if [c.rank for c in caches] != list(range(layout.tp_size)):
        got = [c.rank for c in caches]
        raise InvalidRequest(f"need the {layout.tp_size} rank caches in rank order, got ranks {got}")


def gather_kv(caches: Sequence[RankCache], block_ids: BlockIds,
              num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Every attention layer's global `[H, N, D]` keys and values from the decode ranks (None for
    recurrent layers).

    Each head is read from the first rank that holds it; positions before a sliding window are
    zeros (the engine does not keep them and transformers drops them).
    """
    _check_rank_order(caches)
    spec = caches[0].spec
    if len(block_ids) != len(spec.groups):
        raise InvalidRequest(f"{len(block_ids)} block-id lists for {len(spec.groups)} KV-cache groups")
    dtype = caches[0].regions[0].dtype
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for li, lspec in enumerate(spec.layers):
        if lspec.is_recurrent:
            out.append(None)
            continue
        first = lspec.tokens_kept(num_tokens)
        positions = np.arange(first, num_tokens, dtype=np.int64)
        ids = np.asarray(block_ids[spec.layer_group[li]], dtype=np.int64)
        pair = []
        for ci, comp in enumerate(lspec.components):
            full = torch.zeros(comp.heads, num_tokens, comp.dim, dtype=dtype)
            have = np.zeros(comp.heads, dtype=bool)
            for rc in caches:
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                need = [h for h in range(h0, h0 + nh) if not have[h]]
                if not need or not len(positions):
                    have[need] = True
                    continue
                rows = rc.read_tokens(li, ci, ids, positions)  # [T, nh, D]
                for h in need:
                    full[h, first:] = rows[:, h - h0]
                have[need] = True
            if not have.all():
                raise InvalidRequest(f"layer {li} component {ci}: heads {np.flatnonzero(~have).tolist()} on no rank")
            pair.append(full)
        out.append((pair[0], pair[1]))
    return out


def gather_states(caches: Sequence[RankCache], block_ids: BlockIds) -> dict[int, list[torch.Tensor]]:
    """Every recurrent layer's state components `[units, dim]` from the decode ranks, each unit from
    the first rank that holds it, at the request's slot."""
    _check_rank_order(caches)
    spec = caches[0].spec
    if len(block_ids) != len(spec.groups):
        raise InvalidRequest(f"{len(block_ids)} block-id lists for {len(spec.groups)} KV-cache groups")
    out: dict[int, list[torch.Tensor]] = {}
    for li, lspec in enumerate(spec.layers):
        if not lspec.is_recurrent:
            continue
        comps = []
        for ci, comp in enumerate(lspec.components):
            full = torch.zeros(comp.heads, comp.dim, dtype=TORCH_DTYPES[spec.component_dtype(comp)])
            have = np.zeros(comp.heads, dtype=bool)
            for rc in caches:
                u0, nu = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                need = [u for u in range(u0, u0 + nu) if not have[u]]
                if need:
                    rows = rc.read_state(li, ci, _state_slot(spec, rc.layout, block_ids, li))
                    full[need] = rows[[u - u0 for u in need]]
                    have[need] = True
            if not have.all():
                raise InvalidRequest(f"layer {li} {comp.name}: units {np.flatnonzero(~have).tolist()} on no rank")
            comps.append(full)
        out[li] = comps
    return out


def replica_mismatches(caches: Sequence[RankCache], block_ids: BlockIds, num_tokens: int) -> list[str]:
    """Heads (or state units) that two decode ranks both hold but with different bytes."""
    spec = caches[0].spec
    out = []
    for li, lspec in enumerate(spec.layers):
        positions = np.arange(lspec.tokens_kept(num_tokens), num_tokens, dtype=np.int64)
        if not lspec.is_recurrent and not len(positions):
            continue
        ids = np.asarray(block_ids[spec.layer_group[li]], dtype=np.int64)
        for ci, comp in enumerate(lspec.components):
            seen: dict[int, tuple[int, torch.Tensor]] = {}
            for rc in caches:
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                if lspec.is_recurrent:
                    rows = rc.read_state(li, ci, _state_slot(spec, rc.layout, block_ids, li), as_int=True)
                else:
                    rows = rc.read_tokens(li, ci, ids, positions, as_int=True).transpose(0, 1)
                for h in range(h0, h0 + nh):
                    if h not in seen:
                        seen[h] = (rc.rank, rows[h - h0])
                    elif not torch.equal(seen[h][1], rows[h - h0]):
                        what = f"{comp.name} unit" if lspec.is_recurrent else f"comp {ci} head"
                        out.append(f"layer {li} {what} {h}: rank {rc.rank} differs from rank {seen[h][0]}")
    return out


def import_cache(caches: Sequence[RankCache], block_ids: BlockIds, num_tokens: int,
                 config: PretrainedConfig) -> DynamicCache:
    """A `DynamicCache` for `config` holding the decode ranks' paged cache of `num_tokens` tokens.

    Sliding layers get all N positions (zeros before the window) so that their cumulative length
    is N, which is what transformers uses for positions and masks; the layer crops itself.
    Recurrent layers get their conv and recurrent state through transformers' own prefill path
    (`update_conv_state` / `update_recurrent_state`), which also marks `has_previous_state`, so
    the next forward continues with the single-token update exactly as after a prefill.
    """
    _check_rank_order(caches)
    spec = caches[0].spec
    cache = DynamicCache(config=config)
    if len(cache.layers) not in (0, spec.num_layers) or (not cache.layers and spec.has_recurrent):
        raise ConfigError(f"config makes a cache of {len(cache.layers)} layers, the rank caches have {spec.num_layers}")
    states = gather_states(caches, block_ids)
    for li, kv in enumerate(gather_kv(caches, block_ids, num_tokens)):
        lspec = spec.layers[li]
        if cache.layers:
            _check_layer_kind(cache.layers[li], lspec, li)
        if kv is not None:
            cache.update(kv[0][None], kv[1][None], li)
            continue
        conv, rec = _hf_from_components(lspec, states[li])
        cache.update_conv_state(conv, li, conv_kernel_size=lspec.conv_rows)
        if rec is not None:
            cache.update_recurrent_state(rec, li)
    for li, layer in enumerate(cache.layers):
        if spec.layers[li].is_recurrent:
            if not cache.has_previous_state(li):
                raise InvalidRequest(f"imported layer {li} did not take its recurrent state")
            continue
        if layer.get_seq_length() != num_tokens:
            raise InvalidRequest(f"imported layer {li} reports {layer.get_seq_length()} tokens, expected {num_tokens}")
        if bool(getattr(layer, "is_sliding", False)) != (spec.layers[li].kind == "sliding"):
            raise ConfigError(f"layer {li}: config builds {type(layer).__name__}, spec says {spec.layers[li].kind!r}")
    if any(not x.is_recurrent for x in spec.layers) and cache.get_seq_length() != num_tokens:
        raise InvalidRequest(f"imported cache reports {cache.get_seq_length()} tokens, expected {num_tokens}")
    return cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same bytes, so that equality is bitwise (NaN == NaN, -0.0 != 0.0)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _layer_tensors(layer: Any) -> dict[str, torch.Tensor | None]:
    """What a cache layer holds, by the names `save_cache` writes."""
    out: dict[str, torch.Tensor | None] = {}
    if _is_attention(layer):
        out["keys"], out["values"] = layer.keys, layer.values
    if _is_linear(layer):
        for name in ("conv_states", "recurrent_states"):
            for i, t in getattr(layer, name).items():
                out[name if i == 0 else f"{name}.{i}"] = t
    return out


def cache_differences(a: DynamicCache, b: DynamicCache) -> list[str]:
    """Layers where two caches differ in kind, length, shape or any bit of what they hold
    (keys, values, conv states, recurrent states)."""
    if len(a.layers) != len(b.layers):
        return [f"layer count {len(a.layers)} != {len(b.layers)}"]
    out = []
    for li, (x, y) in enumerate(zip(a.layers, b.layers)):
        if (_is_linear(x), _is_attention(x)) != (_is_linear(y), _is_attention(y)):
            out.append(f"layer {li}: {type(x).__name__} != {type(y).__name__}")
            continue
        if _is_attention(x) and _cached_length(x) != _cached_length(y):
            out.append(f"layer {li}: length {_cached_length(x)} != {_cached_length(y)}")
            continue
        if _is_linear(x) and dict(x.has_previous_state) != dict(y.has_previous_state):
            out.append(f"layer {li}: has_previous_state {x.has_previous_state} != {y.has_previous_state}")
        tx, ty = _layer_tensors(x), _layer_tensors(y)
        for name in sorted(set(tx) | set(ty)):
            s, t = tx.get(name), ty.get(name)
            if s is None or t is None:
                if (s is None) != (t is None):
                    out.append(f"layer {li} {name}: {'missing' if s is None else 'present'} != "
                               f"{'missing' if t is None else 'present'}")
            elif s.shape != t.shape or s.dtype != t.dtype:
                out.append(f"layer {li} {name}: {tuple(s.shape)} {s.dtype} != {tuple(t.shape)} {t.dtype}")
            elif not torch.equal(_bits(s), _bits(t)):
                n = int((_bits(s) != _bits(t)).sum())
                out.append(f"layer {li} {name}: {n} of {s.numel()} elements differ")
    return out


def save_cache(cache: DynamicCache, path: str | Path) -> None:
    """safetensors file with what each layer holds, as transformers holds it: attention layers
    `layers.{i}.keys` / `layers.{i}.values` `[1, H, tokens_held, D]`; recurrent layers
    `layers.{i}.conv_states` `[1, conv_dim, kernel]` and `layers.{i}.recurrent_states` (Mamba2
    `[1, heads, head_dim, d_state]`, GDN `[1, v_heads, k_head_dim, v_head_dim]`; none for short conv)."""
    from safetensors.torch import save_file

    tensors = {}
    for li, layer in enumerate(cache.layers):
        for name, t in _layer_tensors(layer).items():
            if t is not None:
                tensors[f"layers.{li}.{name}"] = t.detach().contiguous().cpu()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))

# --------------------------------------------------------------------------------------------
# The demo / oracle
# --------------------------------------------------------------------------------------------


@dataclass
class DemoResult:
    """Outcome of one disaggregated run against the plain `generate` reference."""

    model: str
    spec: str
    prefill: str
    decode: str
    prompt_len: int
    new_tokens: int
    tokens_reference: list[int]
    tokens_disaggregated: list[int]
    match: bool
    cache_equal: bool
    replicas_equal: bool
    bytes_moved: int
    num_runs: int
    transfer_seconds: float  # steady-state copy time (second execution of the same plan)
    plan_seconds: float
    cache_differences: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix the decode engine already held (not moved)

    @property
    def ok(self) -> bool:
        return self.match and self.cache_equal and self.replicas_equal

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def summary(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        hit = f" ({self.num_cached_tokens} cached on decode)" if self.num_cached_tokens else ""
        return (f"{verdict}: {self.model} prefill [{self.prefill}] -> decode [{self.decode}], {self.prompt_len} prompt "
                f"tokens{hit}, {self.new_tokens} new; tokens {'match' if self.match else 'differ'}, cache "
                f"{'bit-exact' if self.cache_equal else 'differs'}; {self.bytes_moved} B in {self.num_runs} runs "
                f"(plan {self.plan_seconds * 1e3:.2f} ms, copy {self.transfer_seconds * 1e3:.2f} ms)")


def make_prompt_ids(prompt: Sequence[int] | int, vocab_size: int, seed: int) -> list[int]:
    """The prompt: given ids (checked against the vocab) or that many random ids from `seed`."""
    if isinstance(prompt, (int, np.integer)) and not isinstance(prompt, bool):
        if prompt < 1:
            raise InvalidRequest(f"prompt length must be >= 1, got {prompt}")
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (int(prompt),), generator=gen).tolist()
    ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequest("empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return ids


def _check_capacity(layout: EngineLayout, num_tokens: int, side: str) -> None:
    need = -(-num_tokens // layout.block_size)
    if need > layout.num_blocks:
        raise InvalidRequest(
            f"{side} layout has {layout.num_blocks} blocks of {layout.block_size} tokens; a {num_tokens}-token prompt "
            f"needs {need} (set num_blocks >= {need})")


def default_layout(num_tokens: int, tp_size: int = 1, block_size: int = 16, **kwargs: Any) -> EngineLayout:
    """A layout with twice the blocks the prompt needs, so block ids are scattered."""
    return EngineLayout(tp_size=tp_size, block_size=block_size,
                        num_blocks=max(2, 2 * math.ceil(num_tokens / block_size)), **kwargs)


def vllm_block_size(spec: ModelSpec, tp_size: int, kernel_block_size: int = 16) -> int:
    """The logical block size a vLLM hybrid engine of `tp_size` ranks would use: R kernel blocks, with
    R = ceil(one rank's recurrent state of a layer / one rank's attention K+V page of a kernel block)
    (vLLM's `compute_physical_blocks_per_logical`), so that one logical page holds a whole state.

    R depends on TP: the state shrinks with TP while attention pages stop shrinking once KV heads
    replicate. vLLM rounds pages further for alignment (its R 34 vs 66); this keeps the TP
    dependence, which is what makes the two sides' kernel ratios differ. Attention-only: the kernel size.
    """
    if not spec.has_recurrent or all(x.is_recurrent for x in spec.layers):
        return kernel_block_size
    a = EngineLayout(tp_size=tp_size, block_size=kernel_block_size, num_blocks=1).addressing(spec, 0)

    def rank_bytes(li: int) -> int:
        return sum(int(a.heads[li, ci] * a.row_bytes[li, ci]) for ci in range(len(spec.layers[li].components)))

    state = max(rank_bytes(li) for li, x in enumerate(spec.layers) if x.is_recurrent)
    page = max(rank_bytes(li) for li, x in enumerate(spec.layers) if not x.is_recurrent) * kernel_block_size
    return compute_physical_blocks_per_logical((state,), page) * kernel_block_size


def _greedy_config() -> GenerationConfig:
    """Plain greedy decoding: no EOS stop, no penalties or processors from a checkpoint's defaults."""
    return GenerationConfig(do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=None, bos_token_id=None)


@torch.inference_mode()
def run_demo(model_name_or_dir: str = DEFAULT_MODEL, prompt: Sequence[int] | int | None = None, new_tokens: int = 8,
             seed: int = 0, prefill: EngineLayout | None = None, decode: EngineLayout | None = None,
             dump_decode_cache: str | Path | None = None, *, prompt_ids: Sequence[int] | None = None,
             prompt_len: int | None = None, num_cached_tokens: int = 0) -> DemoResult:
    """Prefill on one engine layout, move the cache to another, decode there, compare with `generate`.

    The prompt is `prompt` (ids, or a length for random ids) or, by keyword, `prompt_ids`, else
    `prompt_len` random ids (default 32). Both block tables are random distinct ids (seeded) and
    both engines' memory starts as random bytes, so a copy that lands in the wrong place or
    misses a row shows up as a different cache.

    `num_cached_tokens` (a multiple of the decode block size, below the prompt length) is a
    prefix-cache hit on the decode engine: before the move, the decode ranks are given that prefix
    as a serving engine would hold it (the attention K/V of those positions, and for a hybrid model
    the recurrent state after the prefix in the slot of the prefix's last block), and only the rest
    is moved: attention positions from `num_cached_tokens` on and the recurrent state after the
    whole prompt, into the request's slot.
    """
    if prompt is not None and prompt_ids is not None:
        raise InvalidRequest("give the prompt once: positional `prompt` or `prompt_ids`, not both")
    if prompt is None:
        prompt = prompt_ids if prompt_ids is not None else (32 if prompt_len is None else prompt_len)
    if new_tokens < 1:
        raise InvalidRequest(f"new_tokens must be >= 1, got {new_tokens}")
    model, config = load_model(model_name_or_dir, seed)
    model.generation_config = _greedy_config()
    spec = spec_for(config, next(model.parameters()).dtype)
    if all(layer.is_recurrent for layer in spec.layers):
        raise ConfigError(
            f"{model_name_or_dir}: every layer is recurrent; transformers' generate needs an attention layer to "
            f"track the sequence length (Cache.get_seq_length raises on a cache of linear-attention layers only)")
    vocab = int(config.get_text_config().vocab_size)
    ids = make_prompt_ids(prompt, vocab, seed)
    n = len(ids)
    prefill = prefill or default_layout(n)
    decode = decode or default_layout(n)
    _check_capacity(prefill, n, "prefill")
    _check_capacity(decode, n, "decode")
    if not 0 <= num_cached_tokens < n or num_cached_tokens % decode.block_size:
        raise InvalidRequest(
            f"num_cached_tokens must be a multiple of the decode block size {decode.block_size} in [0, {n}) "
            f"(a prefix hit covers whole blocks and leaves at least one token to move), got {num_cached_tokens}")
    input_ids = torch.tensor([ids], dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)

    reference = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens)
    tokens_reference = reference[0, n:].tolist()
    if len(tokens_reference) != new_tokens:
        raise InvalidRequest(f"reference generate stopped after {len(tokens_reference)} of {new_tokens} tokens")

    out = model(input_ids, attention_mask=attention_mask, use_cache=True)
    prefill_cache: DynamicCache = out.past_key_values
    first = int(out.logits[0, -1].argmax())

    src = RankCache.allocate_engine(spec, prefill, fill=None)
    dst = RankCache.allocate_engine(spec, decode, fill=None)
    random_bytes(src, seed + 1)
    random_bytes(dst, seed + 2)
    request = random_request(spec, prefill, decode, n, num_cached_tokens, random.Random(seed))
    export_cache(prefill_cache, spec, src, request.src_block_ids, n)
    if num_cached_tokens:
        _hold_prefix(model, input_ids, prefill_cache, spec, dst, request.dst_block_ids, n, num_cached_tokens)
    plan = plan_request(spec, prefill, decode, request)
    executor = LocalExecutor(src, dst)
    executor.execute(plan)
    # The first execution of a process may include the numba JIT compile (~0.5 s); copying the
    # same runs again is idempotent, and its time is the one worth reporting.
    transfer_seconds = executor.execute(plan)
    imported = import_cache(dst, request.dst_block_ids, n, config)
    differences = cache_differences(prefill_cache, imported)
    replicas = replica_mismatches(dst, request.dst_block_ids, n)
    if dump_decode_cache is not None:
        save_cache(imported, dump_decode_cache)

    tokens = [first]
    if new_tokens > 1:
        cont = torch.cat([input_ids, torch.tensor([[first]])], dim=1)
        rest = model.generate(cont, attention_mask=torch.ones_like(cont), past_key_values=imported,
                              max_new_tokens=new_tokens - 1)
        tokens += rest[0, n + 1:].tolist()

    return DemoResult(
        model=str(model_name_or_dir), spec=spec.describe(), prefill=prefill.describe(), decode=decode.describe(),
        prompt_len=n, new_tokens=new_tokens, tokens_reference=tokens_reference, tokens_disaggregated=tokens,
        match=tokens == tokens_reference,
        cache_equal=not differences, replicas_equal=not replicas, bytes_moved=plan.nbytes, num_runs=len(plan),
        transfer_seconds=transfer_seconds, plan_seconds=plan.stats.plan_seconds,
        cache_differences=differences + replicas, warnings=list(plan.stats.warnings),
        num_cached_tokens=num_cached_tokens)


def _hold_prefix(model: PreTrainedModel, input_ids: torch.Tensor, prefill_cache: DynamicCache, spec: ModelSpec,
                 dst: Sequence[RankCache], dst_block_ids: BlockIds, num_tokens: int, cached: int) -> None:
    """Put a prefix-cache hit of `cached` tokens on the decode ranks, as the decode engine holds it.

    Attention: positions `[0, cached)` of the prefill cache itself (bit-identical to what a
    prefix computed there would hold for the same tokens in exact arithmetic, and exactly what
    the final cache must contain). Recurrent state: the state after the prefix, computed by a
    forward over the prefix alone, in the slot of the prefix's last block — a plan that skipped
    the state or put it in that slot instead of the request's leaves a wrong but plausible state.
    """
    export_tokens(prefill_cache, spec, dst, dst_block_ids, num_tokens, 0, cached)
    if spec.has_recurrent:
        prefix_cache = model(input_ids[:, :cached], attention_mask=torch.ones_like(input_ids[:, :cached]),
                             use_cache=True).past_key_values
        blocks = -(-cached // dst[0].layout.block_size)
        export_states(prefix_cache, spec, dst, tuple(ids[:blocks] for ids in dst_block_ids))


__all__ = [
    "BUILTIN_MODELS", "DEFAULT_MODEL", "HYBRID_MODELS", "DemoResult", "cache_differences", "default_layout",
    "export_cache", "export_states", "export_tokens", "gather_kv", "gather_states", "hf_state_shapes", "import_cache",
    "load_model", "make_prompt_ids", "replica_mismatches", "run_demo", "save_cache", "spec_for", "vllm_block_size",
]
