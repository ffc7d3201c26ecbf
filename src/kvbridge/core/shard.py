"""How TP ranks split KV heads, and which source rank serves each head a destination needs.

Heads are split into contiguous intervals. When TP exceeds the head count each rank holds one
head and consecutive ranks share it (ranks 0,1 -> head 0 ...), as vLLM partitions GQA weights.
TP equal to the head count is sharding, not replication. MLA state is whole on every rank.
These rules are the single source for the topology (what vLLM calls tp_ratio, replication,
source ranks) and for the planner (which bytes to read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

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
                     replicated: bool = False) -> int:
    """The source rank a destination rank reads `head` from, spreading reads over replicas.

    Follows vLLM's current read plan where vLLM defines one: the rank `floor(r*P/D)` when it
    holds the head, else the first holder among the destination's overlapping ranks (its GQA
    dedup), else a replica picked by destination rank so that readers spread out.
    """
    owners = holders(num_heads, src_tp, head, replicated)
    first = dst_rank * src_tp // dst_tp
    if first in owners:
        return first
    for q in overlapping_ranks(dst_tp, dst_rank, src_tp):
        if q in owners:
            return q
    return owners[dst_rank % len(owners)]


def assign_sources(num_heads: int, src_tp: int, dst_tp: int, dst_rank: int,
                   replicated: bool = False) -> tuple[HeadSlice, ...]:
    """Split the heads `dst_rank` needs into contiguous slices, each read from one source rank."""
    start, stop = head_range(num_heads, dst_tp, dst_rank, replicated)
    slices: list[HeadSlice] = []
    for h in range(start, stop):
        q = preferred_holder(num_heads, src_tp, dst_tp, dst_rank, h, replicated)
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
