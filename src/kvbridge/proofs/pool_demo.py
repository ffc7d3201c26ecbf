"""The shared-pool proof on a real `transformers` model: one engine stores, another of any shape loads.

The offload round trip (`offload_demo.round_trip`) with a Mooncake Store in the middle: every
rank of the store engine has its own store client and staging and puts the objects it writes;
the load engine's scheduler finds B's prefix complete in the store (`PoolIndex`), and each of its
ranks fetches, checks and loads the objects it reads. Tokens must equal plain `generate(B)` and
the loaded prefix cache must be bit-identical to the stored one. A load that cannot complete
(an object missing, evicted or failing its seal) recomputes: the tokens still equal `generate`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge.core.layout import EngineLayout
from kvbridge.errors import InvalidRequest
from kvbridge.offload.lookup import request_hits
from kvbridge.offload.scheduling import load_job, store_job
from kvbridge.offload.spec import cdiv
from kvbridge.pool.master import MooncakeMaster
from kvbridge.pool.store import StoreClient, StoreConfig, close_all
from kvbridge.pool.tier import PoolConfig, PoolIndex, PoolTier
from kvbridge.proofs.offload_demo import (DeviceEngine, Moved, OffloadDemoResult, check_prefix, demo_prompts,
                                          round_trip)
from kvbridge.proofs.tiny_models import load_model, spec_for
from kvbridge.proofs.proof import greedy_config


@dataclass(frozen=True)
class Shape:
    """An engine's shape in the proof: TP, PP, block size and memory layout."""

    tp: int = 1
    block: int = 4
    pp: int = 1
    kv_order: str = "NHD"

    def layout(self, num_blocks: int) -> EngineLayout:
        return EngineLayout(tp_size=self.tp, pp_size=self.pp, block_size=self.block, num_blocks=num_blocks,
                            kv_order=self.kv_order)  # type: ignore[arg-type]


@dataclass
class SharedPoolBackend:
    """A store client, staging and tier per rank of each engine, and the scheduler's index."""

    store_config: StoreConfig
    config: PoolConfig
    spec: object
    tamper: Callable[[StoreClient, list[str]], None] | None = None
    shared: StoreClient | None = None
    tiers: dict[int, list[PoolTier]] = field(default_factory=dict)
    clients: list[StoreClient] = field(default_factory=list)
    own_client: bool = True
    stored_keys: list[str] = field(default_factory=list)
    load_failures: list[str] = field(default_factory=list)

    def _client(self) -> StoreClient:
        """The one client of this process (each rank of a real fleet has its own; a client serves
        any number of tiers, and Mooncake's close costs a second or two, so the proof shares one)."""
        if self.shared is None:
            self.shared = StoreClient(self.store_config)
            self.clients.append(self.shared)
        return self.shared

    def _tiers(self, engine: DeviceEngine) -> list[PoolTier]:
        if id(engine) not in self.tiers:
            self.tiers[id(engine)] = [PoolTier(c, self._client(), self.config) for c in engine.caches]
        return self.tiers[id(engine)]

    def factor(self, engine: DeviceEngine) -> int:
        return self._tiers(engine)[0].factor

    def describe(self) -> str:
        return f"Mooncake Store pool at {self.store_config.master} ({self.config.block_tokens}-token blocks)"

    def store(self, engine, tables, keys, new) -> Moved:
        if not new:
            return Moved(0, 0, 0.0)
        gpu = store_job(tables, keys, new, self.factor(engine), engine.spec.recurrent_groups())
        results = [t.store(gpu, new) for t in self._tiers(engine)]
        layout = self._tiers(engine)[0].layout
        self.stored_keys += [k for key in new for k in layout.keys(key)]
        done = sum(all(r.done[i] for r in results) for i in range(len(new)))
        return Moved(done, sum(r.bytes for r in results), max(r.seconds for r in results))

    def after_stores(self) -> None:
        if self.tamper is not None:
            self.tamper(self._client(), self.stored_keys)

    def hit(self, keys, windows, obs, num_tokens) -> int:
        index = PoolIndex(self.spec, self._client(), self.config)  # type: ignore[arg-type]
        flat = [k for ks in keys for k in ks]
        present = dict(zip(flat, index.hits(flat)))
        return request_hits(keys, windows, obs, num_tokens, present.get) or 0

    def load(self, engine, tables, keys, hit) -> Moved | None:
        load_keys, gpu = load_job(tables, keys, hit, engine.layout.block_size, self.factor(engine),
                                  state_groups=engine.spec.recurrent_groups())
        results = [t.load(load_keys, gpu) for t in self._tiers(engine)]
        if not all(r.ok for r in results):
            self.load_failures += [why for r in results for why in r.reasons]
            return None
        return Moved(len(load_keys), sum(r.bytes for r in results), max(r.seconds for r in results))

    def events(self) -> dict[str, int]:
        return {name: sum(t.stats[name] for ts in self.tiers.values() for t in ts)
                for name in ("objects_put", "objects_got", "seal_failures", "missing")}

    def close(self) -> None:
        for ts in self.tiers.values():
            for t in ts:
                t.close()
        if self.own_client:
            close_all(self.clients)


def run_pool_demo(model: str = "tiny-gemma2", seed: int = 0, store: Shape = Shape(), load: Shape = Shape(tp=2),
                  pool_block: int = 8, prompt_len: int = 40, prefix_len: int | None = None, suffix_len: int = 8,
                  new_tokens: int = 8, master: MooncakeMaster | None = None, log_dir: str | Path = "/tmp",
                  secret: bytes = b"proof-secret-0123456789",
                  tamper: Callable[[StoreClient, list[str]], None] | None = None,
                  client: StoreClient | None = None, run: str | None = None) -> OffloadDemoResult:
    """Prefill A on `store`, put it in a Mooncake Store, load B's shared prefix on `load`, decode, compare.

    Starts a `mooncake_master` unless one is given, and a store client unless `client` is given
    (a client of that master, left open). `tamper(client, keys)` may damage the stored
    objects between the two requests (the fault tests): the load must then refuse and recompute.

    Each run stores under a namespace of its own (`run`, default a fresh random one): two proofs of
    one (model, seed) on one master share token keys, the first object written under a key stays,
    and a prefix computed in another prefill (a longer prompt, another chunking) differs in its
    last bits, so the second proof loaded the first one's bytes and failed falsely. Give two runs
    the same `run` to have one load what the other stored.
    """
    for s in (store, load):
        if pool_block % s.block:
            raise InvalidRequest(f"engine block size {s.block} does not divide the pool's {pool_block}-token block")
    net, config = load_model(model, seed)
    net.generation_config = greedy_config()
    spec = spec_for(config, next(net.parameters()).dtype)
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    prefix_len = check_prefix(pool_block, prompt_len, prefix_len, suffix_len, new_tokens)
    prompt_a, prompt_b = demo_prompts(vocab, seed, prompt_len, prefix_len, suffix_len)
    own = master is None
    if master is None:
        master = MooncakeMaster.start(Path(log_dir) / f"kvbridge-pool-master-{seed}.log")
    try:
        backend = SharedPoolBackend(StoreConfig(master.address, master.metadata_url),
                                    PoolConfig(model_id=f"{model}@{seed}/{run or os.urandom(6).hex()}",
                                               block_tokens=pool_block,
                                               staging_blocks=8, secret=secret), spec, tamper,
                                    shared=client, own_client=client is None)
        blocks = 2 * cdiv(max(prompt_len, len(prompt_b)), min(store.block, load.block)) + 4
        store_engine = DeviceEngine(spec, store.layout(blocks), seed + 1)
        load_engine = DeviceEngine(spec, load.layout(blocks), seed + 2)
        result = round_trip(model, net, spec, prompt_a, prompt_b, prefix_len, new_tokens, pool_block,
                            store_engine, load_engine, backend, backend.factor)
        result.differences += backend.load_failures
        return result
    finally:
        if own:
            master.stop()


__all__ = ["Shape", "SharedPoolBackend", "run_pool_demo"]
