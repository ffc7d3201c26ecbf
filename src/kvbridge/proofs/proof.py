"""The proof every demo makes: a model that decodes from the moved cache does what it would have done.

However the cache got to the decode ranks (planned and copied in one process, sent between rank
processes over a transport, stored to a CPU pool and loaded back), the proof is the same four
steps, and `prove_cache` is the one place they are written:

1. reference: plain greedy `generate` on the prompt, and the cache a monolithic forward leaves;
2. import: rebuild a transformers `DynamicCache` from the decode ranks' paged caches;
3. compare: bit for bit with the reference cache, and every replicated head (or state unit)
   across the ranks that hold it;
4. continue: greedy decoding from the imported cache; the tokens must equal the reference.
"""

from __future__ import annotations

import copy
import inspect

from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from kvbridge.core.spec import normalize_dtype
from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.models.own_state import moved_outside_cache
from kvbridge.proofs.cache_compare import cache_differences, restore_position_history, save_cache
from kvbridge.proofs.hf_cache import BlockIds, import_cache, replica_mismatches
from kvbridge.proofs.module_state import empty_cache, keeps_state_on_modules, read_module_state, write_module_state
from kvbridge.proofs.own_cache import model_cache, standard_cache
from kvbridge.transport.cache import RankCache


class CacheProof(msgspec.Struct, frozen=True):
    """What `prove_cache` found for one request (the field names are the decode job's reply keys)."""

    tokens_reference: list[int]
    tokens_disaggregated: list[int]
    cache_differences: list[str]
    replica_mismatches: list[str]

    @property
    def match(self) -> bool:
        return self.tokens_disaggregated == self.tokens_reference

    @property
    def cache_equal(self) -> bool:
        return not self.cache_differences

    @property
    def replicas_equal(self) -> bool:
        return not self.replica_mismatches


def greedy_config() -> GenerationConfig:
    """Plain greedy decoding: no EOS stop, no penalties or processors from a checkpoint's defaults."""
    return GenerationConfig(do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=None, bos_token_id=None)


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


def _input(ids: Sequence[int], model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-1 ids and mask on the model's device."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    return input_ids, torch.ones_like(input_ids)


@torch.inference_mode()
def reference_tokens(model: PreTrainedModel, prompt_ids: Sequence[int], new_tokens: int) -> list[int]:
    """Monolithic greedy `generate`: the tokens every disaggregated path must reproduce."""
    input_ids, mask = _input(prompt_ids, model)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens)[0, len(prompt_ids):].tolist()
    if len(out) != new_tokens:
        raise InvalidRequest(f"reference generate stopped after {len(out)} of {new_tokens} tokens")
    return out


@torch.inference_mode()
def prefill(model: PreTrainedModel, prompt_ids: Sequence[int]) -> tuple[DynamicCache, int]:
    """One forward over the prompt, as a prefill engine runs it: its cache and the greedy first token."""
    input_ids, mask = _input(prompt_ids, model)
    extra = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        # the positions `generate` passes; models such as RoBERTa's decoders default to others
        extra["position_ids"] = mask.long().cumsum(-1) - 1
    if keeps_state_on_modules(model):  # RecurrentGemma: given a cache, its attention layers keep their K/V there
        cache = empty_cache(model.config)
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = model(input_ids, attention_mask=mask, use_cache=True, **{name: cache}, **extra)
        return read_module_state(model, cache), int(out.logits[0, -1].argmax())
    out = model(input_ids, attention_mask=mask, use_cache=True, **extra)
    return standard_cache(_self_attention_cache(out, model), model.config), int(out.logits[0, -1].argmax())


def _self_attention_cache(out: object, model: PreTrainedModel) -> DynamicCache:
    """The cache a forward returned: the decoder's self-attention cache of an encoder-decoder cache
    (BERT-style models run as decoders); one line naming the model when it returns none."""
    cache = getattr(out, "past_key_values", None)
    if cache is None:  # Mamba-style models name it cache_params
        cache = getattr(out, "cache_params", None)
    if cache is None and moved_outside_cache(model.config):  # RWKV: a state list, xLSTM: its own object (own_cache)
        return next((c for c in (getattr(out, n, None) for n in ("state", "cache")) if c is not None), None)
    other = next((name for name in ("past_buckets_states", "mems") if getattr(out, name, None) is not None), None)
    if cache is None and other:  # Reformer's LSH buckets, XLNet's memories: no per-layer K/V
        raise ConfigError(f"layer 0: {type(model).__name__} keeps its cache as {other}, not per-layer K/V "
                          "(transformers exposes no KV cache for it), so there is nothing to move")
    if cache is None:
        raise ConfigError(f"layer 0: {type(model).__name__} returns no KV cache (no past_key_values): transformers "
                          f"exposes none for it, so there is nothing to move")
    return getattr(cache, "self_attention_cache", cache)


@torch.inference_mode()
def continue_greedy(model: PreTrainedModel, prompt_ids: Sequence[int], cache: DynamicCache, num_cached: int,
                    new_tokens: int, first_token: int | None = None) -> list[int]:
    """Greedy tokens after the prompt, decoded from `cache`, which holds the first `num_cached` prompt tokens.

    A cache of the whole prompt continues from `first_token`, the token the prefill engine sampled
    (without it there is nothing to continue from: no tokens, which fails the proof). A cache of a
    strict prefix (a prefix-cache hit) lets `generate` compute the rest of the prompt first.
    """
    n = len(prompt_ids)
    kwarg = _cache_kwarg(model, cache, num_cached)
    # `generate` drops the cached tokens from the input by the cache's length; a cache of recurrent
    # layers only (Mamba: transformers asks `all(cache.is_linear)`) and a state kept outside any Cache
    # (RWKV's list, xLSTM's object) have none, and generate would run the whole prompt through the
    # state again, so the model is given the tokens after the cached ones only
    linear = getattr(cache, "is_linear", None)
    skip = num_cached if moved_outside_cache(model.config) or (linear and all(linear)) else 0
    if num_cached < n:
        if first_token is not None:
            raise InvalidRequest(f"a first token follows the whole prompt, the cache holds {num_cached} of {n}")
        # RecurrentGemma runs a multi-token forward as a prefill from position 0's conv inputs (its
        # state lives on its modules, so it is not probed: a probe would move it on)
        if keeps_state_on_modules(model) or not _continues_in_chunks(model, prompt_ids, num_cached, kwarg):
            # Then the rest of the prompt goes in one token at a time (decode steps, which read the
            # state): a check of a loaded state must not pass whatever the state held.
            kwarg = _step_through(model, prompt_ids, num_cached, n - 1, kwarg)
            num_cached, skip = n - 1, (n - 1 if skip else 0)
        input_ids, mask = _input(prompt_ids[skip:], model)
        return model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                              **kwarg)[0, n - skip:].tolist()
    if first_token is None:
        return []
    tokens = [int(first_token)]
    if new_tokens > 1:
        input_ids, mask = _input([*prompt_ids, int(first_token)][skip:], model)
        rest = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens - 1, **kwarg)
        tokens += rest[0, n + 1 - skip:].tolist()
    return tokens


def _step_through(model: PreTrainedModel, prompt_ids: Sequence[int], start: int, stop: int,
                  kwarg: dict[str, object]) -> dict[str, object]:
    """Tokens `start..stop-1` of the prompt as one-token decode steps from the cache in `kwarg`:
    each at its own position (the ones `generate` and `prefill` give: a model whose positions
    default otherwise, such as RoBERTa's decoders, would read the wrong ones) and each from the
    cache the previous step returned (not only the one given: a model may return a new object).
    The cache argument for what follows."""
    (name, cache), = kwarg.items()
    positions = "position_ids" in inspect.signature(model.forward).parameters
    for pos in range(start, stop):
        extra = {"position_ids": torch.tensor([[pos]], device=model.device)} if positions else {}
        out = model(torch.tensor([[int(prompt_ids[pos])]], device=model.device), use_cache=True, **{name: cache},
                    **extra)
        names = (name, "past_key_values" if name == "cache" else "cache") if name in ("cache", "past_key_values") \
            else (name,)  # transformers 5 renames past_key_values to cache, output and argument alike
        returned = next((c for c in (getattr(out, n, None) for n in names) if c is not None), None)
        cache = cache if returned is None else returned
    return {name: cache}


def _continues_in_chunks(model: PreTrainedModel, prompt_ids: Sequence[int], num_cached: int,
                         kwarg: dict[str, object]) -> bool:
    """Whether a forward of several tokens continues from the cache: it runs, and its first logits
    equal a one-token step's, from copies of the cache. Measured, not named: transformers' Mamba1
    mixers (Mamba, Falcon-Mamba, Jamba) read their state only for one-token inputs, and ProphetNet
    takes no longer input with a cache at all."""
    nxt = [int(t) for t in prompt_ids[num_cached:num_cached + 2]]
    if len(nxt) < 2:
        return True
    refusals = (AssertionError, ValueError, RuntimeError, IndexError)  # a model's own refusal of an input
    try:
        one = model(torch.tensor([nxt[:1]], device=model.device), use_cache=True, **copy.deepcopy(kwarg)).logits[0, -1]
    except refusals:  # no one-token step to compare with (CPM-Ant wants the whole input): `generate` decides
        return True
    try:
        two = model(torch.tensor([nxt], device=model.device), use_cache=True, **copy.deepcopy(kwarg)).logits[0, 0]
    except refusals:
        return False
    return bool(torch.allclose(one, two, rtol=1e-3, atol=1e-3))


def _cache_kwarg(model: PreTrainedModel, cache: DynamicCache, num_cached: int) -> dict[str, DynamicCache]:
    """`past_key_values=cache`, or `cache_params=cache` / `state=cache` / `cache=cache` for models whose
    forward names it so (Mamba / RWKV / xLSTM); in the model's own cache class (MiniMax), state list
    (RWKV) or state object (xLSTM) when it demands one; a stateful model's recurrent state goes onto
    its modules (RecurrentGemma)."""
    if keeps_state_on_modules(model):
        write_module_state(model, cache)
    params = inspect.signature(model.forward).parameters
    name = next((n for n in ("cache_params", "state", "cache") if n in params and "past_key_values" not in params),
                "past_key_values")
    return {name: model_cache(cache, model, num_cached)}


@torch.inference_mode()
def prove_cache(model: PreTrainedModel, prompt_ids: Sequence[int], caches: Sequence[RankCache], block_ids: BlockIds,
                new_tokens: int, *, num_cached: int | None = None, reference_cache: DynamicCache | None = None,
                first_token: int | None = None, dump: str | Path | None = None) -> CacheProof:
    """Prove the decode ranks' cache of one request (the module docstring's four steps).

    `caches` are the decode engine's ranks in rank order and `block_ids` the request's block ids per
    KV-cache group; they hold the first `num_cached` prompt tokens (default: all). `reference_cache`
    is the cache to compare with (default: a monolithic forward over those tokens); `first_token`
    is the prefill engine's sampled token when the cache holds the whole prompt. `dump` writes the
    imported cache as safetensors. The model should decode greedily (`greedy_config`).
    """
    n = len(prompt_ids)
    num_cached = n if num_cached is None else num_cached
    if not 0 < num_cached <= n:
        raise InvalidRequest(f"the cache must hold 1 to {n} prompt tokens, got {num_cached}")
    tokens_reference = reference_tokens(model, prompt_ids, new_tokens)
    if reference_cache is None:
        reference_cache, _ = prefill(model, prompt_ids[:num_cached])
    dtype = normalize_dtype(str(next(model.parameters()).dtype))
    imported = import_cache(caches, block_ids, num_cached, model.config, model_dtype=dtype)
    restore_position_history(imported, reference_cache, num_cached)  # derived from the prompt, as an engine does
    differences = cache_differences(reference_cache, imported)
    replicas = replica_mismatches(caches, block_ids, num_cached)
    if dump is not None:
        save_cache(imported, dump)
    tokens = continue_greedy(model, prompt_ids, imported, num_cached, new_tokens, first_token)
    return CacheProof(tokens_reference, tokens, differences, replicas)


__all__ = ["CacheProof", "continue_greedy", "greedy_config", "make_prompt_ids", "prefill", "prove_cache",
           "reference_tokens"]
