"""Upper bounds on what a peer's Hello may declare, checked before any work depends on it.

Why: a Hello is a handful of integers that size everything after it. The topology's reader and
source sets, the plans and the per-rank bookkeeping are O(peer TP size x layers), so one Hello
claiming TP 1,000,000 made a prefill rank spend ~10 s (and a GB) per request before this check.
The schema (`messages`) bounds every field's type and the frame's size; this module bounds the
numbers by what real deployments use, with headroom, and refuses the Hello in microseconds.

The bounds (documented in docs/security.md):

* every parallel size of the layout (TP today, and any `*_size` axis a layout grows): at most
  `MAX_PARALLEL_SIZE` (the largest published single-engine TP is 64: 8 nodes x 8 GPUs), and all
  ranks together (TP x PCP x PP) at most `MAX_WORLD_SIZE`;
* tokens per block at most `MAX_BLOCK_TOKENS` (vLLM uses 16..256; Mamba-style hybrid pages 1k-2k);
* blocks per rank at most `MAX_BLOCKS` (the wire's block-id bound is 2**40; a 2**31-block cache
  of even one byte per block is 2 GiB of metadata alone);
* transport metadata at most `MAX_TRANSPORT_METADATA` bytes, rank addresses at most one per rank.
"""

from __future__ import annotations

import msgspec

from kvbridge.connector.messages import HandshakeRefused, Hello

MAX_PARALLEL_SIZE = 256
MAX_WORLD_SIZE = 4096  # ranks of one engine (TP x PCP x PP): 512 nodes of 8 GPUs
MAX_BLOCK_TOKENS = 1 << 16
MAX_BLOCKS = 1 << 31
MAX_TRANSPORT_METADATA = 512 << 10


def check_hello_bounds(peer: Hello) -> None:
    """Raise `HandshakeRefused` (one line naming the field and its bound) for an absurd Hello."""
    who = f"remote {peer.engine_id!r} rank {peer.rank}"
    layout = peer.layout
    for field in msgspec.structs.fields(layout):
        value = getattr(layout, field.name)
        if field.name.endswith("_size") and field.name not in ("block_size", "kernel_block_size") \
                and isinstance(value, int) and not 1 <= value <= MAX_PARALLEL_SIZE:
            raise HandshakeRefused(f"{who} declares {field.name} {value}: the bound is {MAX_PARALLEL_SIZE}")
    for name in ("block_size", "kernel_block_size"):
        value = getattr(layout, name, None)
        if isinstance(value, int) and not 1 <= value <= MAX_BLOCK_TOKENS:
            raise HandshakeRefused(f"{who} declares {name} {value}: the bound is {MAX_BLOCK_TOKENS} tokens")
    if layout.group_cp_interleaves:  # derived for a row layout only; an engine has one interleave
        raise HandshakeRefused(f"{who} declares per-group CP interleaves {list(layout.group_cp_interleaves)[:8]}: an "
                               f"engine has one (cp_interleave)")
    if layout.world_size > MAX_WORLD_SIZE:
        raise HandshakeRefused(f"{who} declares {layout.world_size} ranks: the bound is {MAX_WORLD_SIZE}")
    if not 1 <= layout.num_blocks <= MAX_BLOCKS:
        raise HandshakeRefused(f"{who} declares {layout.num_blocks} blocks per rank: the bound is {MAX_BLOCKS}")
    if not peer.rank < layout.world_size:
        raise HandshakeRefused(f"{who} claims rank {peer.rank} of an engine of {layout.describe_ranks()}")
    if len(peer.transport_metadata) > MAX_TRANSPORT_METADATA:
        raise HandshakeRefused(f"{who} sent {len(peer.transport_metadata)} bytes of transport metadata: the bound "
                               f"is {MAX_TRANSPORT_METADATA}")
    if len(peer.peer_addresses) > layout.world_size:
        raise HandshakeRefused(f"{who} lists {len(peer.peer_addresses)} rank addresses for an engine of "
                               f"{layout.describe_ranks()}")


__all__ = ["MAX_BLOCKS", "MAX_BLOCK_TOKENS", "MAX_PARALLEL_SIZE", "MAX_TRANSPORT_METADATA", "MAX_WORLD_SIZE", "check_hello_bounds"]
