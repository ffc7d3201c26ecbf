"""The relay's re-chunking (issue 45.1): for instances of any block size, what it announces in
canonical blocks is exactly the whole canonical blocks the instance holds, named alike on every
instance; never a block the instance does not hold."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.routing.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvbridge.routing.rechunk import Rechunker, canonical_hash


class Instance:
    """A vLLM-like prefix cache of one block size that emits vLLM's events (block hashes chained
    over (parent, tokens, extra keys); the salt on a prompt's first block only)."""

    def __init__(self, block: int):
        self.block = block
        self.cached: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
        self.history: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}  # every block ever stored

    def _hash(self, parent, tokens, extra) -> bytes:
        return hashlib.sha256(repr((parent, tokens, extra)).encode()).digest()

    def store(self, prompt: list[int], salt: str | None = None, lora: str | None = None) -> list:
        B, parent, new, events = self.block, None, [], []
        for i in range(len(prompt) // B):
            toks = tuple(prompt[i * B:(i + 1) * B])
            extra = tuple(x for x in (lora, salt if i == 0 else None) if x) or None
            h = self._hash(parent, toks, extra)
            if h in self.cached:
                if new:
                    events.append(self._event(new, lora))
                    new = []
            else:
                new.append((h, parent, toks, extra))
                self.cached[h] = self.history[h] = (parent, toks)
            parent = h
        if new:
            events.append(self._event(new, lora))
        return events

    def _event(self, new, lora) -> BlockStored:
        return BlockStored(block_hashes=[h for h, *_ in new], parent_block_hash=new[0][1],
                           token_ids=[t for *_, toks, _ in new for t in toks], block_size=self.block, lora_id=None,
                           medium="GPU", lora_name=lora, extra_keys=[x for *_, x in new])

    def remove(self, hashes: list[bytes]) -> list:
        for h in hashes:
            self.cached.pop(h, None)
        return [BlockRemoved(block_hashes=list(hashes), medium="GPU")]

    def leaves(self) -> list[bytes]:
        parents = {p for p, _ in self.cached.values()}
        return [h for h in self.cached if h not in parents]

    def held_prefixes(self) -> list[tuple[int, ...]]:
        """Every cached chain whose blocks are all cached back to its first, as its tokens."""
        out = []
        for h in self.cached:
            toks, cur = [], h
            while cur is not None and cur in self.cached:
                parent, t = self.cached[cur]
                toks[:0] = t
                cur = parent
            if cur is None:
                out.append(tuple(toks))
        return out


def names(prompt, C, salt=None, lora=None) -> dict[bytes, tuple[int, ...]]:
    """The canonical names of every whole canonical block of `prompt` (the reference)."""
    out, parent = {}, None
    for k in range(len(prompt) // C):
        chunk = tuple(prompt[k * C:(k + 1) * C])
        parent = canonical_hash(parent, chunk, (lora, salt if k == 0 else None, ()))
        out[parent] = chunk
    return out


class Index:
    """What a router learns from the relay: announced canonical blocks and their tokens."""

    def __init__(self):
        self.blocks: dict[bytes, tuple[int, ...]] = {}

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                C = e.block_size
                for i, h in enumerate(e.block_hashes):
                    assert h not in self.blocks, "a block announced twice without a removal"
                    self.blocks[h] = tuple(e.token_ids[i * C:(i + 1) * C])
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert h in self.blocks, "a removal of a block never announced"
                    del self.blocks[h]
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()


def expected(instance: Instance, C: int, **identity) -> dict[bytes, tuple[int, ...]]:
    """Whole canonical blocks of chains held from their first block."""
    out = {}
    for prefix in instance.held_prefixes():
        held = len(prefix) // instance.block * instance.block
        out.update(names(list(prefix[:held]), C, **identity))
    return out


def covered(instance: Instance, C: int) -> dict[bytes, tuple[int, ...]]:
    """Canonical blocks every instance block of which is held (earlier blocks of the chain may be
    gone: a router's longest-prefix score stops at the first withdrawn one anyway)."""
    out = {}
    for h in instance.cached:
        chain, cur = [], h
        while cur is not None:
            chain.insert(0, cur)
            cur = instance.history[cur][0]
        tokens = [t for c in chain for t in instance.history[c][1]]
        B = instance.block
        for name, k in zip(names(tokens, C), range(len(tokens) // C)):
            if all(chain[j] in instance.cached for j in range(k * C // B, ((k + 1) * C - 1) // B + 1)):
                out[name] = tuple(tokens[k * C:(k + 1) * C])
    return out


prompts = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=40), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(prompts, st.sampled_from([1, 2, 3, 4, 8, 16]), st.sampled_from([1, 2, 3, 4, 5, 8, 16]),
       st.booleans())
def test_announces_exactly_the_whole_canonical_blocks_held(ps, B, C, shared):
    if shared:  # prompts that share prefixes, as a chat does
        ps = [ps[0][: len(ps[0]) * (i + 1) // len(ps)] + p[:3] for i, p in enumerate(ps)]
    inst, relay, index = Instance(B), Rechunker(C), Index()
    for p in ps:
        index.apply(relay.apply(inst.store(p)))
        assert index.blocks == expected(inst, C)


@settings(max_examples=150, deadline=None)
@given(prompts, st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 3, 4, 8]), st.data())
def test_removals_withdraw_and_never_leave_a_block_not_held(ps, B, C, data):
    inst, relay, index = Instance(B), Rechunker(C), Index()
    for p in ps:
        index.apply(relay.apply(inst.store(p)))
        while inst.cached and data.draw(st.booleans()):
            leaves_only = data.draw(st.booleans())
            pool = inst.leaves() if leaves_only else list(inst.cached)
            gone = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
            index.apply(relay.apply(inst.remove(gone)))
            assert index.blocks.items() <= covered(inst, C).items()  # never a block the instance lost
    assert index.blocks.items() <= covered(inst, C).items()


@settings(max_examples=150, deadline=None)
@given(prompts, st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 3, 4, 8]), st.data())
def test_leaf_first_eviction_then_the_same_prompts_again_is_exact(ps, B, C, data):
    """vLLM evicts a chain from its tail; what a later request stores again is announced again."""
    inst, relay, index = Instance(B), Rechunker(C), Index()
    for p in ps:
        index.apply(relay.apply(inst.store(p)))
    for _ in range(data.draw(st.integers(0, 6))):
        if inst.cached:
            index.apply(relay.apply(inst.remove([data.draw(st.sampled_from(inst.leaves()))])))
            assert index.blocks == expected(inst, C)
    for p in ps:
        index.apply(relay.apply(inst.store(p)))
    assert index.blocks == expected(inst, C)


@settings(max_examples=100, deadline=None)
@given(prompts, st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([2, 4, 8]))
def test_instances_of_other_block_sizes_announce_the_same_names(ps, B1, B2, C):
    a, b = (Instance(B1), Rechunker(C), Index()), (Instance(B2), Rechunker(C), Index())
    for inst, relay, index in (a, b):
        for p in ps:
            index.apply(relay.apply(inst.store(p)))
    common = expected(a[0], C).keys() & expected(b[0], C).keys()
    assert common <= a[2].blocks.keys() and common <= b[2].blocks.keys()


def test_tenants_and_adapters_never_share_a_name():
    p = list(range(64))
    seen = []
    for salt, lora in ((None, None), ("tenant-a", None), ("tenant-b", None), (None, "adapter")):
        inst, relay, index = Instance(16), Rechunker(32), Index()
        index.apply(relay.apply(inst.store(p, salt=salt, lora=lora)))
        assert index.blocks == names(p, 32, salt=salt, lora=lora)
        seen.append(set(index.blocks))
    assert all(not (x & y) for i, x in enumerate(seen) for y in seen[i + 1:])


def test_a_chain_whose_start_was_never_seen_announces_nothing_until_stored_again():
    inst, index = Instance(4), Index()
    early = inst.store(list(range(8)))            # the relay starts after these
    relay = Rechunker(8)
    index.apply(relay.apply(inst.store(list(range(16)))))  # parent known to vLLM, not to the relay
    assert index.blocks == {}
    inst.remove([h for e in early for h in e.block_hashes])
    index.apply(relay.apply(inst.remove([])))
    index.apply(relay.apply(inst.store(list(range(16)))))  # the start again: announced
    assert index.blocks.keys() <= expected(inst, 8).keys() and index.blocks


def test_memory_is_bounded_and_forgetting_withdraws():
    inst, relay, index = Instance(2), Rechunker(4, max_blocks=50), Index()
    for s in range(40):
        index.apply(relay.apply(inst.store([s] * 2 + list(range(30)))))
        assert len(relay) <= 50
        assert index.blocks.items() <= covered(inst, 4).items()
    assert relay.forgotten > 0


def test_all_blocks_cleared_clears():
    inst, relay, index = Instance(4), Rechunker(4), Index()
    index.apply(relay.apply(inst.store(list(range(12)))))
    assert index.blocks
    index.apply(relay.apply([AllBlocksCleared()]))
    assert not index.blocks and len(relay) == 0


def test_expire_withdraws_what_was_not_stored_again_within_the_ttl():
    now = [0.0]
    inst, relay, index = Instance(8), Rechunker(4, clock=lambda: now[0]), Index()
    index.apply(relay.apply(inst.store(list(range(16)))))
    now[0] = 5.0
    index.apply(relay.apply(inst.store([9] * 16)))
    now[0] = 12.0
    index.apply(relay.expire(10.0))  # the first prompt's blocks are 12 s old, the second's 7 s
    assert index.blocks == names([9] * 16, 4)
    now[0] = 30.0
    index.apply(relay.expire(10.0))
    assert index.blocks == {} and len(relay) == 0


@settings(max_examples=100, deadline=None)
@given(prompts, st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 3, 4, 8]), st.data())
def test_a_snapshot_tells_a_late_subscriber_exactly_what_is_announced(ps, B, C, data):
    inst, relay, index = Instance(B), Rechunker(C), Index()
    for p in ps:
        index.apply(relay.apply(inst.store(p)))
        if inst.cached and data.draw(st.booleans()):
            index.apply(relay.apply(inst.remove([data.draw(st.sampled_from(inst.leaves()))])))
    late = Index()
    late.apply(relay.snapshot())
    assert late.blocks == index.blocks


def test_a_chain_whose_start_was_unseen_keeps_no_tail_and_is_anchored_once_stored_whole():
    inst, index = Instance(8), Index()
    early = inst.store(list(range(8)))  # the relay never sees the first block
    relay = Rechunker(16)
    for k in range(2, 200):  # a long unanchored chain: constant memory per block
        index.apply(relay.apply(inst.store(list(range(8 * k)))))
    assert all(not n.tail for t in relay._tables.values() for n in t.values())
    assert index.blocks == {}
    again = Instance(8)  # vLLM computing the chain anew from its first block stores every block again
    index.apply(relay.apply(again.store(list(range(8 * 199)))))
    assert index.blocks == expected(again, 16)


def test_one_huge_block_is_cut_in_linear_time():
    import time
    inst, relay, index = Instance(1 << 16), Rechunker(16), Index()
    t0 = time.perf_counter()
    index.apply(relay.apply(inst.store(list(range(1 << 16)))))
    assert len(index.blocks) == 4096 and time.perf_counter() - t0 < 30  # quadratic cutting took minutes


def test_mediums_and_groups_beyond_the_bound_are_ignored():
    from kvbridge.routing.rechunk import MAX_TABLES

    relay = Rechunker(4)
    for m in range(MAX_TABLES + 10):
        relay.apply([BlockStored(block_hashes=[m], parent_block_hash=None, token_ids=[1] * 4, block_size=4, lora_id=None,
                                 medium=f"m{m}", lora_name=None)])
    assert len(relay._tables) == MAX_TABLES
    for m in range(MAX_TABLES):  # a medium whose blocks all went takes no room
        relay.apply([BlockRemoved(block_hashes=[m], medium=f"m{m}")])
    assert not relay._tables and not relay._live and not relay._canon
