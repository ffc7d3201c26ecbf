"""Opt-in timing of what the connector does on an engine step's path, to find where a slow step's
time went (issue 31): with `KVBRIDGE_STEP_PROFILE=DIR` in an instance's environment every process
of the connector (scheduler, each worker rank, each sidecar) appends one line per timed call to
`DIR/PID.steps`:

    KIND MONOTONIC_START_S DURATION_MS [COUNTS...]

`time.monotonic` is the host's CLOCK_MONOTONIC, so the lines of all processes line up with each
other and with a CPU sampler's. Unset (the default), `span` returns one shared no-op object: no
clock read, nothing written. Lines are buffered and flushed once a second, so profiling does not
add a write per step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

FLUSH_S = 1.0


class _Off:
    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def note(self, *counts: Any) -> None:
        return None


_OFF = _Off()


class _Span:
    __slots__ = ("profile", "kind", "t0", "counts")

    def __init__(self, profile: StepProfile, kind: str):
        self.profile, self.kind, self.counts = profile, kind, ()

    def __enter__(self) -> _Span:
        self.t0 = time.monotonic()
        return self

    def note(self, *counts: Any) -> None:
        self.counts = counts

    def __exit__(self, *exc: object) -> None:
        self.profile.record(self.kind, self.t0, time.monotonic() - self.t0, *self.counts)


class StepProfile:
    """This process's profile file, or nothing when `KVBRIDGE_STEP_PROFILE` is unset."""

    def __init__(self, directory: str | None = None, min_ms: float = 0.0):
        directory = os.environ.get("KVBRIDGE_STEP_PROFILE", "") if directory is None else directory
        self.path = Path(directory) / f"{os.getpid()}.steps" if directory else None
        self.min_s = min_ms / 1e3
        self._lines: list[str] = []
        self._flushed = time.monotonic()

    @property
    def on(self) -> bool:
        return self.path is not None

    def span(self, kind: str) -> _Span | _Off:
        return _Span(self, kind) if self.path is not None else _OFF

    def record(self, kind: str, t0: float, seconds: float, *counts: Any) -> None:
        if self.path is None or seconds < self.min_s:
            return
        self._lines.append(" ".join((kind, f"{t0:.6f}", f"{seconds * 1e3:.3f}", *map(str, counts))) + "\n")
        if t0 - self._flushed > FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.path is None or not self._lines:
            return
        lines, self._lines = self._lines, []
        self._flushed = time.monotonic()
        try:
            with open(self.path, "a") as f:
                f.writelines(lines)
        except OSError:  # a profile is optional: one that cannot be written stops, the engine goes on
            self.path = None


def read_profiles(directory: Path) -> dict[int, list[tuple[str, float, float, list[str]]]]:
    """Every process's lines in `directory`: pid -> [(kind, start_s, duration_ms, counts)]."""
    out: dict[int, list[tuple[str, float, float, list[str]]]] = {}
    for p in sorted(Path(directory).glob("*.steps")):
        rows = []
        for line in p.read_text().splitlines():
            kind, t0, ms, *counts = line.split()
            rows.append((kind, float(t0), float(ms), counts))
        out[int(p.stem)] = rows
    return out


__all__ = ["StepProfile", "read_profiles"]
