"""Engines in miniature for the pool tests: rank caches with random bytes, one store client and tier
per rank (as one process per rank would have), and the expected result of any load, computed
without the store: the same job through an in-process canonical CPU pool."""

from __future__ import annotations

import hashlib

import torch

from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.offload.keys import make_offload_key
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.spec import CPULoadStoreSpec, GPULoadStoreSpec
from kvbridge.offload.worker import OffloadWorker
from kvbridge.pool.store import StoreClient, StoreConfig, close_all
from kvbridge.pool.tier import PoolConfig, PoolTier
from kvbridge.proofs.verify import random_bytes
from kvbridge.transport.cache import RankCache

SPEC = ModelSpec.uniform(2, 4, 8, "bfloat16", name="pool-test")
POOL_BLOCK = 8
CLIENT_TTL_S = 2
"""The test master's client TTL: a dead client's segment stays mounted (puts into it fail) this long."""


def config(secret: bytes = b"fleet-secret-0123456789", staging: int = 4, model_id: str = "pool-test") -> PoolConfig:
    return PoolConfig(model_id=model_id, block_tokens=POOL_BLOCK, staging_blocks=staging, secret=secret)


class Engine:
    """Rank caches of one shape, every byte random from `seed`, and (once `attach`ed) a tier per rank."""

    def __init__(self, tp: int, block: int, seed: int, pp: int = 1, num_blocks: int = 64, kv_order: str = "NHD",
                 spec: ModelSpec = SPEC):
        self.spec = spec
        self.layout = EngineLayout(tp_size=tp, pp_size=pp, block_size=block, num_blocks=num_blocks,
                                   kv_order=kv_order)  # type: ignore[arg-type]
        self.caches = RankCache.allocate_engine(spec, self.layout, fill=None)
        random_bytes(self.caches, seed)
        self.factor = POOL_BLOCK // block
        self.tiers: list[PoolTier] = []
        self.clients: list[StoreClient] = []

    def attach(self, master, cfg: PoolConfig, client: StoreClient | None = None,
               segment_bytes: int = 16 << 20, local_hostname: str = "127.0.0.1") -> Engine:
        """A tier per rank, all on `client` (or on one new client of this engine's: as one process
        hosting every rank; a Mooncake close costs a second, so tests share clients)."""
        if client is None:
            client = StoreClient(StoreConfig(master.address, master.metadata_url, local_hostname,
                                             segment_bytes=segment_bytes))
            self.clients.append(client)
        self.tiers = [PoolTier(c, client, cfg) for c in self.caches]
        return self

    def job(self, first_block: int, num_keys: int) -> GPULoadStoreSpec:
        """Device blocks `first_block ...` for `num_keys` pool blocks of group 0."""
        return self.job_at([first_block + k * self.factor for k in range(num_keys)])

    def job_at(self, firsts: list[int]) -> GPULoadStoreSpec:
        """Pool block k in the `factor` device blocks from `firsts[k]` on."""
        ids = [f + j for f in firsts for j in range(self.factor)]
        return GPULoadStoreSpec(ids, [len(ids)], [0])

    def store(self, gpu: GPULoadStoreSpec, keys, skip_present: bool = False) -> list[bool]:
        results = [t.store(gpu, keys, skip_present=skip_present) for t in self.tiers]
        return [all(r.done[i] for r in results) for i in range(len(keys))]

    def load(self, keys, gpu: GPULoadStoreSpec) -> list[bool]:
        results = [t.load(keys, gpu) for t in self.tiers]
        return [all(r.done[i] for r in results) for i in range(len(keys))]

    def clone(self) -> list[RankCache]:
        return [RankCache(c.spec, c.layout, c.rank, [r.clone() for r in c.regions]) for c in self.caches]

    def close(self) -> None:
        for t in self.tiers:
            t.close()
        close_all(self.clients)


def block_keys(n: int, salt: str, group: int = 0) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{salt}/{i}".encode()).digest(), group) for i in range(n)]


def expected_load(source: Engine, src_job: GPULoadStoreSpec, dest: list[RankCache], dest_layout: EngineLayout,
                  dst_job: GPULoadStoreSpec) -> list[RankCache]:
    """`dest` after loading what `source` stored, computed through a canonical CPU pool (no store)."""
    n = len(src_job.block_ids) // source.factor
    pool = CPUPool.canonical(source.spec, POOL_BLOCK, n, pin_memory=False)
    with OffloadWorker(source.caches, pool) as w:
        w.wait([w.submit((src_job, CPULoadStoreSpec(range(n))))])
    out = [RankCache(c.spec, c.layout, c.rank, [r.clone() for r in c.regions]) for c in dest]
    with OffloadWorker(out, pool) as w:
        w.wait([w.submit((CPULoadStoreSpec(range(n)), dst_job))])
    return out


def same(a: list[RankCache], b: list[RankCache]) -> bool:
    return all(torch.equal(x, y) for ca, cb in zip(a, b) for x, y in zip(ca.byte_regions(), cb.byte_regions()))


def blocks_are(dest: list[RankCache], want: list[RankCache], blocks) -> bool:
    """Whether device blocks `blocks` of every rank, layer and component of `dest` equal `want`'s."""
    idx = torch.tensor(list(blocks), dtype=torch.long)
    for c, w in zip(dest, want):
        kb = c.layout.kernel_blocks_per_block
        rows = (idx[:, None] * kb + torch.arange(kb)[None, :]).reshape(-1)
        for li in range(c.spec.num_layers):
            for ci in range(int(c.addr.num_components[li])):
                if int(c.addr.region[li, ci]) < 0:  # another PP stage's layer: not on this rank
                    continue
                if not torch.equal(c.logical_view(li, ci, as_int=True)[rows], w.logical_view(li, ci, as_int=True)[rows]):
                    return False
    return True
