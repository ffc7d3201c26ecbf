"""A rank's view of its host's arenas (`pool.host_arena`): one per KV-cache group of its model.

`PoolTier` seals a store's objects straight into the arena and opens a load's objects straight
out of it; only what the host tier does not hold goes to Mooncake, and what a load got from
Mooncake is put into the host tier for the next reader of this host. The arenas of one pool on
one host are named by the pool's namespace and secret (`arena_name`), so every engine of any
shape sharing that pool maps the same ones.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.offload.keys import OffloadKey
from kvbridge.pool.host_arena import Claim, HostArena, arena_dir, arena_name, open_arena, release_arena
from kvbridge.pool.objects import ObjectId, ObjectLayout
from kvbridge.pool.seal import SEAL_BYTES

MIN_HOST_BYTES = 1 << 20
MAX_HOST_BYTES = 1 << 44


@dataclass
class HostWrite:
    """What one call claimed in an arena: per block the objects it writes, and (block index,
    object, arena view) to fill with each one's sealed bytes."""

    arena: HostArena | None
    claims: list[Claim | None]
    objects: list[list[ObjectId]]
    targets: list[tuple[int, ObjectId, np.ndarray]]
    index: dict[ObjectId, int] = field(default_factory=dict)


class HostTier:
    """The arenas of one pool on this host (`host_bytes` split evenly over the model's groups)."""

    def __init__(self, layout: ObjectLayout, secret: bytes, host_bytes: int, directory: str = ""):
        self.layout = layout
        directory = directory or arena_dir()
        groups = [g for g, objs in enumerate(layout.group_objects) if objs]
        self.arenas: list[HostArena | None] = [None] * len(layout.group_objects)
        self.index: list[dict[ObjectId, int]] = [{o: i for i, o in enumerate(objs)} for objs in layout.group_objects]
        for g in groups:
            sizes = [layout.nbytes(o) + SEAL_BYTES for o in layout.group_objects[g]]
            path = os.path.join(directory, arena_name(secret, layout.namespace, g, sizes))
            self.arenas[g] = open_arena(path, sizes, host_bytes // len(groups))

    def arena(self, key: OffloadKey) -> HostArena | None:
        return self.arenas[self.layout.group_of(key)]

    def _block(self, key: OffloadKey) -> bytes:
        return bytes.fromhex(self.layout.block(key))

    def _indices(self, key: OffloadKey, objs: Sequence[ObjectId]) -> list[int]:
        index = self.index[self.layout.group_of(key)]
        return [index[o] for o in objs]

    # -- the scheduler's question ---------------------------------------------------------------------
    def complete(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Per block key: every object of it is in this host's arena."""
        out = [False] * len(keys)
        for g, arena in enumerate(self.arenas):
            mine = [i for i, k in enumerate(keys) if self.layout.group_of(k) == g]
            if arena is None or not mine:
                continue
            every = list(range(len(self.layout.group_objects[g])))
            for i, hit in zip(mine, arena.present([self._block(keys[i]) for i in mine], [every] * len(mine))):
                out[i] = hit is not None
        return out

    # -- a load ---------------------------------------------------------------------------------------
    def find(self, keys: Sequence[OffloadKey], reads: Sequence[Sequence[ObjectId]]
             ) -> list[tuple[HostArena, int, int] | None]:
        """Per block key: (arena, slot, generation) when every object of `reads[i]` is there."""
        if not keys:
            return []
        arena = self.arena(keys[0])  # a chunk is one group
        if arena is None:
            return [None] * len(keys)
        found = arena.present([self._block(k) for k in keys], [self._indices(k, r) for k, r in zip(keys, reads)])
        return [None if f is None else (arena, *f) for f in found]

    def views(self, key: OffloadKey, slot: int, objs: Sequence[ObjectId]) -> list[np.ndarray]:
        arena = self.arena(key)
        assert arena is not None
        return [arena.view(slot, i) for i in self._indices(key, objs)]

    def forget(self, key: OffloadKey, slot: int, gen: int, objs: Sequence[ObjectId]) -> None:
        """Objects that failed their tags: gone from the host tier (the next writer stores them)."""
        arena = self.arena(key)
        if arena is not None:
            arena.remove(slot, gen, self._indices(key, objs))

    # -- a store, or a load's objects from Mooncake ---------------------------------------------------
    def claim(self, keys: Sequence[OffloadKey], objs: Sequence[Sequence[ObjectId]]) -> HostWrite:
        """Claim each block's objects of `objs[i]` that nobody holds or is writing; the caller fills
        `HostWrite.targets` (sealed bytes into the arena's views) and then `publish`es."""
        arena = self.arena(keys[0]) if keys else None
        if arena is None:
            return HostWrite(None, [], [[] for _ in keys], [])
        group = self.layout.group_of(keys[0])
        group_objs = self.layout.group_objects[group]
        claims = arena.claim([self._block(k) for k in keys], [self._indices(k, o) for k, o in zip(keys, objs)])
        mine = [[] if c is None else [group_objs[j] for j in c.objects] for c in claims]
        targets = [(i, o, arena.view(c.slot, j)) for i, c in enumerate(claims) if c is not None
                   for o, j in zip(mine[i], c.objects)]
        return HostWrite(arena, claims, mine, targets, self.index[group])

    @staticmethod
    def publish(write: HostWrite, failed: frozenset[tuple[int, ObjectId]] = frozenset()) -> None:
        """Objects of `write` filled (all but `failed`) become visible to every engine of the host."""
        if write.arena is None:
            return
        written = [[write.index[o] for o in objs if (i, o) not in failed] for i, objs in enumerate(write.objects)]
        write.arena.publish(write.claims, written)

    def close(self) -> None:
        arenas, self.arenas = self.arenas, [None] * len(self.arenas)
        for a in arenas:
            if a is not None:
                release_arena(a)


__all__ = ["MAX_HOST_BYTES", "MIN_HOST_BYTES", "HostTier", "HostWrite"]
