"""A supervised fleet seen from outside (issue 28 point 3): `kvbridge serve --json` run as an operator
runs it, a member SIGKILLed under load, and what the clients and the fleet's own events show until
the fleet is back to full strength by itself.

`ServeProcess` starts the CLI and reads its stdout: the summary line, then one JSON line per
supervision event (died, restarted, back). `kill_and_recover` kills one member's whole session
while clients send prompts through the router, and waits for the member's `back` event, the
router's health gauge to mark every instance healthy again, and (for an instance) the restarted
incarnation to serve requests the router sent it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvbridge.integrations.vllm.fleet_processes import session_pids
from kvbridge.testing.rotation import _Load, worker_health
from kvbridge.testing.serving import metric_total


class ServeProcess:
    """`kvbridge serve ... --json` in its own session; `summary` is its first line, `events` the
    supervision events after it, each with the monotonic time it was read."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.summary: dict[str, Any] | None = None
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.stderr = b""
        self._got = threading.Condition()
        self._readers = [threading.Thread(target=f, daemon=True) for f in (self._read_stdout, self._read_stderr)]
        for t in self._readers:
            t.start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            obj = json.loads(line)
            with self._got:
                if self.summary is None:
                    self.summary = obj
                else:
                    self.events.append((time.monotonic(), obj))
                self._got.notify_all()
        with self._got:
            self._got.notify_all()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr += line

    def wait_summary(self, timeout: float) -> dict[str, Any]:
        with self._got:
            self._got.wait_for(lambda: self.summary is not None or self.proc.poll() is not None, timeout)
        if self.summary is None:
            raise AssertionError(f"kvbridge serve gave no summary (rc {self.proc.poll()}): {self.stderr[-3000:]!r}")
        return self.summary

    def wait_event(self, member: str, event: str, since: float, timeout: float) -> dict[str, Any]:
        """The first `event` of `member` read after `since` (monotonic)."""
        def found() -> dict[str, Any] | None:
            return next((e for t, e in self.events if t >= since and e["member"] == member
                         and e["event"] == event), None)
        with self._got:
            self._got.wait_for(lambda: found() is not None or self.proc.poll() is not None, timeout)
            got = found()
        if got is None:
            raise AssertionError(f"no {event} event of {member} in {timeout:.0f} s (rc {self.proc.poll()}); "
                                 f"events: {[e for _, e in self.events]}; stderr: {self.stderr[-2000:]!r}")
        return got

    def pid(self, member: str) -> int:
        """The member's current leader pid: the summary's, or its last restart's."""
        restarted = [e["pid"] for _, e in self.events if e["member"] == member and e["event"] == "restarted"]
        if restarted:
            return restarted[-1]
        s = self.summary
        if member == "master":
            return s["pool"]["pid"]
        if member == "router":
            return s["router"]["pid"]
        return next(i["pid"] for i in s["instances"] if i["name"] == member)

    def wait(self, timeout: float) -> int:
        """Its exit code, once it has exited and everything it wrote is read."""
        rc = self.proc.wait(timeout)
        for t in self._readers:
            t.join(30)
        return rc

    def stop(self, timeout: float = 180.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        return self.wait(timeout)


def full_strength(serve: ServeProcess) -> bool:
    """The router marks every instance healthy (its own gauge) and the master (if any) accepts."""
    s = serve.summary
    health = worker_health(s["router"]["metrics"])
    if not all(health.get(i["url"]) == 1 for i in s["instances"]):
        return False
    if s.get("pool") and s["pool"].get("pid"):
        from kvbridge.pool.master import _accepts
        host, port = s["pool"]["master"].rsplit(":", 1)
        return _accepts(host, int(port))
    return True


def kill_and_recover(serve: ServeProcess, member: str, clients: int = 3, before_s: float = 3.0,
                     burst_s: float = 20.0, timeout: float = 900.0, seed: int = 90_000) -> dict[str, Any]:
    """SIGKILL `member`'s whole session under a steady load of `clients` through the router, kept
    `burst_s` after the kill; then one client until the fleet is back to full strength by itself
    and (for an instance) the router has sent its new incarnation a request it served, and 10 s
    more (on 2 shared cores a full load would starve the restart for minutes). Every request
    filed by when it was sent, relative to the kill."""
    s = serve.summary
    url = next((i["url"] for i in s["instances"] if i["name"] == member), None)
    leader = serve.pid(member)
    old = session_pids(leader)
    with _Load(s["endpoint"], 1, seed=seed) as load:
        with _Load(s["endpoint"], clients - 1, seed=seed + 5_000) as burst:
            time.sleep(before_s)
            t_kill = time.monotonic()
            os.killpg(leader, signal.SIGKILL)
            died = serve.wait_event(member, "died", t_kill, 120)
            restarted = serve.wait_event(member, "restarted", t_kill, 120)
            time.sleep(max(0.0, t_kill + burst_s - time.monotonic()))
        back = serve.wait_event(member, "back", t_kill, timeout)
        t_back = time.monotonic()
        served_before = None
        t_served = None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if full_strength(serve):
                break
            time.sleep(0.5)
        t_full = time.monotonic()
        if url is not None:  # the router sends the new incarnation requests again, and it serves them
            served_before = metric_total(url, "vllm:request_success_total")
            while time.monotonic() < end:
                if metric_total(url, "vllm:request_success_total") > served_before:
                    t_served = time.monotonic()
                    break
                time.sleep(0.5)
        time.sleep(10.0)
    t_end = time.monotonic()
    load.sent += burst.sent
    failed = [round(sent - t_kill, 2) for sent, _, ok, _ in load.sent if not ok]
    late = [(sent, ok) for sent, _, ok, _ in load.sent if sent - t_kill >= 10.0]
    return {"member": member, "clients": clients, "burst_s": burst_s, "requests": len(load.sent),
            "errors": len(failed), "errors_sent_at_s": failed[:20], "sent_10s_after_kill": len(late),
            "failed_10s_after_kill": sum(not ok for _, ok in late),
            "sent_after_back": sum(sent >= t_back for sent, _, _, _ in load.sent),
            "failed_after_back": sum(sent >= t_back and not ok for sent, _, ok, _ in load.sent),
            "rc": died["rc"], "restart_in_s": died["restart_in_s"], "new_pid": restarted["pid"],
            "back_after_s": back["after_s"], "full_strength_after_s": round(t_full - t_kill, 1),
            "served_by_new_incarnation_after_s": round(t_served - t_kill, 1) if t_served else None,
            "full_strength": full_strength(serve), "load_s": round(t_end - t_kill, 1),
            "first_error_sent_s": min(failed, default=None), "last_error_sent_s": max(failed, default=None),
            "old_session_left": sorted(p for p in session_pids(leader) & old if _running(p)),
            "error_samples": sorted({e for *_, ok, e in load.sent if not ok})[:3]}


KINDS = ("prefill-1", "decode-1", "master")
"""One member of each kind, as `make serve-check` kills them."""


def supervised_fleet_argv(model: Path, port: int, log_dir: Path, vllm_python: str | None = None) -> list[str]:
    """`kvbridge serve --json` of the supervised fleet: 2 prefill and 2 decode instances (block 32)
    with their own pool master, so each kind of member can be killed."""
    argv = [str(Path(sys.executable).parent / "kvbridge"), "serve", str(model), "--prefill", "block=32",
            "--prefill", "block=32", "--decode", "block=32", "--decode", "block=32", "--pool", "start",
            "--port", str(port), "--log-dir", str(log_dir), "--json"]
    return argv + (["--vllm-python", str(vllm_python)] if vllm_python else [])


def run_supervision(work: Path, killed: tuple[str, ...] = KINDS, python: str | None = None) -> dict[str, Any]:
    """`make serve-check`'s supervision part: the supervised fleet on the tiny Llama, each member of
    `killed` SIGKILLed under load in turn (`kill_and_recover`), one row each."""
    from kvbridge.proofs.vllm.cluster import free_ports
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny-llama", seed=3))
    serve = ServeProcess(supervised_fleet_argv(model, free_ports(1), work / "fleet", python))
    rows = []
    load = os.getloadavg()
    try:
        t0 = time.monotonic()
        serve.wait_summary(1800)
        started = time.monotonic() - t0
        for i, member in enumerate(killed):
            rows.append(kill_and_recover(serve, member, seed=90_000 + 10_000 * i))
    finally:
        serve.stop()
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cores": os.cpu_count(),
            "load_avg_at_start": [round(x, 1) for x in load], "start_s": round(started, 1), "rows": rows}


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


__all__ = ["KINDS", "ServeProcess", "full_strength", "kill_and_recover", "run_supervision", "supervised_fleet_argv"]
