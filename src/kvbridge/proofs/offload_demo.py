"""The offload proof on a real `transformers` model: a prefix that went to CPU and back decodes the same.

1. Prompt A is prefilled on a *store engine* in two chunks (prefix, rest), as chunked prefill
   does; after each chunk the newly full offloaded blocks of every KV-cache group are stored to
   a CPU pool under their (block hash, group) keys. A sliding-window group only stores the blocks
   its window still holds, so its stores start at a null-padded position (a skip).
2. A's device blocks are then released and overwritten (evicted from the device pool).
3. Request B shares A's first `prefix_len` tokens and continues differently. On a *load engine*
   (the same one, or with `canonical=True` one with another TP size and block size) the
   scheduler looks B's keys up (prefix rule for full attention, window rule for sliding groups),
   loads the hit blocks from CPU into freshly allocated device blocks, rebuilds a `DynamicCache`
   from them and decodes.
The tokens must equal plain `generate(B)`, and the loaded prefix cache must be bit-identical to
the one that was stored.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from transformers import DynamicCache

from kvbridge.errors import InvalidRequest
from kvbridge.proofs.hf_cache import export_cache
from kvbridge.proofs.proof import CacheProof, greedy_config, prove_cache, reference_tokens
from kvbridge.proofs.results import ProofResult
from kvbridge.proofs.tiny_models import load_model, spec_for
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.offload.keys import chained_block_hashes, group_keys
from kvbridge.offload.lookup import request_hits
from kvbridge.offload.manager import OffloadingManager
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.scheduling import NULL, load_job, storable_keys, store_job
from kvbridge.offload.spec import cdiv
from kvbridge.offload.worker import OffloadWorker
from kvbridge.core.spec import ModelSpec
from kvbridge.proofs.verify import random_bytes


@dataclass
class OffloadDemoResult(ProofResult):
    """Outcome of one store-evict-load round trip against the plain `generate` reference."""

    store_engine: str
    load_engine: str
    pool: str
    prompt_len: int
    prefix_len: int
    new_tokens: int
    hit_tokens: int
    tokens_reference: list[int]
    tokens_offload: list[int]
    match: bool
    cache_equal: bool
    replicas_equal: bool
    stored_blocks: int
    loaded_blocks: int
    bytes_stored: int
    bytes_loaded: int
    store_seconds: float
    load_seconds: float
    events: dict[str, int]
    differences: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.match and self.cache_equal and self.replicas_equal and self.hit_tokens == self.prefix_len

    def describe(self) -> str:
        return (f"{self.model}, store [{self.store_engine}] -> {self.pool} -> load [{self.load_engine}]; "
                f"{self.hit_tokens}/{self.prefix_len} prefix tokens hit, {self.stored_blocks} blocks stored "
                f"({self.bytes_stored} B), {self.loaded_blocks} loaded ({self.bytes_loaded} B); tokens "
                f"{'match' if self.match else 'differ'}, prefix cache {'bit-exact' if self.cache_equal else 'differs'}")


class _Engine:
    """A device engine in miniature: rank caches, a block free list, one offload worker."""

    def __init__(self, spec: ModelSpec, layout: EngineLayout, pool: CPUPool, seed: int):
        self.spec, self.layout, self.seed = spec, layout, seed
        self.caches = RankCache.allocate_engine(spec, layout, fill=None)
        random_bytes(self.caches, seed)
        self.free = list(np.random.default_rng(seed).permutation(layout.num_blocks).tolist())
        self.worker = OffloadWorker(self.caches, pool)
        self.factor = self.worker.block_size_factor

    def allocate(self) -> int:
        if not self.free:
            raise InvalidRequest(f"device pool of {self.layout.num_blocks} blocks is exhausted")
        return self.free.pop()

    def grow(self, tables: list[list[int]], num_tokens: int) -> None:
        """Give every group the blocks `num_tokens` tokens need; free what slid out of a window."""
        for g, table in enumerate(tables):
            first = self.spec.group_layer(g).tokens_kept(num_tokens)
            need = cdiv(num_tokens, self.layout.block_size)
            while len(table) < need:
                table.append(NULL)
            for b in range(need):
                live = (b + 1) * self.layout.block_size > first
                if live and table[b] == NULL:
                    table[b] = self.allocate()
                elif not live and table[b] != NULL:
                    self.free.append(table[b])
                    table[b] = NULL

    def evict(self, tables: list[list[int]], seed: int) -> int:
        """Release a request's blocks and scribble over them, as reuse by other requests would."""
        gen = torch.Generator().manual_seed(seed)
        released = 0
        for g, table in enumerate(tables):
            ids = [b for b in table if b != NULL]
            for rc in self.caches:
                for li in self.spec.groups[g]:
                    for ci in range(int(rc.addr.num_components[li])):
                        view = rc.logical_view(li, ci, as_int=True)
                        kb = self.layout.kernel_blocks_per_block
                        rows = torch.tensor([b * kb + k for b in ids for k in range(kb)], dtype=torch.long)
                        if len(rows):
                            view[rows] = torch.randint(-100, 100, view[rows].shape, generator=gen).to(view.dtype)
            self.free += ids
            released += len(ids)
            table[:] = [NULL] * len(table)
        return released


def _ids(tables: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t) for t in tables)


@torch.inference_mode()
def run_offload_demo(model: str = "tiny-gemma2", seed: int = 0, prompt_len: int = 40, prefix_len: int | None = None,
                     suffix_len: int = 8, new_tokens: int = 8, block_size: int = 4, block_size_factor: int = 2,
                     store_tp: int = 1, load_tp: int | None = None, load_block_size: int | None = None,
                     canonical: bool = False, policy: Literal["lru", "arc"] = "lru", num_cpu_blocks: int = 64,
                     after_store: Callable[[CPUPool], None] | None = None) -> OffloadDemoResult:
    """Prefill A, store it to CPU, evict it from the device, load B's shared prefix back, decode, compare.

    `canonical=True` stores in the TP-independent format and loads on an engine with
    `load_tp` / `load_block_size`; otherwise the pool mirrors the store engine, which also loads.
    `after_store` may inspect (or, in tests, corrupt) the pool between the two requests.
    """
    net, config = load_model(model, seed)
    net.generation_config = greedy_config()
    spec = spec_for(config, next(net.parameters()).dtype)
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    obs = block_size * block_size_factor  # tokens per offloaded block (the key granularity)
    prefix_len = prefix_len if prefix_len is not None else (prompt_len - 1) // obs * obs
    if prefix_len < obs or prefix_len % obs or prefix_len >= prompt_len:
        raise InvalidRequest(f"prefix_len must be a multiple of the {obs}-token offloaded block, at least one block "
                             f"and shorter than the {prompt_len}-token prompt; got {prefix_len}")
    if suffix_len < 1 or new_tokens < 1:
        raise InvalidRequest(f"suffix_len and new_tokens must be >= 1, got {suffix_len} and {new_tokens}")
    gen = torch.Generator().manual_seed(seed)
    prompt_a = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
    suffix = [(t + 1) % vocab for t in torch.randint(0, vocab, (suffix_len,), generator=gen).tolist()]
    if suffix[0] == prompt_a[prefix_len % prompt_len]:
        suffix[0] = (suffix[0] + 1) % vocab
    prompt_b = prompt_a[:prefix_len] + suffix
    windows = [spec.group_layer(g).window for g in range(len(spec.groups))]

    blocks_needed = 2 * cdiv(max(prompt_len, len(prompt_b)), min(block_size, load_block_size or block_size)) + 4
    store_layout = EngineLayout(tp_size=store_tp, block_size=block_size, num_blocks=blocks_needed)
    if canonical:
        pool = CPUPool.canonical(spec, obs, num_cpu_blocks, pin_memory=False, kernel_tokens=block_size)
        load_layout = EngineLayout(tp_size=load_tp or store_tp, block_size=load_block_size or block_size,
                                   num_blocks=blocks_needed)
    else:
        if (load_tp not in (None, store_tp)) or (load_block_size not in (None, block_size)):
            raise InvalidRequest("the mirror (vLLM) variant loads on the engine that stored; use canonical=True "
                                 f"to load on another shape (asked TP {store_tp} -> {load_tp}, block {block_size} -> "
                                 f"{load_block_size})")
        pool = CPUPool.mirror(spec, store_layout, block_size_factor, num_cpu_blocks, pin_memory=False)
        load_layout = store_layout
    manager = OffloadingManager(num_cpu_blocks, policy, block_size=obs)
    store_engine = _Engine(spec, store_layout, pool, seed + 1)
    load_engine = store_engine if load_layout == store_layout and not canonical else _Engine(
        spec, load_layout, pool, seed + 2)

    # --- request A: chunked prefill, storing newly full offloaded blocks after each chunk -------------
    keys_a = [group_keys(chained_block_hashes(prompt_a, obs), g) for g in range(len(spec.groups))]
    tables_a: list[list[int]] = [[] for _ in spec.groups]
    next_stored = [0] * len(spec.groups)
    cache = DynamicCache(config=config)
    stored_prefix: DynamicCache | None = None
    stored_blocks = bytes_stored = 0
    store_seconds = 0.0
    for start, stop in ((0, prefix_len), (prefix_len, prompt_len)):
        net(torch.tensor([prompt_a[start:stop]]), past_key_values=cache, use_cache=True)
        store_engine.grow(tables_a, stop)
        export_cache(cache, spec, store_engine.caches, _ids(tables_a), stop)
        if stop == prefix_len:
            stored_prefix = copy.deepcopy(cache)
        new = [k for g in range(len(spec.groups))
               for k in storable_keys(tables_a[g], keys_a[g], store_engine.factor, next_stored[g], stop // obs)]
        out = manager.prepare_store(new)
        if out is None:
            raise InvalidRequest(f"CPU pool of {num_cpu_blocks} blocks cannot take {len(new)} more; "
                                 f"raise num_cpu_blocks")
        manager.touch([k for ks in keys_a for k in ks[:stop // obs]])
        if out.keys_to_store:
            job = (store_job(tables_a, keys_a, out.keys_to_store, store_engine.factor), out.store_spec)
            job_id = store_engine.worker.submit(job)
            store_engine.worker.wait([job_id])
            (res,) = [r for r in store_engine.worker.get_finished() if r.job_id == job_id]
            manager.complete_store(out.keys_to_store, success=res.success)
            stored_blocks += len(out.keys_to_store)
            bytes_stored += res.bytes
            store_seconds += res.seconds
        next_stored = [stop // obs] * len(spec.groups)
    assert stored_prefix is not None
    store_engine.evict(tables_a, seed + 3)
    if after_store is not None:
        after_store(pool)

    # --- request B: look up the shared prefix, load it into new device blocks, decode -------------------
    keys_b = [group_keys(chained_block_hashes(prompt_b, obs), g) for g in range(len(spec.groups))]
    hit = request_hits(keys_b, windows, obs, len(prompt_b), manager.lookup_key) or 0
    manager.touch([k for ks in keys_b for k in ks])
    tables_b: list[list[int]] = [[] for _ in spec.groups]
    loaded_blocks = bytes_loaded = 0
    load_seconds = 0.0
    if hit:
        load_engine.grow(tables_b, hit)
        load_keys, gpu_spec = load_job(tables_b, keys_b, hit, load_layout.block_size, load_engine.factor)
        cpu_spec = manager.prepare_load(load_keys)
        job_id = load_engine.worker.submit((cpu_spec, gpu_spec))
        load_engine.worker.wait([job_id])
        (res,) = [r for r in load_engine.worker.get_finished() if r.job_id == job_id]
        manager.complete_load(load_keys)
        loaded_blocks, bytes_loaded, load_seconds = len(load_keys), res.bytes, res.seconds
        # A partial hit is compared with a forward over the tokens it holds.
        proof = prove_cache(net, prompt_b, load_engine.caches, _ids(tables_b), new_tokens, num_cached=hit,
                            reference_cache=stored_prefix if hit == prefix_len else None)
    else:
        proof = CacheProof(reference_tokens(net, prompt_b, new_tokens), [], [], [])
    events = manager.take_events()
    for engine in {id(store_engine): store_engine, id(load_engine): load_engine}.values():
        engine.worker.shutdown()
    return OffloadDemoResult(
        model=model, spec=spec.describe(), store_engine=store_layout.describe(), load_engine=load_layout.describe(),
        pool=pool.describe(), prompt_len=prompt_len, prefix_len=prefix_len, new_tokens=new_tokens, hit_tokens=hit,
        tokens_reference=proof.tokens_reference, tokens_offload=proof.tokens_disaggregated, match=proof.match,
        cache_equal=bool(hit) and proof.cache_equal, replicas_equal=proof.replicas_equal,
        stored_blocks=stored_blocks, loaded_blocks=loaded_blocks,
        bytes_stored=bytes_stored, bytes_loaded=bytes_loaded, store_seconds=store_seconds, load_seconds=load_seconds,
        events={"stored": sum(len(e.keys) for e in events if not e.removed),
                "removed": sum(len(e.keys) for e in events if e.removed)},
        differences=proof.cache_differences + proof.replica_mismatches)


__all__ = ["OffloadDemoResult", "run_offload_demo"]
