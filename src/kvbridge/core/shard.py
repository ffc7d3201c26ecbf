"""How ranks split the KV state, and which source rank serves each piece a destination needs.

Three axes are sharded, each by its own rule here and nowhere else:
* heads over TP ranks (below);
* layers over PP stages: contiguous intervals, even by vLLM's rule or an explicit split
  (`pp_layer_range`, vLLM's `get_pp_indices` with `VLLM_PP_LAYER_PARTITION`);
* tokens over context-parallel ranks: `interleave` tokens at a time, round robin, each rank
  keeping its own tokens in order in its pages (block-table entry j of every CP rank holds that
  rank's local tokens `[j*B, (j+1)*B)`; `cp_slots`, vLLM's DCP/PCP slot mapping, cp rank =
  pcp_rank * dcp_size + dcp_rank). With B a multiple of the interleave, one block id names a
  *virtual block* of `B * cp_size` consecutive tokens; with pages smaller than the interleave
  (DeepSeek-V4's 64-, 8- and 4-token pages under a 256-token interleave) it does not.

Heads are split into contiguous intervals. When TP exceeds the head count each rank holds one
head and consecutive ranks share it (ranks 0,1 -> head 0 ...), as vLLM partitions GQA weights.
TP equal to the head count is sharding, not replication. MLA state is whole on every rank.
These rules are the single source for the topology (what vLLM calls tp_ratio, replication,
source ranks) and for the planner (which bytes to read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvbridge.errors import ShardingError

if TYPE_CHECKING:
    from kvbridge.core.spec import LayerSpec


def check_shardable(num_heads: int, tp_size: int, what: str = "engine") -> None:
    """Raise unless `tp_size` ranks can hold `num_heads` heads (one divides the other)."""
    if tp_size < 1:
        raise ShardingError(f"{what}: TP size must be >= 1, got {tp_size}")
    if num_heads % tp_size and tp_size % num_heads:
        raise ShardingError(
            f"{what}: cannot shard {num_heads} KV heads over TP={tp_size} "
            f"(one of {num_heads} and {tp_size} must divide the other)")


def head_range(num_heads: int, tp_size: int, rank: int, replicated: bool = False) -> tuple[int, int]:
    """Global heads `[start, stop)` that `rank` holds."""
    if replicated:
        return (0, num_heads)
    if tp_size <= num_heads:
        per = num_heads // tp_size
        return (rank * per, rank * per + per)
    head = rank * num_heads // tp_size
    return (head, head + 1)


def holders(num_heads: int, tp_size: int, head: int, replicated: bool = False) -> range:
    """Ranks that hold `head` (contiguous)."""
    if replicated:
        return range(tp_size)
    if tp_size <= num_heads:
        return range(head * tp_size // num_heads, head * tp_size // num_heads + 1)
    per = tp_size // num_heads
    return range(head * per, head * per + per)


def overlapping_ranks(local_tp: int, local_rank: int, remote_tp: int) -> tuple[int, ...]:
    """Remote ranks whose share of the model overlaps this rank's (vLLM's handshake targets).

    For divisible TP pairs this is vLLM's rule: `[r // ratio]` when local TP >= remote TP,
    else the `|ratio|` consecutive ranks `r*a ... r*a+a-1`. It extends to any pair.
    """
    lo = local_rank * remote_tp  # interval [lo, hi) in units of 1/(local_tp*remote_tp)
    hi = lo + remote_tp
    return tuple(q for q in range(remote_tp) if q * local_tp < hi and (q + 1) * local_tp > lo)


class HeadSlice(NamedTuple):
    """Heads `[start, stop)` (global) that a destination rank reads from `src_rank`."""

    src_rank: int
    start: int
    stop: int


def preferred_holder(num_heads: int, src_tp: int, dst_tp: int, dst_rank: int, head: int,
                     replicated: bool = False, src_dcp: tuple[int, int] = (1, 0)) -> int:
    """The source rank a destination rank reads `head` from, spreading reads over replicas.

    Follows vLLM's current read plan where vLLM defines one: the rank `floor(r*P/D)` when it
    holds the head, else the first holder among the destination's overlapping ranks (its GQA
    dedup), else a replica picked by destination rank so that readers spread out.
    `src_dcp = (dcp_size, dcp_rank)`: only TP ranks with `tp_rank % dcp_size == dcp_rank` hold
    the tokens being read (decode context parallel splits a head's replicas by tokens).
    """
    owners = [q for q in holders(num_heads, src_tp, head, replicated) if q % src_dcp[0] == src_dcp[1]]
    if not owners:
        raise ShardingError(f"no source TP rank holds head {head} for DCP rank {src_dcp[1]} of {src_dcp[0]}")
    first = dst_rank * src_tp // dst_tp
    if first in owners:
        return first
    for q in overlapping_ranks(dst_tp, dst_rank, src_tp):
        if q in owners:
            return q
    return owners[dst_rank % len(owners)]


def assign_sources(num_heads: int, src_tp: int, dst_tp: int, dst_rank: int,
                   replicated: bool = False, src_dcp: tuple[int, int] = (1, 0)) -> tuple[HeadSlice, ...]:
    """Split the heads TP rank `dst_rank` needs into contiguous slices, each read from one source TP rank."""
    start, stop = head_range(num_heads, dst_tp, dst_rank, replicated)
    slices: list[HeadSlice] = []
    for h in range(start, stop):
        q = preferred_holder(num_heads, src_tp, dst_tp, dst_rank, h, replicated, src_dcp)
        if slices and slices[-1].src_rank == q and slices[-1].stop == h:
            slices[-1] = HeadSlice(q, slices[-1].start, h + 1)
        else:
            slices.append(HeadSlice(q, h, h + 1))
    return tuple(slices)


def conv_split(layer: LayerSpec, tp_size: int) -> tuple[int, ...]:
    """Local channel counts of each conv segment at `tp_size` (vLLM's `local_proj_dims`)."""
    out = []
    for c in layer.state:
        if c.name.startswith("conv"):
            h0, h1 = head_range(c.heads, tp_size, 0)
            out.append((h1 - h0) * (c.dim // layer.conv_rows))
    return tuple(out)


def check_dcp(num_heads: int, tp_size: int, dcp_size: int, replicated: bool, what: str = "engine") -> None:
    """Raise unless every head's TP replicas cover all `dcp_size` DCP ranks (vLLM: dcp <= tp / heads).

    DCP splits the tokens of a head among the ranks that would otherwise hold copies of it, so a
    head held by fewer than `dcp_size` ranks (or by ranks missing a DCP residue) loses tokens.
    """
    if dcp_size == 1:
        return
    copies = tp_size if replicated else tp_size // num_heads if tp_size > num_heads else 1
    if tp_size % dcp_size or copies % dcp_size:
        raise ShardingError(
            f"{what}: decode context parallel size {dcp_size} needs TP {tp_size} to hold each of the "
            f"{1 if replicated else num_heads} KV heads a multiple of {dcp_size} times (it holds each {copies} times)")


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int, split: Sequence[int] = ()) -> tuple[int, int]:
    """Layers `[start, stop)` of PP stage `pp_rank`, as vLLM's `get_pp_indices`.

    `split` is `VLLM_PP_LAYER_PARTITION` (layers per stage). Without it, stages get
    `num_layers // pp_size` layers and the remainder goes one layer each to the stages before the
    last, starting from the second to last (the last stage also runs the LM head).
    """
    if split:
        if len(split) != pp_size or sum(split) != num_layers or min(split) < 1:
            raise ShardingError(
                f"layer split {','.join(map(str, split))} must give {pp_size} stages >= 1 layer each summing to "
                f"{num_layers} layers")
        parts = list(split)
    else:
        if pp_size > num_layers:
            raise ShardingError(f"PP size {pp_size} exceeds the {num_layers} layers")
        parts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def cp_slots(positions: np.ndarray, block_size: int, cp_size: int = 1,
             interleave: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block-table index, owning CP rank, offset in that rank's block) of each token position.

    vLLM's compact-local mapping: chunks of `interleave` tokens go round robin to the CP ranks;
    position p is the `(p // (interleave * cp_size)) * interleave + p % interleave`-th token of its
    rank, which keeps its tokens in order, `block_size` per block: index `local // block_size`,
    offset `local % block_size`. With `block_size` a multiple of `interleave` this is the
    virtual-block form (one id per `block_size * cp_size` consecutive tokens, chunks round robin
    inside it); with pages smaller than the interleave a rank's consecutive pages hold one chunk.
    With `cp_size == 1` it is `(p // block_size, 0, p % block_size)`.
    """
    p = np.asarray(positions, dtype=np.int64)
    if cp_size == 1:
        return p // block_size, np.zeros_like(p), p % block_size
    local = (p // (interleave * cp_size)) * interleave + p % interleave
    return local // block_size, (p // interleave) % cp_size, local % block_size


def cp_block_span(first: int, stop: int, block_size: int, cp_size: int = 1, interleave: int = 1) -> tuple[int, int]:
    """Block-table indices `[lo, hi)` holding a token of positions `[first, stop)` on some CP rank
    (`(0, 0)` when empty): `hi` is how many ids a request of `stop` tokens needs, `lo` how many
    leading ids hold only tokens before `first` (a cached prefix, a sliding window's dropped part).

    Every rank's first and last token of the range lie within one round of `interleave * cp_size`
    positions of its ends, so only those are looked at."""
    if stop <= first:
        return 0, 0
    if cp_size == 1:
        return first // block_size, -(-stop // block_size)
    cycle = interleave * cp_size
    head = np.arange(first, min(stop, first + cycle), dtype=np.int64)
    tail = np.arange(max(first, stop - cycle), stop, dtype=np.int64)
    return (int(cp_slots(head, block_size, cp_size, interleave)[0].min()),
            int(cp_slots(tail, block_size, cp_size, interleave)[0].max()) + 1)
