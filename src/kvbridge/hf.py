"""The transformers bridge: an end-to-end oracle for kvbridge plans.

A plan is only right if a model that decodes from the moved cache produces exactly what it
would have produced without the move. This module runs that experiment on a real
`transformers` model: prefill on a TP=P engine layout, move the paged KV cache with the planner
and the local executor to a TP=D engine layout, rebuild a `DynamicCache` from the destination
ranks and continue greedy decoding. The tokens must equal plain `generate` and the rebuilt cache
must be bit-identical to the prefill cache.

Built-in models are tiny random-weight configs (no download): each covers one cache geometry
(GQA, MQA, sliding window, alternating sliding/full, QK-norm, MoE).
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
from transformers import (AutoModelForCausalLM, DynamicCache, Gemma2Config, GenerationConfig, GptOssConfig,
                          LlamaConfig, MistralConfig, PretrainedConfig, PreTrainedModel, Qwen2Config, Qwen3Config)

from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.layout import EngineLayout, RankCache
from kvbridge.plan import plan_request
from kvbridge.spec import ModelSpec, normalize_dtype
from kvbridge.transport.local import LocalExecutor
from kvbridge.verify import random_bytes, random_request

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


BUILTIN_MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-llama-6kv": _tiny_llama_6kv,
    "tiny-llama-mqa": _tiny_llama_mqa,
    "tiny-mistral": _tiny_mistral,
    "tiny-qwen2": _tiny_qwen2,
    "tiny-qwen3": _tiny_qwen3,
    "tiny-gemma2": _tiny_gemma2,
    "tiny-gpt-oss": _tiny_gpt_oss,
}
"""Random-weight configs (float32, hidden 64, vocab 256) by name; `tiny-llama` is the default."""

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


def spec_for(config: PretrainedConfig, dtype: str | torch.dtype | None = None) -> ModelSpec:
    """The KV geometry as transformers caches it (MLA decompressed to heads), in the model's dtype."""
    if dtype is None:
        dtype = getattr(config, "dtype", None) or "float32"
    spec = ModelSpec.from_hf_config(config.to_dict(), mla_view="heads", dtype=normalize_dtype(str(dtype)))
    name = Path(str(getattr(config, "name_or_path", "") or "")).name
    return msgspec.structs.replace(spec, name=name) if name else spec


# --------------------------------------------------------------------------------------------
# DynamicCache <-> paged rank caches
# --------------------------------------------------------------------------------------------


def _cached_length(layer: Any) -> int:
    """Tokens the layer has seen (a sliding layer's cumulative length, not what it still holds)."""
    return int(getattr(layer, "cumulative_length", None) or layer.get_seq_length())


def _check_layer(cache: DynamicCache, spec: ModelSpec, li: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's [H, T, D] key and value tensors, after checking them against the spec."""
    lspec = spec.layers[li]
    layer = cache.layers[li]
    if lspec.kind not in ("full", "sliding"):
        raise ConfigError(f"layer {li} is a {lspec.kind!r} layer; the transformers bridge moves K/V attention "
                          f"caches only (describe MLA with mla_view='heads')")
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


def export_cache(cache: DynamicCache, spec: ModelSpec, caches: Sequence[RankCache],
                 block_ids: tuple[tuple[int, ...], ...], num_tokens: int) -> None:
    """Write a batch-1 prefill cache into the prefill engine's paged rank caches.

    Each rank gets its own head shard of every layer at the positions the layer keeps
    (`[tokens_kept(N), N)`), through the layout's addressing, the way a serving engine's
    attention kernel would have written them during prefill.
    """
    if len(cache.layers) != spec.num_layers:
        raise ConfigError(f"cache has {len(cache.layers)} layers, spec {spec.num_layers}")
    if len(block_ids) != len(spec.groups):
        raise InvalidRequest(f"{len(block_ids)} block-id lists for {len(spec.groups)} KV-cache groups")
    for li in range(spec.num_layers):
        kv = _check_layer(cache, spec, li, num_tokens)
        first = spec.layers[li].tokens_kept(num_tokens)
        positions = np.arange(first, num_tokens, dtype=np.int64)
        ids = np.asarray(block_ids[spec.layer_group[li]], dtype=np.int64)
        for rc in caches:
            if rc.spec.fingerprint() != spec.fingerprint():
                raise ConfigError(f"rank {rc.rank} cache was allocated for another geometry ({rc.spec.describe()})")
            for ci, tensor in enumerate(kv):
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                rc.write_tokens(li, ci, ids, positions, tensor[h0:h0 + nh].transpose(0, 1))


def gather_kv(caches: Sequence[RankCache], block_ids: tuple[tuple[int, ...], ...],
              num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's global `[H, N, D]` keys and values from the decode ranks.

    Each head is read from the first rank that holds it; positions before a sliding window are
    zeros (the engine does not keep them and transformers drops them).
    """
    if not caches:
        raise InvalidRequest("no rank caches to import from")
    spec, layout = caches[0].spec, caches[0].layout
    if [c.rank for c in caches] != list(range(layout.tp_size)):
        got = [c.rank for c in caches]
        raise InvalidRequest(f"need the {layout.tp_size} rank caches in rank order, got ranks {got}")
    if len(block_ids) != len(spec.groups):
        raise InvalidRequest(f"{len(block_ids)} block-id lists for {len(spec.groups)} KV-cache groups")
    dtype = caches[0].regions[0].dtype
    out = []
    for li, lspec in enumerate(spec.layers):
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


def replica_mismatches(caches: Sequence[RankCache], block_ids: tuple[tuple[int, ...], ...],
                       num_tokens: int) -> list[str]:
    """Heads that two decode ranks both hold but with different bytes (replication gone wrong)."""
    spec = caches[0].spec
    out = []
    for li, lspec in enumerate(spec.layers):
        positions = np.arange(lspec.tokens_kept(num_tokens), num_tokens, dtype=np.int64)
        if not len(positions):
            continue
        ids = np.asarray(block_ids[spec.layer_group[li]], dtype=np.int64)
        for ci in range(len(lspec.components)):
            seen: dict[int, tuple[int, torch.Tensor]] = {}
            for rc in caches:
                h0, nh = int(rc.addr.first_head[li, ci]), int(rc.addr.heads[li, ci])
                rows = rc.read_tokens(li, ci, ids, positions, as_int=True)
                for h in range(h0, h0 + nh):
                    if h not in seen:
                        seen[h] = (rc.rank, rows[:, h - h0])
                    elif not torch.equal(seen[h][1], rows[:, h - h0]):
                        out.append(f"layer {li} comp {ci} head {h}: rank {rc.rank} differs from rank {seen[h][0]}")
    return out


def import_cache(caches: Sequence[RankCache], block_ids: tuple[tuple[int, ...], ...], num_tokens: int,
                 config: PretrainedConfig) -> DynamicCache:
    """A `DynamicCache` for `config` holding the decode ranks' paged cache of `num_tokens` tokens.

    Sliding layers get all N positions (zeros before the window) so that their cumulative length
    is N, which is what transformers uses for positions and masks; the layer crops itself.
    """
    spec = caches[0].spec if caches else None
    cache = DynamicCache(config=config)
    if spec is not None and len(cache.layers) not in (0, spec.num_layers):
        raise ConfigError(f"config makes a cache of {len(cache.layers)} layers, the rank caches have {spec.num_layers}")
    for li, (k, v) in enumerate(gather_kv(caches, block_ids, num_tokens)):
        cache.update(k[None], v[None], li)
    for li, layer in enumerate(cache.layers):
        if layer.get_seq_length() != num_tokens:
            raise InvalidRequest(f"imported layer {li} reports {layer.get_seq_length()} tokens, expected {num_tokens}")
        if bool(getattr(layer, "is_sliding", False)) != (spec.layers[li].kind == "sliding"):
            raise ConfigError(f"layer {li}: config builds {type(layer).__name__}, spec says {spec.layers[li].kind!r}")
    if cache.get_seq_length() != num_tokens:
        raise InvalidRequest(f"imported cache reports {cache.get_seq_length()} tokens, expected {num_tokens}")
    return cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same bytes, so that equality is bitwise (NaN == NaN, -0.0 != 0.0)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def cache_differences(a: DynamicCache, b: DynamicCache) -> list[str]:
    """Layers where two caches differ in length, shape or any bit of keys or values."""
    if len(a.layers) != len(b.layers):
        return [f"layer count {len(a.layers)} != {len(b.layers)}"]
    out = []
    for li, (x, y) in enumerate(zip(a.layers, b.layers)):
        if _cached_length(x) != _cached_length(y):
            out.append(f"layer {li}: length {_cached_length(x)} != {_cached_length(y)}")
            continue
        for name in ("keys", "values"):
            s, t = getattr(x, name), getattr(y, name)
            if s.shape != t.shape or s.dtype != t.dtype:
                out.append(f"layer {li} {name}: {tuple(s.shape)} {s.dtype} != {tuple(t.shape)} {t.dtype}")
            elif not torch.equal(_bits(s), _bits(t)):
                n = int((_bits(s) != _bits(t)).sum())
                out.append(f"layer {li} {name}: {n} of {s.numel()} elements differ")
    return out


def save_cache(cache: DynamicCache, path: str | Path) -> None:
    """safetensors file with `layers.{i}.keys` / `layers.{i}.values`, each `[1, H, tokens_held, D]`."""
    from safetensors.torch import save_file

    tensors = {}
    for li, layer in enumerate(cache.layers):
        tensors[f"layers.{li}.keys"] = layer.keys.detach().contiguous().cpu()
        tensors[f"layers.{li}.values"] = layer.values.detach().contiguous().cpu()
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

    @property
    def ok(self) -> bool:
        return self.match and self.cache_equal and self.replicas_equal

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def summary(self) -> str:
        verdict = "OK" if self.ok else "MISMATCH"
        return (f"{verdict}: {self.model} prefill [{self.prefill}] -> decode [{self.decode}], {self.prompt_len} prompt "
                f"tokens, {self.new_tokens} new; tokens {'match' if self.match else 'differ'}, cache "
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


def _greedy_config() -> GenerationConfig:
    """Plain greedy decoding: no EOS stop, no penalties or processors from a checkpoint's defaults."""
    return GenerationConfig(do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=None, bos_token_id=None)


@torch.inference_mode()
def run_demo(model_name_or_dir: str = DEFAULT_MODEL, prompt: Sequence[int] | int | None = None, new_tokens: int = 8,
             seed: int = 0, prefill: EngineLayout | None = None, decode: EngineLayout | None = None,
             dump_decode_cache: str | Path | None = None, *, prompt_ids: Sequence[int] | None = None,
             prompt_len: int | None = None) -> DemoResult:
    """Prefill on one engine layout, move the cache to another, decode there, compare with `generate`.

    The prompt is `prompt` (ids, or a length for random ids) or, by keyword, `prompt_ids`, else
    `prompt_len` random ids (default 32). Both block tables are random distinct ids (seeded) and
    both engines' memory starts as random bytes, so a copy that lands in the wrong place or
    misses a row shows up as a different cache.
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
    vocab = int(config.get_text_config().vocab_size)
    ids = make_prompt_ids(prompt, vocab, seed)
    n = len(ids)
    prefill = prefill or default_layout(n)
    decode = decode or default_layout(n)
    _check_capacity(prefill, n, "prefill")
    _check_capacity(decode, n, "decode")
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
    request = random_request(spec, prefill, decode, n, 0, random.Random(seed))
    export_cache(prefill_cache, spec, src, request.src_block_ids, n)
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
        cache_differences=differences + replicas, warnings=list(plan.stats.warnings))


__all__ = [
    "BUILTIN_MODELS", "DEFAULT_MODEL", "DemoResult", "cache_differences", "default_layout", "export_cache",
    "gather_kv", "import_cache", "load_model", "make_prompt_ids", "replica_mismatches", "run_demo", "save_cache",
    "spec_for",
]
