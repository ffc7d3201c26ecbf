"""Every causal-LM architecture of the installed transformers through the canonical pool.

`model_sweep` proves the direct move for the zoo; this proves the pool's path for it: a tiny random
model of each architecture prefills a prompt on one shape, stores its blocks (state checkpoints
included) in the TP-, PP- and block-independent pool, and an engine of another shape loads the
shared prefix and decodes (`offload_demo.run_offload_demo(canonical=True)`): the loaded cache must
equal a prefill's bit for bit and the tokens `generate`'s. Why a sweep of its own: an outside sweep
found the pool's demo path handling models the direct proof handled (their own cache classes,
positions, state outside a Cache, PP stages without stateful layers) wrong. `make pool-zoo` runs it;
`tests/offload/test_offload_demo.py` runs a bounded sample.
"""

from __future__ import annotations

import tempfile
from typing import Any

from kvbridge.core.layout import EngineLayout
from kvbridge.errors import IncompatibleEngines, InvalidRequest, ShardingError
from kvbridge.offload.errors import NotCanonicalizable
from kvbridge.models.untrusted import safe_text
from kvbridge.proofs.model_sweep import (NEW_TOKENS, PROMPT_LEN, SweepRow, layer_kinds, one_line, pre_check, row_outcome,
                                         tiny_config)

# Store on one shape, load on another: TP and PP and block size all change. The first pair whose
# TP sizes split the model's units is used: later ones for kinds that do not split over 3 ranks
# (one KV head, MQA), blocks of 8 and 16 for layers keeping one row per 8 tokens (DeepSeek-V4).
# `pool`: the pool's block.
POOL_PAIRS: tuple[tuple[str, dict[str, int]], ...] = (
    ("TP3/b4 -> TP2xPP2/b8", dict(store_tp=3, store_pp=1, block_size=4, load_tp=2, load_pp=2, load_block_size=8,
                                  pool=8)),
    ("TP2xPP2/b4 -> TP4/b8", dict(store_tp=2, store_pp=2, block_size=4, load_tp=4, load_pp=1, load_block_size=8,
                                  pool=8)),
    ("PP2/b4 -> TP1/b8", dict(store_tp=1, store_pp=2, block_size=4, load_tp=1, load_pp=1, load_block_size=8, pool=8)),
    ("TP1/b8 -> TP2/b16", dict(store_tp=1, store_pp=1, block_size=8, load_tp=2, load_pp=1, load_block_size=16,
                               pool=16)),
)
TRANSFORMERS_LIMITS = {
    "moshi": "transformers' Moshi prefills under a plain causal mask but caches an 8-token window, so no cached "
             "continuation equals its own full forward (the loaded cache is bit-exact)",
}
"""Architectures whose tokens transformers itself cannot continue from any cache: their rows say so
when the moved cache is bit-exact and the tokens differ."""


def _legal(spec: Any, kw: dict[str, int]) -> bool:
    try:
        pre_check(spec, EngineLayout(tp_size=kw["store_tp"], pp_size=kw["store_pp"], block_size=kw["block_size"],
                                     num_blocks=8),
                  EngineLayout(tp_size=kw["load_tp"], pp_size=kw["load_pp"], block_size=kw["load_block_size"],
                               num_blocks=8))
    except (IncompatibleEngines, ShardingError, ValueError):
        return False
    return True


def pool_sweep_one(arch: str, seed: int = 0, timeout: int = 240) -> SweepRow:
    """One architecture through the canonical pool on the first pair its units split over."""
    from kvbridge.models import spec_from_hf_config
    from kvbridge.proofs.offload_demo import run_offload_demo

    row = SweepRow(arch, "error")
    with row_outcome(row, timeout, "transformers cannot build or run it from its config class: {}"):
        config = tiny_config(arch)
        spec = spec_from_hf_config(config.to_dict(), view="transformers", dtype="float32", warn=False)
        row.kinds = layer_kinds(spec)
        pair = next(((name, kw) for name, kw in POOL_PAIRS if _legal(spec, kw)), None)
        if pair is None:
            row.status, row.detail = "refused", "no pair's TP sizes split its units"
            return row
        name, kw = pair
        with tempfile.TemporaryDirectory(prefix=f"kvbridge-pool-{arch}-") as d:
            config.save_pretrained(d)
            try:
                shapes = {k: v for k, v in kw.items() if k != "pool"}
                r = run_offload_demo(d, seed=seed, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, canonical=True,
                                     block_size_factor=kw["pool"] // kw["block_size"], **shapes)
            except (InvalidRequest, NotCanonicalizable) as e:
                row.status, row.detail = "refused", one_line(e)
                return row
        row.pairs = [name]
        if r.ok and r.hit_tokens == r.prefix_len:
            row.status = "moved"
        elif r.cache_equal and r.hit_tokens == r.prefix_len and arch in TRANSFORMERS_LIMITS:
            row.status, row.detail = "transformers", TRANSFORMERS_LIMITS[arch]
        else:
            row.status = "mismatch"
            row.detail = (f"{name}: {r.hit_tokens}/{r.prefix_len} tokens hit, cache "
                          f"{'bit-exact' if r.cache_equal else 'differs'}, tokens "
                          f"{'match' if r.tokens_offload == r.tokens_reference else 'differ'}; "
                          + safe_text("; ".join(str(x) for x in r.differences[:2]), 300))
    return row


__all__ = ["POOL_PAIRS", "TRANSFORMERS_LIMITS", "pool_sweep_one"]
