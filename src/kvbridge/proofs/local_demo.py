"""The local demo: prefill on one engine layout, move the cache to another in one process, prove it.

The planner and the local executor move a real `transformers` model's paged KV cache from a
TP=P engine layout to a TP=D one; `proof.prove_cache` then rebuilds a `DynamicCache` from the
destination ranks, compares it bit for bit with the prefill cache and continues greedy
decoding, whose tokens must equal plain `generate`.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvbridge.core.blocks import compute_physical_blocks_per_logical
from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import plan_request
from kvbridge.core.spec import ModelSpec
from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.models.untrusted import error_line
from kvbridge.proofs.hf_cache import BlockIds, export_cache, export_states, export_tokens
from kvbridge.proofs.kv_dtype import conversion_mismatches, describe_conversion, is_lossy
from kvbridge.proofs.proof import greedy_config, make_prompt_ids, prefill as run_prefill, prove_cache
from kvbridge.proofs.results import DisaggregationResult
from kvbridge.proofs.tiny_models import DEFAULT_MODEL, load_model, spec_for
from kvbridge.proofs.verify import random_bytes, random_request
from kvbridge.transport.cache import RankCache
from kvbridge.transport.local import LocalExecutor


@dataclass
class DemoResult(DisaggregationResult):
    """Outcome of one local disaggregated run against the plain `generate` reference
    (`transfer_seconds`: the steady-state copy, the second execution of the same plan)."""

    num_cached_tokens: int = 0  # prefix the decode engine already held (not moved)
    kv_conversion: str = ""  # e.g. "float32 -> float8_e4m3fn" when either side stores K/V lossily
    conversion_mismatches: list[str] = field(default_factory=list)
    elements_checked: int = 0  # decode elements compared with the reference conversion

    @property
    def ok(self) -> bool:
        """Bit-exact pairs: tokens and cache. Lossy (fp8) pairs: every element is the reference
        conversion of its source; the tokens are reported, not required (quantization changes them)."""
        if self.kv_conversion:
            return not self.conversion_mismatches and self.replicas_equal and self.elements_checked > 0
        return super().ok

    def verdicts(self) -> str:
        if not self.kv_conversion:
            return super().verdicts()
        return (f"KV dtype {self.kv_conversion}: {self.elements_checked:,} elements "
                f"{'all the reference conversion' if not self.conversion_mismatches else 'NOT all converted right'}; "
                f"tokens {'match' if self.match else 'differ'} (not required: lossy by nature)")

    def describe(self) -> str:
        hit = f" ({self.num_cached_tokens} cached on decode)" if self.num_cached_tokens else ""
        return (f"{self.model} prefill [{self.prefill}] -> decode [{self.decode}], {self.prompt_len} prompt "
                f"tokens{hit}, {self.new_tokens} new; {self.verdicts()}; {self.bytes_moved} B in {self.num_runs} runs "
                f"(plan {self.plan_seconds * 1e3:.2f} ms, copy {self.transfer_seconds * 1e3:.2f} ms)")


def check_capacity(layout: EngineLayout, num_tokens: int, side: str) -> None:
    """One clear error before any work when a layout cannot hold the prompt."""
    need = max(layout.block_ids_needed(g, num_tokens) for g in range(max(1, len(layout.group_block_sizes))))
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
    if not spec.has_recurrent or not any(x.is_attention for x in spec.layers):
        return kernel_block_size
    a = EngineLayout(tp_size=tp_size, block_size=kernel_block_size, num_blocks=1).addressing(spec, 0)

    def rank_bytes(li: int) -> int:
        return sum(int(a.heads[li, ci] * a.row_bytes[li, ci]) for ci in range(len(spec.layers[li].components)))

    state = max(rank_bytes(li) for li, x in enumerate(spec.layers) if x.is_recurrent)
    page = max(rank_bytes(li) for li, x in enumerate(spec.layers) if x.is_attention) * kernel_block_size
    return compute_physical_blocks_per_logical((state,), page) * kernel_block_size


def _check_generates_without_attention(model: PreTrainedModel, name: str) -> None:
    """A model whose every layer is recurrent: some transformers models continue generating it
    (Mamba, Mamba2), others keep a cache whose length only an attention layer knows
    (`Cache.get_seq_length` raises), so their own `generate` fails. Two greedy tokens from a
    two-token prompt tell which, before any real work."""
    probe = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            model.generate(probe, max_new_tokens=2, do_sample=False)
    except ValueError as e:
        if "get_seq_length" not in str(e):
            raise
        raise ConfigError(
            f"{name}: every layer is recurrent and {type(model).__name__} keeps a cache whose length only an "
            "attention layer knows, so transformers' own generate cannot continue it (Cache.get_seq_length)") from None


@torch.inference_mode()
def _check_runs(model: PreTrainedModel, ids: Sequence[int]) -> None:
    """transformers' own forward over the prompt, with no cache and nothing of kvbridge's: a config
    that transformers accepts but cannot run (sizes its modules disagree on) fails here, in one line."""
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    try:
        model(torch.tensor([list(ids)], device=next(model.parameters()).device), **no_cache)
    except Exception as e:  # noqa: BLE001 - transformers' failure on its own model: its reason, on one line
        raise ConfigError(f"transformers cannot run {type(model).__name__} on this config (a forward over the "
                          f"prompt fails, before kvbridge does anything): {error_line(e)}") from None


@torch.inference_mode()
def run_demo(model_name_or_dir: str = DEFAULT_MODEL, prompt: Sequence[int] | int | None = None, new_tokens: int = 8,
             seed: int = 0, prefill: EngineLayout | None = None, decode: EngineLayout | None = None,
             dump_decode_cache: str | Path | None = None, *, prompt_ids: Sequence[int] | None = None,
             prompt_len: int | None = None, num_cached_tokens: int = 0, device: str = "cpu") -> DemoResult:
    """Prefill on one engine layout, move the cache to another, decode there, compare with `generate`.

    The prompt is `prompt` (ids, or a length for random ids) or, by keyword, `prompt_ids`, else
    `prompt_len` random ids (default 32). Both block tables are random distinct ids (seeded) and
    both engines' memory starts as random bytes, so a copy that lands in the wrong place or
    misses a row shows up as a different cache.

    `num_cached_tokens` (any count below the prompt length: the planner works per token, so a hit
    may end inside a block) is a prefix-cache hit on the decode engine: before the move, the decode
    ranks are given that prefix as a serving engine would hold it (the attention K/V of those
    positions, and for a hybrid model the recurrent state after the prefix in the slot of the
    prefix's last block), and only the rest is moved: attention positions from `num_cached_tokens`
    on and the recurrent state after the whole prompt, into the request's slot.

    `device`: where the model and both engines' caches live (e.g. "cuda"; the executor then copies
    with torch on that device).
    """
    if prompt is not None and prompt_ids is not None:
        raise InvalidRequest("give the prompt once: positional `prompt` or `prompt_ids`, not both")
    if prompt is None:
        prompt = prompt_ids if prompt_ids is not None else (32 if prompt_len is None else prompt_len)
    if new_tokens < 1:
        raise InvalidRequest(f"new_tokens must be >= 1, got {new_tokens}")
    model, config = load_model(model_name_or_dir, seed)
    model.to(device)
    model.generation_config = greedy_config()
    spec = spec_for(config, next(model.parameters()).dtype)
    if not any(x.is_attention for x in spec.layers):
        _check_generates_without_attention(model, model_name_or_dir)
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    ids = make_prompt_ids(prompt, vocab, seed)
    n = len(ids)
    prefill = prefill or default_layout(n)
    decode = decode or default_layout(n)
    check_capacity(prefill, n, "prefill")
    check_capacity(decode, n, "decode")
    if not 0 <= num_cached_tokens < n:  # the planner's rule: any token count, one token left to move
        raise InvalidRequest(f"num_cached_tokens {num_cached_tokens} must be in [0, {n}): the prompt's first tokens, "
                             f"leaving at least one to move")

    _check_runs(model, ids)
    prefill_cache, first = run_prefill(model, ids)
    src = RankCache.allocate_engine(spec, prefill, device=device, fill=None)
    dst = RankCache.allocate_engine(spec, decode, device=device, fill=None)
    random_bytes(src, seed + 1)
    random_bytes(dst, seed + 2)
    # Sliding-window lists are clipped to the window at random, as vLLM sends them.
    request = random_request(spec, prefill, decode, n, num_cached_tokens, random.Random(seed), clip_windows=True)
    export_cache(prefill_cache, spec, src, request.src_block_ids, n)
    if num_cached_tokens:
        _hold_prefix(model, ids, prefill_cache, spec, dst, request.dst_block_ids, n, num_cached_tokens)
    plan = plan_request(spec, prefill, decode, request)
    executor = LocalExecutor(src, dst)
    executor.execute(plan)
    # The first execution of a process may include the numba JIT compile (~0.5 s); copying the
    # same runs again is idempotent, and its time is the one worth reporting.
    transfer_seconds = executor.execute(plan)
    proof = prove_cache(model, ids, dst, request.dst_block_ids, new_tokens, reference_cache=prefill_cache,
                        first_token=first, dump=dump_decode_cache)
    lossy = is_lossy(spec, prefill, decode)
    mismatches, checked = conversion_mismatches(spec, src, dst, request) if lossy else ([], 0)

    return DemoResult(
        model=str(model_name_or_dir), spec=spec.describe(), prefill=prefill.describe(), decode=decode.describe(),
        prompt_len=n, new_tokens=new_tokens, tokens_reference=proof.tokens_reference,
        tokens_disaggregated=proof.tokens_disaggregated, match=proof.match, cache_equal=proof.cache_equal,
        replicas_equal=proof.replicas_equal, bytes_moved=plan.nbytes, num_runs=len(plan),
        transfer_seconds=transfer_seconds, plan_seconds=plan.stats.plan_seconds,
        cache_differences=proof.cache_differences + proof.replica_mismatches, warnings=list(plan.stats.warnings),
        num_cached_tokens=num_cached_tokens, kv_conversion=describe_conversion(spec, prefill, decode) if lossy else "",
        conversion_mismatches=mismatches, elements_checked=checked)


def _hold_prefix(model: PreTrainedModel, prompt_ids: Sequence[int], prefill_cache: DynamicCache, spec: ModelSpec,
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
        prefix_cache, _ = run_prefill(model, prompt_ids[:cached])
        blocks = -(-cached // dst[0].layout.block_size)
        export_states(prefix_cache, spec, dst, tuple(group[:blocks] for group in dst_block_ids))


__all__ = ["DemoResult", "check_capacity", "default_layout", "run_demo", "vllm_block_size"]
