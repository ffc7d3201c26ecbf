"""KV offload to CPU for every KV-cache group, keyed by block hashes (vLLM's semantics), on kvbridge's planner.

| module | concept |
|---|---|
| `keys` | (block hash, group) offload keys; chained block hashes |
| `spec` | load/store specs; the per-group skip / cdiv / truncation mapping and its exact-consumption check |
| `policy` | LRU and ARC eviction over ready, unpinned, unprotected blocks |
| `manager` | the scheduler-side catalogue of CPU slots (lookup, prepare/complete load and store, events) |
| `lookup` | per-group hit rules (maximal prefix, sliding window) and their combination for a request |
| `scheduling` | block tables + keys -> the device side of store and load jobs |
| `pool` | host memory in the mirror (vLLM) or canonical (TP-independent) format |
| `transfer` | a job -> one run list over all groups, via `plan_request` |
| `worker` | asynchronous jobs: compiled copy on CPU, streams and events on CUDA |
| `bench`, `demo` | measurements and the transformers proof |
"""

from kvbridge.offload.errors import NotCanonicalizable, OffloadStateError, SpecMismatch
from kvbridge.offload.keys import OffloadKey, chained_block_hashes, make_offload_key, split_offload_key
from kvbridge.offload.lookup import prefix_hits, request_hits, window_hits
from kvbridge.offload.manager import FilterReusedManager, OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvbridge.offload.policy import ARCPolicy, BlockStatus, LRUPolicy
from kvbridge.offload.pool import CPUPool, canonical_layout, mirror_layout
from kvbridge.offload.scheduling import NULL, load_job, storable_keys, store_job
from kvbridge.offload.spec import (BlockIDsLoadStoreSpec, CPULoadStoreSpec, GPULoadStoreSpec, GroupSlice,
                                   LoadStoreSpec, TransferSpec, split_groups)
from kvbridge.offload.transfer import JobPlanner, JobRuns
from kvbridge.offload.worker import OffloadWorker, TransferResult

__all__ = [
    "ARCPolicy", "BlockIDsLoadStoreSpec", "BlockStatus", "CPULoadStoreSpec", "CPUPool", "FilterReusedManager",
    "GPULoadStoreSpec", "GroupSlice", "JobPlanner", "JobRuns", "LRUPolicy", "LoadStoreSpec", "NULL",
    "NotCanonicalizable", "OffloadKey", "OffloadStateError", "OffloadWorker", "OffloadingEvent", "OffloadingManager",
    "PrepareStoreOutput", "SpecMismatch", "TransferResult", "TransferSpec", "canonical_layout", "chained_block_hashes",
    "load_job", "make_offload_key", "mirror_layout", "prefix_hits", "request_hits", "split_groups",
    "split_offload_key", "storable_keys", "store_job", "window_hits",
]
