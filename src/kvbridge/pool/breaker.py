"""A circuit breaker in front of the store: the pool is a cache, never a dependency.

Why: a master that is down costs Mooncake 90 s of retries per new client, and one that hangs
(SIGSTOP, a dead host) blocks every call without a deadline. An engine must not pay that per
request. Closed, calls go through. A failure (an error, or no answer by the caller's deadline)
opens the breaker: calls are skipped, so the pool is a miss, until the backoff has passed. Then
one probe goes through (half-open). Its success closes the breaker; its failure opens it again
for twice as long, up to `max_backoff_s`. The first failure and the recovery are logged once
each, not once per request. Thread-safe: the engine thread asks, the pool thread reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, PROBING = "closed", "open", "probing"


class Breaker:
    """See the module. `on_change(state, why)` is called on every change of state (for the log)."""

    def __init__(self, base_backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 on_change: Callable[[str, str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        if not 0 < base_backoff_s <= max_backoff_s:
            raise ValueError(f"backoff must satisfy 0 < base <= max, got {base_backoff_s}, {max_backoff_s}")
        self.base, self.max = base_backoff_s, max_backoff_s
        self._on_change, self._clock = on_change, clock
        self._lock = threading.Lock()
        self.state = CLOSED
        self.backoff = 0.0
        self.retry_at = 0.0
        self.failures = 0
        self.last_error = ""

    def allow(self) -> bool:
        """Whether a call may go to the store now (an open breaker past its backoff lets one probe by)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            now = self._clock()
            # A probe whose answer never came (its caller gave up without reporting) is replaced.
            if (self.state == OPEN and now >= self.retry_at) or (self.state == PROBING and now >= self.retry_at + self.max):
                self.state, self.retry_at = PROBING, now
                return True
            return False

    def success(self) -> None:
        with self._lock:
            changed = self.state != CLOSED
            self.state, self.backoff = CLOSED, 0.0
        if changed and self._on_change:
            self._on_change(CLOSED, "")

    def failure(self, why: str) -> None:
        with self._lock:
            was = self.state
            self.failures += 1
            self.last_error = why
            self.backoff = self.base if was == CLOSED else min(self.max, max(self.base, self.backoff * 2))
            self.retry_at = self._clock() + self.backoff
            self.state = OPEN
        if was == CLOSED and self._on_change:
            self._on_change(OPEN, why)

    @property
    def is_closed(self) -> bool:
        return self.state == CLOSED


__all__ = ["Breaker", "CLOSED", "OPEN", "PROBING"]
