"""Load/store specs: which blocks a transfer job reads and writes, on the device and in CPU memory.

A CPU ("offloaded") block holds `factor` consecutive device blocks of *one* KV-cache group, so its
sub-block j is the device block at logical index `factor * c + j` of the request. A
`GPULoadStoreSpec` lists device block ids group after group; for group g it says how many
(`group_sizes[g]`) and the logical index of the first (`block_indices[g]`). That index is
required, for every group including empty ones, and used in both directions (vLLM's merged
"Variant B"): a group whose first block is not aligned to `factor` (a sliding window or a prefix
already on the device) skips the first `block_indices[g] % factor` sub-blocks of its first CPU
block, uses `cdiv(n + skip, factor)` CPU blocks, and its last CPU block may be cut short. Because
the same mapping serves stores and loads, a load is the exact inverse of the store before it.

A recurrent-state group (Mamba, gated delta net, short conv) keeps no tokens, only checkpoints:
in vLLM's `align` prefix caching, device block i of such a group holds the state after token
`(i + 1) * B`. Its CPU block c holds the checkpoint at the *end* of offloaded block c, so each
of its device blocks maps to one CPU block (the last sub-block, `factor - 1`), never a run of
`factor`; `block_indices[g]` is then the logical index of the first checkpoint block.

`split_groups` turns a (GPU spec, CPU ids) pair into per-group slices and refuses any pair in
which an id of either side would be left over or missing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import NamedTuple

import numpy as np

from kvbridge.offload.errors import SpecMismatch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class LoadStoreSpec(ABC):
    """Where a transfer reads or writes; `medium()` routes a job to its handler."""

    @staticmethod
    @abstractmethod
    def medium() -> str: ...


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """A spec that is a 1-D list of block ids (int64), in transfer order."""

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: Sequence[int] | np.ndarray):
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise SpecMismatch(f"{type(self).__name__}: block ids must be 1-D, got shape {ids.shape}")
        if ids.size and int(ids.min()) < 0:
            raise SpecMismatch(f"{type(self).__name__}: negative block id {int(ids.min())}")
        ids.setflags(write=False)
        self.block_ids = ids

    def __len__(self) -> int:
        return len(self.block_ids)

    def __eq__(self, other: object) -> bool:
        return (type(self) is type(other)
                and np.array_equal(self.block_ids, other.block_ids))  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """CPU slot numbers, one per offloaded block (the manager hands them out)."""

    __slots__ = ()

    @staticmethod
    def medium() -> str:
        return "CPU"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Device block ids of several KV-cache groups, concatenated in group order."""

    __slots__ = ("group_sizes", "block_indices")

    def __init__(self, block_ids: Sequence[int] | np.ndarray, group_sizes: Sequence[int],
                 block_indices: Sequence[int]):
        super().__init__(block_ids)
        sizes, indices = tuple(int(x) for x in group_sizes), tuple(int(x) for x in block_indices)
        if any(s < 0 for s in sizes):
            raise SpecMismatch(f"group_sizes must be >= 0, got {sizes}")
        if sum(sizes) != len(self.block_ids):
            raise SpecMismatch(f"group_sizes {sizes} sum to {sum(sizes)}, but the spec has {len(self.block_ids)} "
                               f"block ids")
        if len(indices) != len(sizes):
            raise SpecMismatch(f"block_indices {indices} must have one entry per group ({len(sizes)} groups, "
                               f"empty ones included)")
        if any(i < 0 for i in indices):
            raise SpecMismatch(f"block_indices must be >= 0, got {indices}")
        self.group_sizes, self.block_indices = sizes, indices

    @staticmethod
    def medium() -> str:
        return "GPU"

    def __eq__(self, other: object) -> bool:
        return (super().__eq__(other) and self.group_sizes == other.group_sizes  # type: ignore[attr-defined]
                and self.block_indices == other.block_indices)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return (f"GPULoadStoreSpec({self.block_ids.tolist()}, group_sizes={self.group_sizes}, "
                f"block_indices={self.block_indices})")


TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
"""(source spec, destination spec) of one job."""


class GroupSlice(NamedTuple):
    """One non-empty group of a job: its device blocks and the CPU blocks they live in."""

    group: int
    first_index: int  # logical index (in device blocks) of the first device block
    skip: int  # leading sub-blocks of the first CPU block that are not transferred
    device_ids: np.ndarray  # n device block ids
    cpu_ids: np.ndarray  # cdiv(n + skip, factor) CPU block ids (a state group: n, one checkpoint each)
    state: bool = False  # a recurrent group: device block i <-> CPU block i, one state each

    @property
    def num_blocks(self) -> int:
        return len(self.device_ids)

    def cpu_sub_blocks(self, factor: int) -> np.ndarray:
        """Global sub-block index `c * factor + j` of each device block, in order."""
        subs = (self.cpu_ids[:, None] * factor + np.arange(factor, dtype=np.int64)[None, :]).reshape(-1)
        return subs[self.skip:self.skip + len(self.device_ids)]


def split_groups(gpu: GPULoadStoreSpec, cpu: BlockIDsLoadStoreSpec | Sequence[int] | np.ndarray, factor: int,
                 num_groups: int | None = None, state_groups: Collection[int] = ()) -> list[GroupSlice]:
    """Per-group slices of a job, checking that both id lists are consumed exactly.

    Groups take consecutive slices of both lists in group order; empty groups take nothing. A
    group of `state_groups` (recurrent state) takes one CPU id per device id (see the module).
    """
    if factor < 1:
        raise SpecMismatch(f"block_size_factor must be >= 1, got {factor}")
    cpu_ids = cpu.block_ids if isinstance(cpu, BlockIDsLoadStoreSpec) else np.asarray(cpu, dtype=np.int64)
    if num_groups is not None and len(gpu.group_sizes) != num_groups:
        raise SpecMismatch(f"GPU spec describes {len(gpu.group_sizes)} KV-cache groups "
                           f"(group_sizes {gpu.group_sizes}), the model has {num_groups}")
    out: list[GroupSlice] = []
    g_off = c_off = 0
    for g, (n, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
        if n == 0:
            continue
        state = g in state_groups
        skip = 0 if state else first % factor
        count = n if state else cdiv(n + skip, factor)
        if c_off + count > len(cpu_ids):
            raise SpecMismatch(
                f"group {g} ({n} device blocks from logical index {first}, skip {skip}, factor {factor}) needs CPU "
                f"ids [{c_off}, {c_off + count}), but the CPU spec has only {len(cpu_ids)}")
        out.append(GroupSlice(g, first, skip, gpu.block_ids[g_off:g_off + n], cpu_ids[c_off:c_off + count], state))
        g_off += n
        c_off += count
    if c_off != len(cpu_ids):
        raise SpecMismatch(f"the groups consume {c_off} CPU ids, the CPU spec has {len(cpu_ids)} "
                           f"(group_sizes {gpu.group_sizes}, block_indices {gpu.block_indices}, factor {factor})")
    return out


__all__ = ["BlockIDsLoadStoreSpec", "CPULoadStoreSpec", "GPULoadStoreSpec", "GroupSlice", "LoadStoreSpec",
           "TransferSpec", "cdiv", "split_groups"]
