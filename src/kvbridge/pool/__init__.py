"""A prefix cache that a fleet of any shapes shares, in Mooncake Store (issue 23).

Blocks go to the store in kvbridge's canonical form, one object per (block, layer, KV head), so
an engine of any TP, PP, block size or layout reads what any other wrote; every object is sealed
and checked before a byte of it reaches a device.

| module | concept |
|---|---|
| `objects` | object naming (namespace, keys) and which rank writes and reads which object |
| `seal` | the MAC trailer that makes a store's bytes trustworthy |
| `store` | one rank's Mooncake Store client: batched zero-copy puts and gets, codes as outcomes |
| `master` | start and stop a `mooncake_master` |
| `tier` | one device rank's store and load jobs through canonical staging; the scheduler's hit index |
"""

from kvbridge.pool.master import MooncakeMaster
from kvbridge.pool.objects import ObjectId, ObjectLayout, pool_namespace
from kvbridge.pool.seal import check_seal, seal
from kvbridge.pool.store import PoolUnavailable, StoreClient, StoreConfig
from kvbridge.pool.tier import PoolConfig, PoolIndex, PoolTier, TierResult, job_chunks

__all__ = ["MooncakeMaster", "ObjectId", "ObjectLayout", "PoolConfig", "PoolIndex", "PoolTier", "PoolUnavailable",
           "StoreClient", "StoreConfig", "TierResult", "check_seal", "job_chunks", "pool_namespace", "seal"]
