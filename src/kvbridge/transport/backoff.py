"""Waiting without spinning: pauses that grow while a loop finds nothing to do."""

from __future__ import annotations

import time


class Backoff:
    """Pauses that double from `first` to `cap` while a loop finds nothing to do, reset by progress.

    Waiting loops beside an engine's threads: a fixed 0.1 ms poll wakes 10,000 times a second and
    takes CPU the engine needs on small hosts, a long fixed pause adds latency to every step.
    """

    def __init__(self, first: float = 0.0001, cap: float = 0.001):
        self.first, self.cap, self.now = first, cap, first

    def next(self) -> float:
        now, self.now = self.now, min(self.cap, self.now * 2)
        return now

    def pause(self) -> None:
        time.sleep(self.next())

    def reset(self) -> None:
        self.now = self.first

    def after(self, moved: bool) -> float:
        """The wait before a loop's next round: none after progress, else the next pause."""
        if moved:
            self.reset()
            return 0.0
        return self.next()
