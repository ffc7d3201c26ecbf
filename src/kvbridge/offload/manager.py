"""The scheduler-side catalogue of offloaded blocks: a fixed pool of CPU slots keyed by offload key.

A key is a (block hash, group) `OffloadKey` (any hashable works). A block is written in two steps:
`prepare_store` picks slots (evicting if it must) and inserts the blocks *not ready*; the worker
copies; `complete_store` makes them ready, or on failure removes the ones still not ready. A read
pins blocks: `prepare_load` raises their ref count so they cannot be evicted until
`complete_load`. Slot allocation, eviction order, lookups and events follow vLLM's current
`CPUOffloadingManager` exactly: fresh ids first, then a LIFO free list; a per-key lookup answers
HIT, MISS or HIT_PENDING (present, store not completed: the scheduler retries later); a block
becomes evictable, and most recent for LRU, when its store completes and when its last load
completes; one "removed" event per eviction batch at prepare time, one "stored" event per
completion that made blocks ready.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from enum import Enum
from typing import Literal, NamedTuple

from kvbridge.offload.errors import OffloadStateError
from kvbridge.offload.keys import split_offload_key
from kvbridge.offload.policy import POLICIES, BlockStatus, CachePolicy, Key
from kvbridge.offload.spec import CPULoadStoreSpec


class LookupResult(Enum):
    """vLLM's per-key lookup answer."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"  # present, but its store has not completed: ask again later


class PrepareStoreOutput(NamedTuple):
    keys_to_store: list[Key]
    store_spec: CPULoadStoreSpec
    evicted_keys: list[Key]


class OffloadingEvent(NamedTuple):
    """Blocks that became readable (`removed=False`) or were evicted (`removed=True`)."""

    keys: tuple[Key, ...]
    block_size: int
    medium: str
    removed: bool

    def block_hashes(self) -> tuple[bytes, ...]:
        """The hash part of each key (what an engine's KV-event stream publishes)."""
        return tuple(split_offload_key(k)[0] for k in self.keys)


class OffloadingManager:
    """LRU or ARC catalogue over `num_blocks` CPU slots of `block_size` tokens each."""

    medium = "CPU"

    def __init__(self, num_blocks: int, policy: Literal["lru", "arc"] = "lru", block_size: int = 0,
                 enable_events: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.policy: CachePolicy = POLICIES[policy](num_blocks)
        self._num_allocated = 0
        self._free_list: list[int] = []
        self._events: list[OffloadingEvent] | None = [] if enable_events else None

    # -- slot pool -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_list) + self.num_blocks - self._num_allocated

    def _allocate(self, count: int) -> list[int]:
        fresh = min(count, self.num_blocks - self._num_allocated)
        ids = list(range(self._num_allocated, self._num_allocated + fresh))
        self._num_allocated += fresh
        ids += [self._free_list.pop() for _ in range(count - fresh)]
        return ids

    def _emit(self, keys: list[Key], removed: bool) -> None:
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(tuple(keys), self.block_size, self.medium, removed))

    # -- the manager interface -------------------------------------------------------------
    def lookup(self, keys: Iterable[Key]) -> int:
        """Length of the longest prefix of `keys` that is present and ready (pending stops it)."""
        hits = 0
        for key in keys:
            block = self.policy.get(key)
            if block is None or not block.is_ready:
                break
            hits += 1
        return hits

    def lookup_result(self, key: Key) -> LookupResult:
        block = self.policy.get(key)
        if block is None:
            return LookupResult.MISS
        return LookupResult.HIT if block.is_ready else LookupResult.HIT_PENDING

    def lookup_key(self, key: Key) -> bool | None:
        """The per-key lookup of the multi-group scheduler (`lookup.LookupFn`): True when ready,
        None when its store is still in flight (retry later, vLLM's HIT_PENDING), else False."""
        result = self.lookup_result(key)
        return None if result is LookupResult.HIT_PENDING else result is LookupResult.HIT

    def prepare_load(self, keys: Iterable[Key]) -> CPULoadStoreSpec:
        """Pin ready blocks for reading; their slots in input order."""
        keys = list(keys)
        blocks = []
        for key in keys:
            block = self.policy.get(key)
            if block is None or not block.is_ready:
                why = "not offloaded" if block is None else "not ready"
                raise OffloadStateError(f"cannot load block {key!r}: {why}")
            blocks.append(block)
        for key, block in zip(keys, blocks):  # all-or-nothing
            if block.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
            block.ref_cnt += 1
        return CPULoadStoreSpec([b.block_id for b in blocks])

    def touch(self, keys: Iterable[Key]) -> None:
        self.policy.touch(keys)

    def complete_load(self, keys: Iterable[Key]) -> None:
        keys = list(keys)
        blocks = [self.policy.get(k) for k in keys]
        for key, block in zip(keys, blocks):
            if block is None or block.ref_cnt <= 0:
                raise OffloadStateError(f"complete_load of block {key!r}, which is not being loaded")
        for key, block in zip(keys, blocks):
            block.ref_cnt -= 1  # type: ignore[union-attr]
            if block.ref_cnt == 0:  # type: ignore[union-attr]
                self.policy.mark_evictable(key)  # a completed load is a use

    def prepare_store(self, keys: Iterable[Key]) -> PrepareStoreOutput | None:
        """Slots for the keys not yet present, evicting atomically; None (no change) if it cannot."""
        keys = list(keys)
        to_store = [k for k in dict.fromkeys(keys) if self.policy.get(k) is None]
        if not to_store:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        need = len(to_store) - self.num_free_blocks
        evicted: list[Key] = []
        if need > 0:
            # Every input key is protected: one that is already stored must survive this call.
            victims = self.policy.evict(need, set(keys))
            if victims is None:
                return None
            for key, block in victims:
                self._free_list.append(block.block_id)
                evicted.append(key)
            self._emit(evicted, removed=True)
        ids = self._allocate(len(to_store))
        for key, block_id in zip(to_store, ids):
            self.policy.insert(key, BlockStatus(block_id))
        return PrepareStoreOutput(to_store, CPULoadStoreSpec(ids), evicted)

    def complete_store(self, keys: Iterable[Key], success: bool = True) -> None:
        """Make stored blocks ready, or drop those still not ready; ready blocks are left alone."""
        stored = []
        for key in keys:
            block = self.policy.get(key)
            if block is None or block.is_ready:
                continue
            if success:
                block.ref_cnt = 0
                self.policy.mark_evictable(key)
                stored.append(key)
            else:
                self.policy.remove(key)
                self._free_list.append(block.block_id)
        self._emit(stored, removed=False)

    def take_events(self) -> list[OffloadingEvent]:
        if not self._events:
            return []
        out, self._events = self._events, []
        return out


class FilterReusedManager:
    """Stores only blocks that lookups have asked for at least `store_threshold` times.

    Wraps another manager: `lookup` counts each key it sees in a bounded LRU counter, and
    `prepare_store` passes on only the keys counted often enough. One-off prefixes therefore
    never displace blocks that are reused.
    """

    def __init__(self, backing: OffloadingManager, store_threshold: int = 2, max_tracker_size: int = 64000):
        if store_threshold < 2:
            raise ValueError(f"store_threshold must be >= 2 (1 means no filter), got {store_threshold}")
        if max_tracker_size < 1:
            raise ValueError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        self.backing, self.threshold, self.max_tracker_size = backing, store_threshold, max_tracker_size
        self.counts: OrderedDict[Key, int] = OrderedDict()

    def _count(self, key: Key) -> None:
        if key in self.counts:
            self.counts.move_to_end(key)
            self.counts[key] += 1
        else:
            if len(self.counts) >= self.max_tracker_size:
                self.counts.popitem(last=False)
            self.counts[key] = 1

    def lookup(self, keys: Iterable[Key]) -> int:
        keys = list(keys)
        for key in keys:
            self._count(key)
        return self.backing.lookup(keys)

    def lookup_key(self, key: Key) -> bool | None:
        self._count(key)
        return self.backing.lookup_key(key)

    def prepare_store(self, keys: Iterable[Key]) -> PrepareStoreOutput | None:
        return self.backing.prepare_store([k for k in keys if self.counts.get(k, 0) >= self.threshold])

    def __getattr__(self, name: str):  # everything else unchanged
        return getattr(self.backing, name)


__all__ = ["FilterReusedManager", "LookupResult", "OffloadingEvent", "OffloadingManager", "PrepareStoreOutput"]
