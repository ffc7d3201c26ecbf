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
the one that was stored. Where the load is refused (`OffloadBackend.load` answers None: a shared
pool's object missing or failing its seal), the engine does what a serving engine does with blocks
it could not load: it recomputes their tokens into them (`recomputed`), then decodes from its
blocks, and the tokens must still equal `generate(B)`; a miss prefills the whole prompt so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

import numpy as np
import torch
from transformers import DynamicCache

from kvbridge.errors import InvalidRequest
from kvbridge.proofs.hf_cache import export_cache
from kvbridge.proofs.proof import greedy_config, prefill, prove_cache
from kvbridge.proofs.results import ProofResult
from kvbridge.proofs.tiny_models import load_model, spec_for
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.offload.keys import OffloadKey, chained_block_hashes, group_keys
from kvbridge.offload.lookup import group_windows, request_hits
from kvbridge.offload.manager import OffloadingManager
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.scheduling import NULL, load_job, storable_keys, store_job
from kvbridge.offload.spec import cdiv
from kvbridge.offload.worker import OffloadWorker, TransferResult
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
    recomputed: bool = False
    differences: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.match and self.cache_equal and self.replicas_equal and self.hit_tokens == self.prefix_len

    def describe(self) -> str:
        cache = ("the load refused, its blocks recomputed" if self.recomputed else
                 f"prefix cache {'bit-exact' if self.cache_equal else 'differs'}")
        return (f"{self.model}, store [{self.store_engine}] -> {self.pool} -> load [{self.load_engine}]; "
                f"{self.hit_tokens}/{self.prefix_len} prefix tokens hit, {self.stored_blocks} blocks stored "
                f"({self.bytes_stored} B), {self.loaded_blocks} loaded ({self.bytes_loaded} B); tokens "
                f"{'match' if self.match else 'differ'}, {cache}")


class DeviceEngine:
    """A device engine in miniature: rank caches and a block free list."""

    def __init__(self, spec: ModelSpec, layout: EngineLayout, seed: int):
        self.spec, self.layout, self.seed = spec, layout, seed
        self.caches = RankCache.allocate_engine(spec, layout, fill=None)
        random_bytes(self.caches, seed)
        self.free = list(np.random.default_rng(seed).permutation(layout.num_blocks).tolist())
        self._state_tokens: dict[int, int] = {}  # per recurrent table: the tokens its last block's state has seen

    def allocate(self) -> int:
        if not self.free:
            raise InvalidRequest(f"device pool of {self.layout.num_blocks} blocks is exhausted")
        return self.free.pop()

    def grow(self, tables: list[list[int]], num_tokens: int) -> None:
        """Give every group the blocks `num_tokens` tokens need; free what slid out of a window.

        A recurrent group as vLLM's `align` mode keeps it: the state lives in the table's last
        block, and a block the state has left holds a checkpoint only when it ended there (a
        whole number of blocks); any other is freed."""
        B = self.layout.block_size
        for g, table in enumerate(tables):
            first = self.spec.group_layer(g).tokens_kept(num_tokens)
            need = cdiv(num_tokens, B)
            if self.spec.group_layer(g).is_recurrent:
                last = max((i for i, b in enumerate(table) if b != NULL), default=None)
                held = self._state_tokens.get(id(table), 0)
                if last is not None and last < need - 1 and held != (last + 1) * B:
                    self.free.append(table[last])  # a state between block ends: no checkpoint
                    table[last] = NULL
                table += [NULL] * (need - len(table))
                if need and table[need - 1] == NULL:
                    table[need - 1] = self.allocate()
                self._state_tokens[id(table)] = num_tokens
                continue
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
                        if int(rc.addr.region[li, ci]) < 0:  # another PP stage's layer
                            continue
                        view = rc.logical_view(li, ci, as_int=True)
                        kb = 1 if self.spec.layers[li].is_recurrent else self.layout.kernel_blocks_per_block
                        rows = torch.tensor([b * kb + k for b in ids for k in range(kb)], dtype=torch.long)
                        if len(rows):
                            view[rows] = torch.randint(-100, 100, view[rows].shape, generator=gen).to(view.dtype)
            self.free += ids
            released += len(ids)
            table[:] = [NULL] * len(table)
        return released


def _ids(tables: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t) for t in tables)


class Moved(NamedTuple):
    blocks: int
    bytes: int
    seconds: float


class OffloadBackend(Protocol):
    """Where a round trip stores and finds blocks: a CPU pool here, a shared pool in `pool_demo`.
    `load` answers None when it refused the blocks (the engine then recomputes them)."""

    def describe(self) -> str: ...
    def store(self, engine: DeviceEngine, tables: list[list[int]], keys: list[list[OffloadKey]],
              new: list[OffloadKey]) -> Moved: ...
    def hit(self, keys: list[list[OffloadKey]], windows: list[int | None], obs: int, num_tokens: int) -> int: ...
    def load(self, engine: DeviceEngine, tables: list[list[int]], keys: list[list[OffloadKey]],
             hit: int) -> Moved | None: ...
    def events(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class _CpuPoolBackend:
    """One process's CPU pool, its catalogue and an offload worker per engine."""

    def __init__(self, pool: CPUPool, manager: OffloadingManager, after_store: Callable[[CPUPool], None] | None):
        self.pool, self.manager, self.after_store = pool, manager, after_store
        self.workers: dict[int, OffloadWorker] = {}
        self._events: list = []

    def _worker(self, engine: DeviceEngine) -> OffloadWorker:
        if id(engine) not in self.workers:
            self.workers[id(engine)] = OffloadWorker(engine.caches, self.pool)
        return self.workers[id(engine)]

    def factor(self, engine: DeviceEngine) -> int:
        return self._worker(engine).block_size_factor

    def _run(self, engine: DeviceEngine, job) -> TransferResult:
        worker = self._worker(engine)
        job_id = worker.submit(job)
        worker.wait([job_id])
        (res,) = [r for r in worker.get_finished() if r.job_id == job_id]
        return res

    def describe(self) -> str:
        return self.pool.describe()

    def store(self, engine, tables, keys, new) -> Moved:
        out = self.manager.prepare_store(new)
        if out is None:
            raise InvalidRequest(f"CPU pool of {self.pool.num_blocks} blocks cannot take {len(new)} more; "
                                 f"raise num_cpu_blocks")
        self.manager.touch([k for ks in keys for k in ks])
        if not out.keys_to_store:
            return Moved(0, 0, 0.0)
        res = self._run(engine, (store_job(tables, keys, out.keys_to_store, self.factor(engine),
                                           engine.spec.recurrent_groups()), out.store_spec))
        self.manager.complete_store(out.keys_to_store, success=res.success)
        return Moved(len(out.keys_to_store), res.bytes, res.seconds)

    def after_stores(self) -> None:
        if self.after_store is not None:
            self.after_store(self.pool)

    def hit(self, keys, windows, obs, num_tokens) -> int:
        hit = request_hits(keys, windows, obs, num_tokens, self.manager.lookup_key) or 0
        self.manager.touch([k for ks in keys for k in ks])
        return hit

    def load(self, engine, tables, keys, hit) -> Moved | None:
        """None when the copy failed: the engine then recomputes, as it would."""
        load_keys, gpu_spec = load_job(tables, keys, hit, engine.layout.block_size, self.factor(engine),
                                       state_groups=engine.spec.recurrent_groups())
        cpu_spec = self.manager.prepare_load(load_keys)
        res = self._run(engine, (cpu_spec, gpu_spec))
        self.manager.complete_load(load_keys)
        return Moved(len(load_keys), res.bytes, res.seconds) if res.success else None

    def events(self) -> dict[str, int]:
        events = self.manager.take_events()
        return {"stored": sum(len(e.keys) for e in events if not e.removed),
                "removed": sum(len(e.keys) for e in events if e.removed)}

    def close(self) -> None:
        for w in self.workers.values():
            w.shutdown()


def demo_prompts(vocab: int, seed: int, prompt_len: int, prefix_len: int, suffix_len: int) -> tuple[list[int], list[int]]:
    """Prompt A and prompt B, which shares A's first `prefix_len` tokens and then differs."""
    gen = torch.Generator().manual_seed(seed)
    prompt_a = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
    suffix = [(t + 1) % vocab for t in torch.randint(0, vocab, (suffix_len,), generator=gen).tolist()]
    if suffix[0] == prompt_a[prefix_len % prompt_len]:
        suffix[0] = (suffix[0] + 1) % vocab
    return prompt_a, prompt_a[:prefix_len] + suffix


def check_prefix(obs: int, prompt_len: int, prefix_len: int | None, suffix_len: int, new_tokens: int) -> int:
    """The prefix length (default: the longest whole number of offloaded blocks), or a one-line refusal."""
    prefix_len = prefix_len if prefix_len is not None else (prompt_len - 1) // obs * obs
    if prefix_len < obs or prefix_len % obs or prefix_len >= prompt_len:
        raise InvalidRequest(f"prefix_len must be a multiple of the {obs}-token offloaded block, at least one block "
                             f"and shorter than the {prompt_len}-token prompt; got {prefix_len}")
    if suffix_len < 1 or new_tokens < 1:
        raise InvalidRequest(f"suffix_len and new_tokens must be >= 1, got {suffix_len} and {new_tokens}")
    return prefix_len


@torch.inference_mode()
def round_trip(model: str, net, spec: ModelSpec, prompt_a: list[int], prompt_b: list[int], prefix_len: int,
               new_tokens: int, obs: int, store_engine: DeviceEngine, load_engine: DeviceEngine,
               backend: OffloadBackend, factor_of: Callable[[DeviceEngine], int]) -> OffloadDemoResult:
    """Prefill A to the prefix and store it, then to the prompt's end and store the rest; evict it,
    look B up, load its hit (or recompute it where the load is refused, the whole prompt on a miss),
    decode from the load engine's blocks, compare. Each prefill is `proof.prefill`, a forward as the
    direct proof runs it: the model's own cache argument and class, state kept on modules, and the
    positions `generate` passes (RoBERTa-style decoders default to others).

    The second prefill computes the prefix again, on purpose: each is one monolithic forward from
    an empty cache. A recurrent hybrid's state checkpoint at the prefix's end exists only from a
    forward that stops there (the first), and a continuation from it would need each model's own
    way to continue (Mamba1 mixers take one token at a time, RecurrentGemma keeps state on its
    modules, RWKV and xLSTM outside any Cache) for blocks B never loads; on these tiny models the
    repeat costs milliseconds."""
    prompt_len = len(prompt_a)
    windows = group_windows(spec)
    keys_a = [group_keys(chained_block_hashes(prompt_a, obs), g) for g in range(len(spec.groups))]
    tables_a: list[list[int]] = [[] for _ in spec.groups]
    next_stored = [0] * len(spec.groups)
    stored_prefix: DynamicCache | None = None
    stored = Moved(0, 0, 0.0)
    factor = factor_of(store_engine)
    for stop in (prefix_len, prompt_len):
        cache, _ = prefill(net, prompt_a[:stop])
        store_engine.grow(tables_a, stop)
        export_cache(cache, spec, store_engine.caches, _ids(tables_a), stop)
        if stop == prefix_len:
            stored_prefix = copy.deepcopy(cache)
        new = [k for g in range(len(spec.groups))
               for k in storable_keys(tables_a[g], keys_a[g], factor, next_stored[g], stop // obs)]
        m = backend.store(store_engine, tables_a, keys_a, new)
        stored = Moved(stored.blocks + m.blocks, stored.bytes + m.bytes, stored.seconds + m.seconds)
        next_stored = [stop // obs] * len(spec.groups)
    assert stored_prefix is not None
    store_engine.evict(tables_a, store_engine.seed + 2)
    getattr(backend, "after_stores", lambda: None)()

    keys_b = [group_keys(chained_block_hashes(prompt_b, obs), g) for g in range(len(spec.groups))]
    hit = backend.hit(keys_b, windows, obs, len(prompt_b))
    tables_b: list[list[int]] = [[] for _ in spec.groups]
    loaded = Moved(0, 0, 0.0)
    recomputed = False
    if hit:
        load_engine.grow(tables_b, hit)
        moved = backend.load(load_engine, tables_b, keys_b, hit)
        if moved is None:  # the load was refused: the engine recomputes those blocks' tokens itself
            recomputed = True
            _recompute(net, spec, prompt_b[:hit], load_engine, tables_b)
        else:
            loaded = moved
    first_token = None
    if not hit:  # a miss: the engine prefills the whole prompt into its blocks and decodes from them
        hit = len(prompt_b)
        load_engine.grow(tables_b, hit)
        first_token = _recompute(net, spec, prompt_b, load_engine, tables_b)
    # Decode from the engine's blocks (loaded, or recomputed where the load was refused or missed);
    # a partial hit is compared with a forward over the tokens it holds.
    proof = prove_cache(net, prompt_b, load_engine.caches, _ids(tables_b), new_tokens, num_cached=hit,
                        reference_cache=stored_prefix if hit == prefix_len and loaded.blocks else None,
                        first_token=first_token)
    if recomputed or first_token is not None:
        hit = 0  # nothing came from the pool
    events = backend.events()
    backend.close()
    return OffloadDemoResult(
        model=model, spec=spec.describe(), store_engine=store_engine.layout.describe(),
        load_engine=load_engine.layout.describe(), pool=backend.describe(), prompt_len=prompt_len,
        prefix_len=prefix_len, new_tokens=new_tokens, hit_tokens=hit, tokens_reference=proof.tokens_reference,
        tokens_offload=proof.tokens_disaggregated, match=proof.match, cache_equal=bool(hit) and proof.cache_equal,
        replicas_equal=proof.replicas_equal, stored_blocks=stored.blocks, loaded_blocks=loaded.blocks,
        bytes_stored=stored.bytes, bytes_loaded=loaded.bytes, store_seconds=stored.seconds,
        load_seconds=loaded.seconds, events=events, recomputed=recomputed, differences=proof.cache_differences + proof.replica_mismatches)


def _recompute(net, spec: ModelSpec, tokens: list[int], engine: DeviceEngine,
               tables: list[list[int]]) -> int:
    """What an engine does with blocks it could not load: a forward over their tokens, written into its
    own blocks (`tables`, already holding them); returns the greedy token after `tokens`."""
    cache, first = prefill(net, tokens)
    export_cache(cache, spec, engine.caches, _ids(tables), len(tokens))
    return first


def run_offload_demo(model: str = "tiny-gemma2", seed: int = 0, prompt_len: int = 40, prefix_len: int | None = None,
                     suffix_len: int = 8, new_tokens: int = 8, block_size: int = 4, block_size_factor: int = 2,
                     store_tp: int = 1, load_tp: int | None = None, load_block_size: int | None = None,
                     canonical: bool = False, policy: Literal["lru", "arc"] = "lru", num_cpu_blocks: int = 64,
                     after_store: Callable[[CPUPool], None] | None = None, store_pp: int = 1,
                     load_pp: int = 1) -> OffloadDemoResult:
    """Prefill A, store it to CPU, evict it from the device, load B's shared prefix back, decode, compare.

    `canonical=True` stores in the TP-independent format and loads on an engine with
    `load_tp` / `load_block_size` / `load_pp`; otherwise the pool mirrors the store engine, which also loads.
    `after_store` may inspect (or, in tests, corrupt) the pool between the two requests.
    """
    net, config = load_model(model, seed)
    net.generation_config = greedy_config()
    spec = spec_for(config, next(net.parameters()).dtype)
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    obs = block_size * block_size_factor  # tokens per offloaded block (the key granularity)
    prefix_len = check_prefix(obs, prompt_len, prefix_len, suffix_len, new_tokens)
    prompt_a, prompt_b = demo_prompts(vocab, seed, prompt_len, prefix_len, suffix_len)

    blocks_needed = 2 * cdiv(max(prompt_len, len(prompt_b)), min(block_size, load_block_size or block_size)) + 4
    store_layout = EngineLayout(tp_size=store_tp, pp_size=store_pp, block_size=block_size, num_blocks=blocks_needed)
    if canonical:
        pool = CPUPool.canonical(spec, obs, num_cpu_blocks, pin_memory=False, kernel_tokens=block_size)
        load_layout = EngineLayout(tp_size=load_tp or store_tp, pp_size=load_pp,
                                   block_size=load_block_size or block_size, num_blocks=blocks_needed)
    else:
        if (load_tp not in (None, store_tp)) or (load_block_size not in (None, block_size)) or load_pp != store_pp:
            raise InvalidRequest("the mirror (vLLM) variant loads on the engine that stored; use canonical=True "
                                 f"to load on another shape (asked TP {store_tp} -> {load_tp}, block {block_size} -> "
                                 f"{load_block_size})")
        pool = CPUPool.mirror(spec, store_layout, block_size_factor, num_cpu_blocks, pin_memory=False)
        load_layout = store_layout
    backend = _CpuPoolBackend(pool, OffloadingManager(num_cpu_blocks, policy, block_size=obs), after_store)
    store_engine = DeviceEngine(spec, store_layout, seed + 1)
    load_engine = store_engine if load_layout == store_layout and not canonical else DeviceEngine(
        spec, load_layout, seed + 2)
    return round_trip(model, net, spec, prompt_a, prompt_b, prefix_len, new_tokens, obs, store_engine,
                      load_engine, backend, backend.factor)


__all__ = ["DeviceEngine", "Moved", "OffloadBackend", "OffloadDemoResult", "check_prefix", "demo_prompts",
           "round_trip", "run_offload_demo"]
