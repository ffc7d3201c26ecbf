"""Say each request's outcome to an engine once.

vLLM frees a request when told its load ended (at once, if it was aborted after being told) and
asserts on a second report for it, which kills the engine. A load can end twice on kvbridge's
side: it times out, and the engine then abandons the request, which the consumer reports again.
`OnceEach` remembers the recent ids it passed (bounded: a repeat comes within seconds, never
after tens of thousands of other requests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

MAX_REMEMBERED = 1 << 16


class OnceEach:
    def __init__(self, limit: int = MAX_REMEMBERED):
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit, self._seen = limit, OrderedDict[Hashable, None]()

    def first(self, key: Hashable) -> bool:
        """True the first time `key` is offered (within the last `limit` keys), False after."""
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._seen)


__all__ = ["MAX_REMEMBERED", "OnceEach"]
