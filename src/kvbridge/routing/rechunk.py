"""One instance's KV events in a canonical block size, re-chunked by token ids.

Why: a router that scores instances by their KV events (vllm-router's `kv_aware`) takes one block
size, and a kvbridge fleet's instances have different ones by design. A prefix is the same
tokens whatever the block size, so the relay follows each instance's chains of stored blocks
(`parent_block_hash`) by their token ids and announces, in canonical blocks of C tokens, exactly
the whole canonical blocks that the instance holds every token of: a canonical block that
straddles two of the instance's blocks is announced once both are stored, and withdrawn as soon as
either is removed. Never more than the instance holds: a chain whose start the relay never saw (it
started later, or forgot it) announces nothing until the instance stores its first block again.

Canonical keys. Block k of a prefix is named by a hash of (block k-1's name, its C token ids, its
identity): the LoRA name and the `cache_salt` (vLLM puts the salt on a prompt's first block, so
it is carried down the chain), and the multimodal identifiers and prompt-embeds digests of the
instance blocks it overlaps (offsets dropped). Two instances holding the same prefix under the
same identity therefore announce the same names, whatever their block sizes, and tenants with
different salts never do. A block whose instance blocks carry multimodal keys may get another
name on an instance of another block size (its overlap differs): a missed credit, never a false
one.

Bounds: at most `max_blocks` instance blocks are remembered per instance (oldest forgotten
first, its canonical blocks withdrawn), and every event was bounded by `events.decode_batch`.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.routing.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, hash_key

CanonicalHash = Callable[[bytes | None, Sequence[int], tuple[Any, ...]], bytes]
DEFAULT_MAX_BLOCKS = 1 << 18
MAX_MARKS = 32
"""Extra keys of one block taken into its canonical name (vLLM's: a LoRA name, a salt, a few images)."""
MAX_TABLES = 16
"""(medium, KV-cache group) pairs one instance may use; events of others are ignored."""


def canonical_hash(parent: bytes | None, tokens: Sequence[int], identity: tuple[Any, ...]) -> bytes:
    """The relay's name of a canonical block (32 bytes, as vLLM's sha256 names are)."""
    h = hashlib.blake2b(digest_size=32, person=b"kvb-kv-route")
    h.update(parent or b"\0" * 32)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(repr(identity).encode())
    return h.digest()


@dataclass
class _Node:
    """One instance block the relay follows."""

    end: int                 # tokens of the prefix up to and including this block
    anchored: bool           # the chain is known from its first token
    identity: tuple          # (lora name, cache salt) of the chain
    marks: tuple             # this block's multimodal / prompt-embeds keys
    last_canon: bytes | None  # name of the last whole canonical block ending at or before `end`
    tail: list[tuple[bytes, list[int], int]]  # (instance block, its tokens, first not yet cut) after that
    # boundary: fewer than C tokens between blocks; empty on an unanchored chain (it announces nothing)
    contributes: list[list] = field(default_factory=list)  # [name, alive] of each canonical block it is in
    stamp: float = 0.0  # when it was last stored or extended (`expire`)


def _split_extra(extra: tuple[Any, ...] | None, lora: str | None) -> tuple[str | None, tuple]:
    """(cache salt, other keys) of one block's untagged extra keys (`to_event_extra_keys`): a string
    that is not the LoRA name is the salt; pairs are multimodal (identifier, offset); bytes are
    prompt-embeds digests."""
    salt, marks = None, []
    for k in (extra or ())[:MAX_MARKS]:
        if isinstance(k, str):
            if k != lora:
                salt = k if len(k) <= 64 else hashlib.blake2b(k.encode(), digest_size=32).hexdigest()
        elif isinstance(k, (list, tuple)) and k:
            marks.append(("mm", _short(k[0])))
        else:
            marks.append(("x", _short(k)))
    return salt, tuple(marks)


def _short(value: Any) -> str:
    """A bounded stand-in for a key of any size (an untrusted peer chooses it)."""
    text = value if isinstance(value, str) else repr(value)[:4096]
    return text if len(text) <= 64 else hashlib.blake2b(text.encode(errors="replace"), digest_size=32).hexdigest()


class Rechunker:
    """Turns one instance's events into canonical events (see the module)."""

    def __init__(self, block_tokens: int, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 hasher: CanonicalHash = canonical_hash, clock: Callable[[], float] = time.monotonic):
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError(f"canonical block size and max blocks must be >= 1, got {block_tokens}, {max_blocks}")
        self.block_tokens, self.max_blocks, self.hasher, self.clock = block_tokens, max_blocks, hasher, clock
        # (medium, group) -> instance block key -> node, oldest first
        self._tables: dict[tuple, OrderedDict[bytes, _Node]] = {}
        # announced canonical blocks per (medium, group), with how many chains hold each (two chains
        # may share a canonical block: a prompt's first C tokens under two instance block sizes of
        # one... or two prompts alike for C tokens and apart within the instance's first block)
        self._live: dict[tuple, Counter[bytes]] = {}
        # each announced canonical block as announced (parent first: a parent completes before its
        # children), to tell a subscriber that joins late what the instance holds (`snapshot`)
        self._canon: dict[tuple, dict[bytes, BlockStored]] = {}
        self.forgotten = 0

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables.values())

    def apply(self, events: Sequence[Event]) -> list[Event]:
        """The canonical events that `events` (one batch of the instance's, in order) make."""
        out: list[Event] = []
        for e in events:
            if isinstance(e, BlockStored):
                self._stored(e, out)
            elif isinstance(e, BlockRemoved):
                self._removed(e, out)
            elif isinstance(e, AllBlocksCleared):
                self.clear()
                out.append(AllBlocksCleared())
        return out

    def clear(self) -> None:
        self._tables.clear()
        self._live.clear()
        self._canon.clear()

    # -- stores ------------------------------------------------------------------------------------------
    def _stored(self, e: BlockStored, out: list[Event]) -> None:
        where = (e.medium, e.group_idx)
        if where not in self._tables and len(self._tables) >= MAX_TABLES:
            return
        table = self._tables.setdefault(where, OrderedDict())
        live = self._live.setdefault(where, Counter())
        canon = self._canon.setdefault(where, {})
        B, C = e.block_size, self.block_tokens
        parent = None if e.parent_block_hash is None else table.get(hash_key(e.parent_block_hash))
        now = self.clock()
        if parent is not None:
            table.move_to_end(hash_key(e.parent_block_hash))
            parent.stamp = now
        hashes: list[bytes] = []
        tokens: list[int] = []
        extras: list[tuple | None] = []
        first_parent: bytes | None = None
        for i, h in enumerate(e.block_hashes):
            key = hash_key(h)
            block = e.token_ids[i * B:(i + 1) * B]
            salt, marks = _split_extra(e.extra_keys[i] if e.extra_keys else None, e.lora_name)
            if parent is None:  # a chain's first block (or one whose start the relay never saw)
                root = e.parent_block_hash is None and i == 0
                node = _Node(B, root, (e.lora_name, salt), marks, None, [])
            else:
                node = _Node(parent.end + B, parent.anchored, parent.identity, marks, parent.last_canon,
                             list(parent.tail) if parent.anchored else [])
            known = table.get(key)
            if known is not None and (known.anchored or not node.anchored):  # stored again: keep what is known
                parent = known
                parent.stamp = now
                table.move_to_end(key)
                continue
            if known is not None:  # known only from a chain whose start was unseen: now it is anchored
                del table[key]
                gone = _withdraw(known, live, canon)
                if gone:
                    out.append(BlockRemoved(block_hashes=gone, medium=e.medium, group_idx=e.group_idx))
            node.stamp = now
            if node.anchored:
                node.tail.append((key, block, 0))
            while node.anchored and sum(len(t) - at for _, t, at in node.tail) >= C:
                prev = node.last_canon
                made = self._complete(key, node, table, live)
                if made is None:
                    break
                name, chunk, ident = made
                if live[name] == 1:
                    canon[name] = BlockStored(block_hashes=[name], parent_block_hash=prev, token_ids=chunk,
                                              block_size=C, lora_id=None, medium=e.medium, lora_name=e.lora_name,
                                              extra_keys=None if ident is None else [ident], group_idx=e.group_idx)
                if live[name] > 1:  # already announced through another chain
                    if hashes:  # what is announced so far is one chain: close it
                        out.append(self._event(e, hashes, tokens, extras, first_parent))
                        hashes, tokens, extras = [], [], []
                    continue
                if not hashes:
                    first_parent = prev
                hashes.append(name)
                tokens += chunk
                extras.append(ident)
            table[key] = node
            parent = node
        if hashes:
            out.append(self._event(e, hashes, tokens, extras, first_parent))
        while len(self) > self.max_blocks:
            self._forget_oldest(out)

    def _event(self, e: BlockStored, hashes: list[bytes], tokens: list[int], extras: list, parent: bytes | None
               ) -> BlockStored:
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=self.block_tokens,
                           lora_id=None, medium=e.medium, lora_name=e.lora_name,
                           extra_keys=extras if any(x is not None for x in extras) else None, group_idx=e.group_idx)

    def _complete(self, key: bytes, node: _Node, table: OrderedDict[bytes, _Node], live: Counter[bytes]
                  ) -> tuple[bytes, list[int], tuple | None] | None:
        """Cut the next canonical block off the tail of `node` (instance block `key`): its (name,
        tokens, event extra keys), the node's last name and tail moved on; None, and the node
        unanchored, when an instance block it spans is gone."""
        C = self.block_tokens
        chunk: list[int] = []
        parts: list[bytes] = []
        rest = list(node.tail)
        while len(chunk) < C:  # by offsets: a long block is cut in O(C) per canonical block
            part, toks, at = rest[0]
            take = min(C - len(chunk), len(toks) - at)
            chunk += toks[at:at + take]
            parts.append(part)
            if at + take < len(toks):
                rest[0] = (part, toks, at + take)
            else:
                rest.pop(0)
        owners = []
        for part in dict.fromkeys(parts):
            owner = node if part == key else table.get(part)
            if owner is None:
                node.anchored = False
                return None
            owners.append(owner)
        first = node.last_canon is None
        lora, salt = node.identity[0], node.identity[1] if first else None
        marks = tuple(dict.fromkeys(m for owner in owners for m in owner.marks))
        name = self.hasher(node.last_canon, chunk, (lora, salt, marks))
        made = [name, True]
        for owner in owners:
            owner.contributes.append(made)
            if len(owner.contributes) % 64 == 0:  # a long-lived parent: drop what was withdrawn since
                owner.contributes = [m for m in owner.contributes if m[1]]
        live[name] += 1
        node.last_canon, node.tail = name, rest
        return name, chunk, tuple(x for x in (lora, salt) if x) or None

    # -- removals ----------------------------------------------------------------------------------------
    def _removed(self, e: BlockRemoved, out: list[Event]) -> None:
        where = (e.medium, e.group_idx)
        table, live = self._tables.get(where), self._live.get(where)
        if not table or live is None:
            return
        gone: list[bytes] = []
        for h in e.block_hashes:
            node = table.pop(hash_key(h), None)
            if node is not None:
                gone += _withdraw(node, live, self._canon[where])
        if gone:
            out.append(BlockRemoved(block_hashes=gone, medium=e.medium, group_idx=e.group_idx))
        self._prune(where)

    def _prune(self, where: tuple) -> None:
        """A (medium, group) whose last block went takes no room."""
        if not self._tables.get(where):
            for d in (self._tables, self._live, self._canon):
                d.pop(where, None)

    def snapshot(self) -> list[Event]:
        """Every canonical block announced and not withdrawn, one event each, parents before their
        children (a parent withdrawn and announced again comes after its children in announcement
        order): what a subscriber that joined late (a restarted router) needs to know the instance."""
        out: list[Event] = []
        for canon in self._canon.values():
            depth: dict[bytes, int] = {}
            for name in canon:
                path, cur = [], name
                while cur in canon and cur not in depth:  # up to a known depth or a parent not announced
                    path.append(cur)
                    parent = canon[cur].parent_block_hash
                    cur = parent if isinstance(parent, bytes) else b""
                d = depth.get(cur, -1)
                for n in reversed(path):
                    d += 1
                    depth[n] = d
            out += sorted(canon.values(), key=lambda ev: depth[ev.block_hashes[0]])
        return out

    def expire(self, older_than_s: float) -> list[Event]:
        """Forget blocks not stored (or stored again) for `older_than_s` seconds, withdrawing their
        canonical blocks: for a source that never says what it lost (a pool whose store evicts
        silently), an announcement lasts that long unless renewed."""
        out: list[Event] = []
        cutoff = self.clock() - older_than_s
        for where, table in self._tables.items():
            gone: list[bytes] = []
            while table:
                key, node = next(iter(table.items()))
                if node.stamp >= cutoff:
                    break
                del table[key]
                gone += _withdraw(node, self._live[where], self._canon[where])
            if gone:
                out.append(BlockRemoved(block_hashes=gone, medium=where[0], group_idx=where[1]))
        for where in [w for w, t in self._tables.items() if not t]:
            self._prune(where)
        return out

    def _forget_oldest(self, out: list[Event]) -> None:
        """The block stored (or extended) longest ago, of whichever (medium, group) it is."""
        where = min((w for w, t in self._tables.items() if t), key=lambda w: next(iter(self._tables[w].values())).stamp)
        _, node = self._tables[where].popitem(last=False)
        self.forgotten += 1
        gone = _withdraw(node, self._live[where], self._canon[where])
        if gone:
            out.append(BlockRemoved(block_hashes=gone, medium=where[0], group_idx=where[1]))
        self._prune(where)


def _withdraw(node: _Node, live: Counter[bytes], canon: dict[bytes, BlockStored]) -> list[bytes]:
    """Canonical blocks no chain holds once `node` is gone (each completion it is part of ends)."""
    gone = []
    for made in node.contributes:
        if made[1]:
            made[1] = False
            live[made[0]] -= 1
            if not live[made[0]]:
                del live[made[0]]
                canon.pop(made[0], None)
                gone.append(made[0])
    return gone


__all__ = ["DEFAULT_MAX_BLOCKS", "CanonicalHash", "Rechunker", "canonical_hash"]
