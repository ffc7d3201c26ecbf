"""How a scheduler turns block tables and keys into the device side of store and load jobs.

Block tables hold one device block id per logical block of each group, with `NULL` where a group
keeps nothing (blocks that slid out of a window, or were never needed). Nulls can only precede
real blocks. An offloaded block i of group g covers logical blocks `[i*factor, (i+1)*factor)` and
is stored only if its last block is real; its first blocks may be null, which is where the
GPU spec's `block_indices` (logical index of the first real block) and the skip come from.
These helpers follow vLLM's connector scheduler (see the reference, section 2.4).

A recurrent group (`state_groups`) keeps checkpoints, not tokens (vLLM's `align` mode): a real
entry i that is not the table's last holds the state after token `(i + 1) * B`. Offloaded block i
is then the one checkpoint at its end, `table[(i + 1) * factor - 1]`; a store moves those, a load
only the checkpoint where the hit ends (the state there is all a reader needs).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvbridge.offload.errors import SpecMismatch
from kvbridge.offload.policy import Key
from kvbridge.offload.spec import GPULoadStoreSpec, cdiv

NULL = -1
"""A block table entry the group does not hold."""


def storable_keys(table: Sequence[int], keys: Sequence[Key], factor: int, start: int, stop: int) -> list[Key]:
    """Keys `[start, stop)` of one group whose offloaded block ends in a real device block."""
    return [keys[i] for i in range(start, min(stop, len(keys)))
            if (i + 1) * factor <= len(table) and table[(i + 1) * factor - 1] != NULL]


def whole_blocks(table: Sequence[int], factor: int) -> list[int]:
    """`table` with every offloaded block that is not wholly on the device blanked (`NULL`).

    Why: a sliding window's table is blanked from the left as the window moves, so at a late
    store the first device blocks of an offloaded block may be gone while its last is there.
    Stored, such a block would hold nothing where they were, and a reader whose hit ends with it
    needs those tokens when the writer had computed past the block's end. Whole blocks only."""
    out = list(table)
    for i in range(0, len(out), factor):
        if NULL in out[i:i + factor]:
            out[i:i + factor] = [NULL] * len(out[i:i + factor])
    return out


def store_job(tables: Sequence[Sequence[int]], keys: Sequence[Sequence[Key]], to_store: Sequence[Key],
              factor: int, state_groups: Collection[int] = ()) -> GPULoadStoreSpec:
    """Device side of storing `to_store` (the manager's answer, in group order) into its CPU slots;
    of a group in `state_groups`, the checkpoint block at each offloaded block's end."""
    where = {key: (g, i) for g, ks in enumerate(keys) for i, key in enumerate(ks)}
    ids: list[list[int]] = [[] for _ in tables]
    first: list[int | None] = [None] * len(tables)
    last_group = 0
    for key in to_store:
        if key not in where:
            raise SpecMismatch(f"key {key!r} is not one of the request's keys")
        g, i = where[key]
        if g < last_group:
            raise SpecMismatch(f"keys to store must come in group order; key {key!r} of group {g} follows group "
                               f"{last_group}")
        last_group = g
        blocks = list(tables[g][i * factor:(i + 1) * factor])
        if len(blocks) < factor or blocks[-1] == NULL:
            raise SpecMismatch(f"offloaded block {i} of group {g} is not full on the device (blocks {blocks})")
        if g in state_groups:
            if first[g] is None:
                first[g] = (i + 1) * factor - 1
            ids[g].append(int(blocks[-1]))
            continue
        for j, b in enumerate(blocks):
            if b == NULL:
                if first[g] is not None:
                    raise SpecMismatch(f"group {g}: null block at logical index {i * factor + j} after real ones")
                continue
            if first[g] is None:
                first[g] = i * factor + j
            ids[g].append(int(b))
    return GPULoadStoreSpec([b for g in ids for b in g], [len(g) for g in ids], [f or 0 for f in first])


def load_job(tables: Sequence[Sequence[int]], keys: Sequence[Sequence[Key]], num_cached_tokens: int,
             block_size: int, factor: int, on_device: Sequence[Sequence[bool]] | None = None,
             state_groups: Collection[int] = ()) -> tuple[list[Key], GPULoadStoreSpec]:
    """Keys to load (in group order) and the device side of loading the first `num_cached_tokens`.

    Per group, the blocks already on the device (`on_device`, e.g. prefix-cache hits) and the
    null ones are skipped: loading starts at the first real block that still has to be filled.
    A group of `state_groups` loads one checkpoint, the one where the hit ends, into the
    table's block there (a multiple of the offloaded block: the hit rules give nothing else).
    """
    want: list[Key] = []
    ids: list[int] = []
    sizes, indices = [], []
    for g, table in enumerate(tables):
        G = cdiv(num_cached_tokens, block_size)
        if len(table) < G:
            raise SpecMismatch(f"group {g}: {num_cached_tokens} tokens need {G} blocks, the table has {len(table)}")
        have = on_device[g] if on_device is not None else [False] * G
        if g in state_groups:
            if num_cached_tokens % (block_size * factor):
                raise SpecMismatch(f"group {g} (recurrent state): a load must end on an offloaded block's end, "
                                   f"got {num_cached_tokens} tokens with {block_size * factor}-token blocks")
            todo = [int(table[G - 1])] if G and not have[G - 1] else []
            if NULL in todo:
                raise SpecMismatch(f"group {g}: no block at logical index {G - 1} to load the state into")
            if todo:
                want.append(keys[g][G // factor - 1])
            ids += todo
            sizes.append(len(todo))
            indices.append(G - 1 if todo else 0)
            continue
        first = next((b for b in range(G) if table[b] != NULL and not have[b]), G)
        todo = list(table[first:G])
        if NULL in todo:
            raise SpecMismatch(f"group {g}: null block inside the range [{first}, {G}) to load")
        if todo:
            if len(keys[g]) < cdiv(G, factor):
                raise SpecMismatch(f"group {g}: loading {G} blocks needs {cdiv(G, factor)} keys, got {len(keys[g])}")
            want += list(keys[g][first // factor:cdiv(G, factor)])
        ids += [int(b) for b in todo]
        sizes.append(len(todo))
        indices.append(first if todo else 0)
    return want, GPULoadStoreSpec(ids, sizes, indices)


__all__ = ["NULL", "load_job", "storable_keys", "store_job", "whole_blocks"]
