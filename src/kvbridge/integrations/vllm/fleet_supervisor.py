"""Supervision of a running fleet (issue 28 point 3): a member that dies is restarted on its ports,
with backoff, and one that keeps dying ends the fleet.

Why restart on the same ports: vLLM's router keeps every worker URL it was started with and
checks each one's /health every second, also while it is out of rotation; an instance back on its
URL is routed to again after two good checks, without restarting the router (which would cut the
requests in flight on every other member). A restarted instance is a new incarnation (a new
engine id), so its peers handshake with it afresh instead of reusing the dead one's connections.

Why only on exit: a starved member (stopped, swapped, its host overloaded) answers late, not
never, and a restart would throw away its work and its cache; the router keeps it (point 2), so
the supervisor restarts a member only when its leading process has exited. What is left of its
session (EngineCore, workers, the kvbridge sidecar, which hold its ports and memory) is killed
first (`Fleet.retire`).

Backoff and the give-up rule: the n-th death in a row waits RESTART_DELAYS_S[n-1] seconds before
the restart; a death after the member has answered for STABLE_S seconds starts a new row. A
member that dies more than len(RESTART_DELAYS_S) times in a row makes `step` raise `FleetGaveUp`,
with its log's last lines; `kvbridge serve` then stops the fleet and exits 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbridge.integrations.vllm.fleet_config import FleetError
from kvbridge.integrations.vllm.fleet_processes import exit_status

RESTART_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0)
STABLE_S = 60.0
LOG_LINES = 20


class FleetGaveUp(FleetError):
    """A member kept dying: the fleet is not what it was asked to be."""


@dataclass
class _Watch:
    deaths_in_a_row: int = 0
    died_at: float | None = None  # the exit seen, not yet restarted
    restart_at: float = 0.0
    started_at: float = 0.0  # the current incarnation's start
    answered_at: float | None = None  # when the current incarnation first answered
    restarts: int = 0


class Supervisor:
    """Call `step` every second or so (the CLI's watch loop does), from the thread that started the
    fleet (the master dies with the thread that started it). `report` gets one dict per event:
    `died` (member, rc, deaths_in_a_row, restart_in_s), `restarted` (member, pid, incarnation),
    `back` (member, after_s: from its death to its first answer)."""

    def __init__(self, fleet: Any, report: Callable[[dict[str, Any]], None] = lambda event: None,
                 clock: Callable[[], float] = time.monotonic):
        self.fleet, self.report, self.clock = fleet, report, clock
        now = clock()
        self.watches = {name: _Watch(started_at=now, answered_at=now) for name in fleet.supervised()}
        self._down_since: dict[str, float] = {}

    def step(self) -> None:
        now = self.clock()
        for name in self.fleet.supervised():
            w = self.watches.setdefault(name, _Watch(started_at=now))
            proc = self.fleet.process(name)
            if w.died_at is not None:
                if now >= w.restart_at:
                    self._restart(name, w)
                continue
            if proc is None:  # stopped by the fleet's owner (`Fleet.kill`): theirs to restart
                continue
            rc = exit_status(proc)
            if rc is None:
                if w.answered_at is None and self.fleet.answers(name):
                    w.answered_at = self.clock()
                    self.report({"event": "back", "member": name,
                                 "after_s": round(w.answered_at - self._down_since.pop(name, w.started_at), 1)})
                continue
            self._died(name, w, rc, now)
        self.fleet.track_segments()

    def _died(self, name: str, w: _Watch, rc: int, now: float) -> None:
        if w.answered_at is not None and now - w.answered_at >= STABLE_S:
            w.deaths_in_a_row = 0
        w.deaths_in_a_row += 1
        log = self.fleet.log_of(name)
        self.fleet.retire(name)
        self._down_since.setdefault(name, now)
        if w.deaths_in_a_row > len(RESTART_DELAYS_S):
            raise FleetGaveUp(f"{name} died {w.deaths_in_a_row} times in a row (last rc {rc}), never answering "
                              f"for {STABLE_S:.0f} s in between: not restarted again (its log: {log})\n"
                              f"last lines of that log:\n{_tail(log, LOG_LINES)}")
        delay = RESTART_DELAYS_S[w.deaths_in_a_row - 1]
        w.died_at, w.restart_at = now, now + delay
        self.report({"event": "died", "member": name, "rc": rc, "deaths_in_a_row": w.deaths_in_a_row,
                     "restart_in_s": delay})

    def _restart(self, name: str, w: _Watch) -> None:
        proc = self.fleet.relaunch(name)
        w.died_at, w.answered_at, w.started_at = None, None, self.clock()
        w.restarts += 1
        self.report({"event": "restarted", "member": name, "pid": proc.pid, "incarnation": w.restarts})


def _tail(path: Any, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - (1 << 16)))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


__all__ = ["FleetGaveUp", "RESTART_DELAYS_S", "STABLE_S", "Supervisor"]
