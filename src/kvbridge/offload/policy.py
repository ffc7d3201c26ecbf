"""Eviction policies over the offloaded blocks: which block to drop when the CPU pool is full.

Both follow vLLM's current `CPUOffloadingManager` policies exactly, since its tests pin slot ids
and list moves. LRU keeps every block in a map and the *evictable* ones (ready, not being read)
in an ordered list, front = least recent: a block joins the back when its store completes and
again when its last load completes (a completed load is a use), leaves it while it is being read,
and `touch` moves only blocks on that list, walking its keys in reverse so that the first (prefix)
block of a request ends up most recent and suffix blocks are evicted first. ARC keeps
T1 (seen once), T2 (seen again) and ghost lists B1/B2 of evicted keys whose hits steer the target
size p of T1. Eviction is atomic in both: either `n` evictable blocks are found (ready, not being
read, not protected) or nothing changes and `evict` returns None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

Key = Hashable


@dataclass(slots=True)
class BlockStatus:
    """One offloaded block: its CPU slot and `ref_cnt` (-1 = being written, 0 = evictable, >0 = being read)."""

    block_id: int
    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class CachePolicy(ABC):
    """Block organisation plus replacement decision (for ARC the two cannot be separated)."""

    def __init__(self, capacity: int):
        self.capacity = capacity

    @abstractmethod
    def get(self, key: Key) -> BlockStatus | None: ...

    @abstractmethod
    def insert(self, key: Key, block: BlockStatus) -> None: ...

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Drop a block whose store failed (never added to a ghost list)."""

    @abstractmethod
    def touch(self, keys: Iterable[Key]) -> None: ...

    @abstractmethod
    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, BlockStatus]] | None:
        """Exactly `n` evictable blocks, removed; or None and no change."""

    def mark_evictable(self, key: Key) -> None:
        """The block's ref count just became 0 (its store or its last load completed)."""

    def mark_non_evictable(self, key: Key) -> None:
        """The block's ref count just left 0 (a load pinned it)."""

    @staticmethod
    def _evictable(key: Key, block: BlockStatus, protected: set[Key], chosen: set[Key] = frozenset()) -> bool:
        return block.ref_cnt == 0 and key not in protected and key not in chosen


class LRUPolicy(CachePolicy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.blocks: dict[Key, BlockStatus] = {}
        self.evictable: OrderedDict[Key, None] = OrderedDict()  # ref count 0, least recent first

    def get(self, key: Key) -> BlockStatus | None:
        return self.blocks.get(key)

    def insert(self, key: Key, block: BlockStatus) -> None:
        self.blocks[key] = block
        if block.ref_cnt == 0:
            self.evictable[key] = None

    def remove(self, key: Key) -> None:
        del self.blocks[key]
        self.evictable.pop(key, None)

    def touch(self, keys: Iterable[Key]) -> None:
        # Blocks being written or read are not on the list; they join its back when they finish.
        for key in reversed(list(keys)):
            if key in self.evictable:
                self.evictable.move_to_end(key)

    def mark_evictable(self, key: Key) -> None:
        self.evictable[key] = None

    def mark_non_evictable(self, key: Key) -> None:
        del self.evictable[key]

    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, BlockStatus]] | None:
        if n <= 0:
            return []
        chosen = []
        for key in self.evictable:
            if key not in protected:
                chosen.append((key, self.blocks[key]))
                if len(chosen) == n:
                    break
        if len(chosen) < n:
            return None
        for key, _ in chosen:
            del self.blocks[key]
            del self.evictable[key]
        return chosen


class ARCPolicy(CachePolicy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[Key, BlockStatus] = OrderedDict()
        self.t2: OrderedDict[Key, BlockStatus] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def get(self, key: Key) -> BlockStatus | None:
        block = self.t1.get(key)
        return block if block is not None else self.t2.get(key)

    def insert(self, key: Key, block: BlockStatus) -> None:
        self.t1[key] = block
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: Key) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def touch(self, keys: Iterable[Key]) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                block = self.t1.pop(key)
                # A block only prepared for store has not really been seen twice: it stays in T1.
                (self.t2 if block.is_ready else self.t1)[key] = block
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                self.target_t1_size = min(self.target_t1_size + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target_t1_size = max(self.target_t1_size - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, BlockStatus]] | None:
        if n <= 0:
            return []
        chosen: list[tuple[Key, BlockStatus, bool]] = []
        names: set[Key] = set()
        t1_size = len(self.t1)  # simulated, so that nothing changes unless all n are found
        for _ in range(n):
            pick = None
            if t1_size >= int(self.target_t1_size):
                pick = next(((k, b, True) for k, b in self.t1.items() if self._evictable(k, b, protected, names)), None)
                if pick is not None:
                    t1_size -= 1
            if pick is None:
                pick = next(((k, b, False) for k, b in self.t2.items()
                             if self._evictable(k, b, protected, names)), None)
                if pick is None:
                    return None
            chosen.append(pick)
            names.add(pick[0])
        for key, _, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [(k, b) for k, b, _ in chosen]


POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}

__all__ = ["ARCPolicy", "BlockStatus", "CachePolicy", "LRUPolicy", "POLICIES"]
