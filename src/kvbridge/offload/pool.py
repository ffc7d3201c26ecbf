"""CPU memory for offloaded blocks, in one of two formats.

The pool is a set of `RankCache`s whose *blocks are offloaded blocks*: block size = `factor` x
the device block size, `num_blocks` = number of CPU slots. Slot c of the pool is block c of every
layer, as in vLLM, where a slot is one row across all CPU tensors (so a key of one group leaves
the other groups' rows of its slot unused; vLLM has the same capacity cost).

* `mirror` (vLLM's format): one pool rank per device rank, the device layout itself with bigger
  blocks (same TP, kernel block size, NHD/HND, K/V placement, per- or cross-layer regions), so
  sub-block j of slot c holds exactly the bytes of one device page and runs stay long.
* `canonical` (kvbridge's addition): one parallelism-free copy, a TP=1, HND, K/V-first, per-layer
  layout of `block_tokens` tokens per slot. Every head is written once, even when device ranks
  replicate it, and any engine whose block size divides `block_tokens` loads it through the
  planner whatever its TP size, block size or layout.

A recurrent group's slot holds one state: the checkpoint at the end of the offloaded block
(`offload.spec`), so its size does not depend on the block.

Both formats are described by an ordinary `EngineLayout`, which is what lets the planner produce
every run; `factor_for` refuses a device it cannot serve without ambiguity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import torch

from kvbridge.errors import IncompatibleEngines
from kvbridge.core.layout import EngineLayout, KVPlacement
from kvbridge.transport.cache import RankCache, TORCH_DTYPES
from kvbridge.offload.errors import NotCanonicalizable
from kvbridge.core.spec import ModelSpec

PoolFormat = Literal["mirror", "canonical"]


def canonical_layout(block_tokens: int, num_blocks: int, kernel_tokens: int | None = None,
                     kv_placement: KVPlacement = "kv_first") -> EngineLayout:
    """The parallelism-free layout: TP=1, head-major (HND), K/V-first, per-layer regions.

    `kernel_tokens` (dividing `block_tokens`) cuts each slot into head-major chunks; choosing
    the storing engine's block size keeps every device page one contiguous run. Loaders do
    not need to match it: the planner reads any kernel size. `kv_placement="per_head"` keeps each
    head's K then V together instead (the shared pool's staging: an object is one run).
    """
    return EngineLayout(tp_size=1, block_size=block_tokens, num_blocks=num_blocks, kernel_block_size=kernel_tokens,
                        kv_order="HND", kv_placement=kv_placement, layer_placement="per_layer")


def mirror_layout(device: EngineLayout, factor: int, num_blocks: int) -> EngineLayout:
    """The device layout with `factor` device blocks per block: each device page stays contiguous."""
    return msgspec.structs.replace(device, block_size=device.block_size * factor, num_blocks=num_blocks,
                                   kernel_block_size=device.kernel_size)


class CPUPool:
    """Offloaded blocks in host memory: `caches[r]` is pool rank r (one rank when canonical)."""

    def __init__(self, spec: ModelSpec, layout: EngineLayout, caches: Sequence[RankCache], fmt: PoolFormat):
        if fmt not in ("mirror", "canonical"):
            raise ValueError(f"pool format must be 'mirror' or 'canonical', got {fmt!r}")
        if [c.rank for c in caches] != list(range(layout.tp_size)):
            raise IncompatibleEngines(f"a pool needs its {layout.tp_size} rank caches in rank order, got ranks "
                                      f"{[c.rank for c in caches]}")
        self.spec, self.layout, self.caches, self.format = spec, layout, list(caches), fmt

    @classmethod
    def allocate(cls, spec: ModelSpec, layout: EngineLayout, fmt: PoolFormat,
                 pin_memory: bool | None = None) -> CPUPool:
        """Zeroed host memory; pinned (page-locked, for asynchronous DMA) when CUDA is available."""
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        dtype = TORCH_DTYPES[spec.dtype]
        caches = []
        for r in range(layout.tp_size):
            sizes = layout.addressing(spec, r).region_nbytes
            regions = [torch.zeros(n // spec.itemsize, dtype=dtype, pin_memory=pin) for n in sizes]
            caches.append(RankCache(spec, layout, r, regions))
        return cls(spec, layout, caches, fmt)

    @classmethod
    def mirror(cls, spec: ModelSpec, device: EngineLayout, block_size_factor: int, num_blocks: int,
               pin_memory: bool | None = None) -> CPUPool:
        """vLLM's format: per device rank, `block_size_factor` device pages per slot."""
        if block_size_factor < 1:
            raise NotCanonicalizable(f"block_size_factor must be >= 1, got {block_size_factor}")
        device.check_model(spec, "device engine")
        return cls.allocate(spec, mirror_layout(device, block_size_factor, num_blocks), "mirror", pin_memory)

    @classmethod
    def canonical(cls, spec: ModelSpec, block_tokens: int, num_blocks: int, pin_memory: bool | None = None,
                  kernel_tokens: int | None = None, kv_placement: KVPlacement = "kv_first") -> CPUPool:
        """kvbridge's TP-independent format: one copy of every head, `block_tokens` tokens per slot.

        `kernel_tokens` only speeds copies (`canonical_layout`), so a model with a layer keeping one
        row per several tokens (DeepSeek-V4's compressed caches, whose rows need whole kernel
        blocks) keeps whole slots instead of being refused."""
        if block_tokens < 1:
            raise NotCanonicalizable(f"canonical block size must be >= 1 token, got {block_tokens}")
        if kernel_tokens is not None and (kernel_tokens < 1 or block_tokens % kernel_tokens):
            raise NotCanonicalizable(f"canonical kernel block of {kernel_tokens} tokens must divide the "
                                     f"{block_tokens}-token block")
        if any(layer.tokens_per_row > 1 for layer in spec.layers):
            kernel_tokens = None
        return cls.allocate(spec, canonical_layout(block_tokens, num_blocks, kernel_tokens, kv_placement), "canonical",
                            pin_memory)

    @property
    def block_tokens(self) -> int:
        """Tokens per offloaded block (the key granularity)."""
        return self.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def byte_regions(self) -> list[torch.Tensor]:
        return [r for c in self.caches for r in c.byte_regions()]

    def factor_for(self, spec: ModelSpec, device: EngineLayout) -> int:
        """Device blocks per offloaded block for `device`, or a clear refusal.

        Refused: another model geometry or dtype; a device block size that
        does not divide the pool's block; a TP size that cannot shard the heads; a cross-layer
        region shared by several KV-cache groups (its groups cannot be moved one at a time through
        the planner).
        """
        try:
            spec.check_compatible(self.spec, "device", f"{self.format} offload pool")
        except IncompatibleEngines as e:
            raise NotCanonicalizable(str(e)) from None
        device.check_model(spec, "device engine")
        if self.block_tokens % device.block_size:
            raise NotCanonicalizable(
                f"device block size {device.block_size} does not divide the {self.format} pool's block of "
                f"{self.block_tokens} tokens, so offloaded blocks (and their hashes) cannot be cut into device blocks")
        if len(spec.groups) > 1:
            for name, layout in (("device", device), ("pool", self.layout)):
                if layout.layer_placement == "cross_layer":
                    raise NotCanonicalizable(
                        f"{name} layout {layout.describe()} keeps the layers of all {len(spec.groups)} KV-cache "
                        f"groups in one region; offload moves groups with different block ranges one at a time "
                        f"and needs per-layer regions for a hybrid model")
        return self.block_tokens // device.block_size

    def describe(self) -> str:
        return (f"{self.format} pool: {self.num_blocks} slots of {self.block_tokens} tokens, "
                f"{self.layout.describe()}, {self.nbytes / 2**20:.1f} MiB")


__all__ = ["CPUPool", "PoolFormat", "canonical_layout", "mirror_layout"]
