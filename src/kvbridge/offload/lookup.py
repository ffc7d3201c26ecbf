"""How many of a request's offloaded blocks can be loaded: the per-group hit rules.

A full-attention group needs every block of the prefix (maximal-prefix rule). A sliding-window
group only needs the last `window` offloaded blocks before the hit point, so its rule looks for
the rightmost run of `window` consecutive hits (or, failing that, hits reaching back to block 0).
A per-key lookup may answer None ("retry later"); the result is then None so the scheduler asks
again. `request_hits` combines the groups: every group has to cover the same number of tokens,
so a shorter hit in one group shrinks the others until nothing changes. A recurrent group needs
only the checkpoint at the hit point: a window of one token, so one block (`group_windows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbridge.core.spec import ModelSpec
from kvbridge.offload.policy import Key
from kvbridge.offload.spec import cdiv

LookupFn = Callable[[Key], "bool | None"]


def prefix_hits(keys: Sequence[Key], lookup: LookupFn) -> int | None:
    """Leading hits; a None counts as a hit for the scan but defers the result; a miss stops it."""
    hits, deferred = 0, False
    for key in keys:
        found = lookup(key)
        if found is None:
            deferred = True
        elif not found:
            break
        hits += 1
    return None if deferred else hits


def window_hits(keys: Sequence[Key], lookup: LookupFn, window: int) -> int | None:
    """End index of the rightmost run of `window` hits, else the hits that reach back to index 0.

    A None counts as a miss and defers the result.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1 offloaded block, got {window}")
    run, deferred = 0, False
    for i in range(len(keys) - 1, -1, -1):
        found = lookup(keys[i])
        if found:
            run += 1
            if run == window:
                return None if deferred else i + window
        else:
            deferred |= found is None
            run = 0
    return None if deferred else run


def group_windows(spec: ModelSpec) -> list[int | None]:
    """`request_hits`' windows of a model: None for full attention, the window for sliding groups,
    1 token for recurrent ones (the state at the hit point is one block, the last)."""
    return [1 if spec.group_layer(g).is_recurrent else spec.group_layer(g).window for g in range(len(spec.groups))]


def request_hits(keys_per_group: Sequence[Sequence[Key]], windows: Sequence[int | None],
                 block_tokens: int | Sequence[int], num_tokens: int, lookup: LookupFn,
                 num_computed_tokens: int = 0) -> int | None:
    """Tokens of a request that the offloaded blocks of *every* group can supply, or None to retry.

    `windows[g]` is None for a full-attention group and the sliding window in tokens otherwise
    (a recurrent group 1 token's worth: its one checkpoint at the hit, see `group_windows`).
    `block_tokens` is the offloaded block size, one for all groups or one per group (groups of
    12- and 16-token blocks): each group's hits are counted in its own blocks and the hit shrinks
    to what every group covers.
    Full groups are looked up first, then sliding ones, repeating until the hit count is stable.
    Returns 0 when fewer than one (smallest) offloaded block of new tokens would be loaded.
    """
    if len(keys_per_group) != len(windows):
        raise ValueError(f"{len(keys_per_group)} key lists for {len(windows)} groups")
    sizes = [block_tokens] * len(windows) if isinstance(block_tokens, int) else list(block_tokens)
    if len(sizes) != len(windows) or min(sizes, default=1) < 1:
        raise ValueError(f"need one block size >= 1 per group ({len(windows)}), got {block_tokens}")
    smallest = min(sizes, default=1)
    max_hit = num_tokens - (1 if any(w is not None for w in windows) else 0)
    order = sorted(range(len(windows)), key=lambda g: windows[g] is not None)
    deferred = False
    while True:
        before = max_hit
        for g in order:
            size, keys = sizes[g], keys_per_group[g]
            start = num_computed_tokens // size
            max_hit = min(max_hit, len(keys) * size)
            stop = min(cdiv(max_hit, size), len(keys))
            span = keys[start:stop] if stop > start else []
            w = windows[g]
            hits = prefix_hits(span, lookup) if w is None else window_hits(span, lookup, cdiv(w, size))
            if hits is None:
                deferred, hits = True, len(span)
            max_hit = min(max_hit, size * (start + hits))
            if max_hit - num_computed_tokens < smallest:
                return None if deferred else 0
        if max_hit == before:
            break
    return None if deferred else max_hit


__all__ = ["LookupFn", "group_windows", "prefix_hits", "request_hits", "window_hits"]
