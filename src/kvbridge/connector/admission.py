"""Decode-side admission: a request's destination blocks are its own while it is in flight.

Why: two in-flight requests whose destination block lists overlap both "succeed" while one
holds the other's bytes (the transfers race into the same memory); with the checksum on, the
failure names corruption, not the cause. The engine's allocator should never do this, so
kvbridge refuses it at `Consumer.receive`, with one line naming both requests and the blocks.

`BlockOwners` maps each written (group, block) to the request that owns it; `admit` and
`release` are O(blocks of the request). Blocks a prefix-cache hit covers
(`num_cached_tokens`) are not written, so two requests may share them; recurrent groups are
written whole. A block listed twice in one request is refused the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.errors import InvalidRequest

_SHIFT = 48  # key = group << 48 | block (block ids are < 2**40 on the wire)
_SHOWN = 8  # blocks named in a refusal


def written_blocks(block_ids: Sequence[Sequence[int]], num_cached_tokens: int, block_tokens: int | Sequence[int],
                   recurrent: Sequence[bool], skips: Sequence[int] | None = None) -> list[int]:
    """Keys of the blocks a transfer writes: full blocks under the cached prefix are skipped.

    `block_tokens`: tokens one block id covers (block size x CP size), one for all groups or one per group.
    `skips`: the leading ids of each group that hold only cached tokens, when given (pages smaller
    than a CP interleave: `EngineLayout.block_span`); they override `block_tokens`.
    """
    per = [block_tokens] * len(block_ids) if isinstance(block_tokens, int) else list(block_tokens)
    keys: list[int] = []
    for g, group in enumerate(block_ids):
        base = g << _SHIFT
        skip = skips[g] if skips is not None else max(0, int(num_cached_tokens)) // per[g]
        keys.extend(base | int(b) for b in (group if recurrent[g] else group[skip:]))
    return keys


def _describe(keys: list[int]) -> str:
    by_group: dict[int, list[int]] = {}
    for k in keys[:_SHOWN]:
        by_group.setdefault(k >> _SHIFT, []).append(k & ((1 << _SHIFT) - 1))
    text = "; ".join(f"group {g} block{'s' if len(bs) > 1 else ''} {', '.join(map(str, bs))}"
                     for g, bs in by_group.items())
    return text + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


class BlockOwners:
    """Which in-flight request owns each destination block of one decode rank."""

    def __init__(self, where: str = "this decode rank"):
        self.where = where
        self._owner: dict[int, str] = {}
        self._held: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def admit(self, request_id: str, keys: list[int]) -> None:
        """Own `keys` for `request_id`, or raise `InvalidRequest` naming the overlap (nothing kept)."""
        clashes: dict[str, list[int]] = {}
        seen: set[int] = set()
        twice: list[int] = []
        for k in keys:
            if k in seen:
                twice.append(k)
                continue
            seen.add(k)
            owner = self._owner.get(k)
            if owner is not None:
                clashes.setdefault(owner, []).append(k)
        if clashes:
            other, blocks = next(iter(clashes.items()))
            more = f" (and {len(clashes) - 1} other requests)" if len(clashes) > 1 else ""
            raise InvalidRequest(f"request {request_id!r} refused: its destination blocks overlap request {other!r}, "
                                 f"still in flight on {self.where}{more}: {_describe(blocks)}")
        if twice:
            raise InvalidRequest(f"request {request_id!r} refused: it lists destination blocks twice: "
                                 f"{_describe(twice)}")
        for k in keys:
            self._owner[k] = request_id
        self._held[request_id] = keys

    def release(self, request_id: str) -> None:
        """Give `request_id`'s blocks back (idempotent)."""
        for k in self._held.pop(request_id, ()):
            if self._owner.get(k) == request_id:
                del self._owner[k]


__all__ = ["BlockOwners", "written_blocks"]
