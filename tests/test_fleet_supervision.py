"""Supervision rules (issue 28 point 3) on real processes, without vLLM: what is left of a dead
member's session is killed before it is restarted; restarts back off; a stopped (starved) member
is never restarted; a member that keeps dying ends the fleet with its log's last lines.

The members here are small shell processes behind the five calls the supervisor makes of a fleet
(`Fleet` implements them for vLLM instances, the router and the master; the vLLM test
tests/vllm/test_vllm_supervised.py kills those). The clock is the test's, so backoff is checked
without waiting for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from kvbridge.integrations.vllm.fleet_processes import (SegmentLedger, _pids_in_groups, exit_status, retire_session,
                                                        session_pids)
from kvbridge.integrations.vllm.fleet_supervisor import RESTART_DELAYS_S, STABLE_S, FleetGaveUp, Supervisor


def _spawn(argv: list[str], log) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _exited(proc: subprocess.Popen) -> int:
    while (rc := exit_status(proc)) is None:
        time.sleep(0.02)
    return rc


class ShellFleet:
    """Members that are shell commands, each in its own session, as a `Fleet`'s are."""

    def __init__(self, tmp_path, commands: dict[str, str]):
        self.commands, self.tmp = commands, tmp_path
        self.ledger = SegmentLedger()
        self.procs = {n: _spawn(["sh", "-c", c], self.log_of(n)) for n, c in commands.items()}
        self.leaders: list[int] = list(p.pid for p in self.procs.values())

    def supervised(self) -> list[str]:
        return list(self.commands)

    def process(self, name):
        return self.procs[name]

    def answers(self, name) -> bool:
        return exit_status(self.procs[name]) is None

    def log_of(self, name):
        return self.tmp / f"{name}.log"

    def retire(self, name) -> None:
        retire_session(self.procs[name], self.ledger)
        self.procs[name] = None

    def relaunch(self, name):
        self.procs[name] = _spawn(["sh", "-c", self.commands[name]], self.log_of(name))
        self.leaders.append(self.procs[name].pid)
        return self.procs[name]

    def track_segments(self) -> None:
        pass

    def stop(self) -> None:
        for leader in self.leaders:
            try:
                os.killpg(leader, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            if p is not None:
                p.wait()


def test_retire_kills_what_is_left_of_an_exited_leaders_session():
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & exit 3"], start_new_session=True)
    assert _exited(proc) == 3
    left = session_pids(proc.pid) - {proc.pid}
    assert len(left) == 2  # the leader is gone, its children hold on (as an EngineCore would)
    retire_session(proc, SegmentLedger())
    assert proc.returncode == 3 and not _pids_in_groups({proc.pid}, zombies=False)


def test_restarts_back_off_spare_a_stopped_member_and_give_up_with_the_log(tmp_path):
    fleet = ShellFleet(tmp_path, {"crasher": "echo boom-$$; sleep 300 & exit 7", "stopped": "exec sleep 300"})
    now = [0.0]
    events: list[dict] = []
    try:
        sup = Supervisor(fleet, events.append, clock=lambda: now[0])
        os.killpg(fleet.procs["stopped"].pid, signal.SIGSTOP)  # starved: alive, answers nothing
        crasher = fleet.procs["crasher"]
        _exited(crasher)
        for n, delay in enumerate(RESTART_DELAYS_S, 1):
            sup.step()
            died = events[-1]
            assert died == {"event": "died", "member": "crasher", "rc": 7, "deaths_in_a_row": n,
                            "restart_in_s": delay}
            assert not _pids_in_groups({crasher.pid}, zombies=False)  # its `sleep` killed before any restart
            now[0] += delay / 2
            sup.step()
            assert events[-1] is died and fleet.procs["crasher"] is None  # not before its delay
            now[0] += delay / 2
            sup.step()
            assert events[-1]["event"] == "restarted" and events[-1]["incarnation"] == n
            crasher = fleet.procs["crasher"]
            _exited(crasher)
        with pytest.raises(FleetGaveUp) as gave_up:
            sup.step()
        msg = str(gave_up.value)
        assert msg.startswith(f"crasher died {len(RESTART_DELAYS_S) + 1} times in a row (last rc 7)")
        assert msg.count("boom-") == len(RESTART_DELAYS_S) + 1  # every incarnation's line of its log
        assert not [e for e in events if e["member"] == "stopped"]
        assert exit_status(fleet.procs["stopped"]) is None
    finally:
        fleet.stop()


def test_a_member_that_served_a_while_starts_a_new_row(tmp_path):
    fleet = ShellFleet(tmp_path, {"member": "exec sleep 300"})
    now = [0.0]
    events: list[dict] = []
    try:
        sup = Supervisor(fleet, events.append, clock=lambda: now[0])
        for _ in range(3):  # each incarnation serves STABLE_S, then dies: never more than 1 in a row
            now[0] += STABLE_S
            os.killpg(fleet.procs["member"].pid, signal.SIGKILL)
            _exited(fleet.procs["member"])
            sup.step()
            assert events[-1]["event"] == "died" and events[-1]["deaths_in_a_row"] == 1, events
            now[0] += RESTART_DELAYS_S[0]
            sup.step()
            assert events[-1]["event"] == "restarted"
            sup.step()
            assert events[-1]["event"] == "back" and events[-1]["after_s"] == RESTART_DELAYS_S[0]
    finally:
        fleet.stop()
