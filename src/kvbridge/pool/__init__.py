"""A prefix cache that a fleet of any shapes shares, in Mooncake Store (issue 23).

Blocks go to the store in kvbridge's canonical form, one object per (block, layer, KV head), so
an engine of any TP, PP, block size or layout reads what any other wrote; every object is encrypted
and authenticated under its tenant's key, and checked before a byte of it reaches a device.

| module | concept |
|---|---|
| `objects` | object naming (namespace, keys) and which rank writes and reads which object |
| `seal` | AES-GCM under per-tenant, per-object derived keys: the store holds no KV in clear and nothing forged |
| `store` | one rank's Mooncake Store client: batched zero-copy puts and gets, codes as outcomes |
| `master` | start and stop a `mooncake_master` |
| `tier` | one device rank's store and load jobs through canonical staging; the scheduler's hit index |
"""

from kvbridge.pool.master import MooncakeMaster
from kvbridge.pool.objects import ObjectId, ObjectLayout, pool_namespace
from kvbridge.pool.seal import open_into, seal_into, tenant_key
from kvbridge.pool.store import PoolUnavailable, StoreClient, StoreConfig
from kvbridge.pool.tier import PoolConfig, PoolIndex, PoolTier, TierResult, job_chunks

__all__ = ["MooncakeMaster", "ObjectId", "ObjectLayout", "PoolConfig", "PoolIndex", "PoolTier", "PoolUnavailable",
           "StoreClient", "StoreConfig", "TierResult", "job_chunks", "open_into", "pool_namespace", "seal_into",
           "tenant_key"]
