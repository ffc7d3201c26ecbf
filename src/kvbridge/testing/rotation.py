"""How fast a fleet's router takes a dead member out of rotation, and whether it keeps a starved one
(issue 28 point 2), measured as a client sees it.

`errors_by_second`: a steady load through the router (a few clients, each sending one short prompt
after another) from a few seconds before a member is SIGKILLed to some seconds after; every request
is filed under the second, relative to the kill, in which it was sent. Requests in flight on the
dead instance fail (vllm-router does not retry them); after the router's health checks take it out,
none should.

`starved_member`: the member's whole process session stopped (SIGSTOP) for a minute under load, then
continued; the router's own gauge (`vllm_router_worker_health`, read from its Prometheus port every
second) says whether it ever took the member out. A starved member's requests wait; none may fail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.request
from typing import Any

from kvbridge.testing.serving import prompt_text, request


class _Load:
    """`clients` threads sending short prompts to `url` one after another until `stop`."""

    def __init__(self, url: str, clients: int, tokens: int = 4, seed: int = 50_000):
        self.url, self.tokens = url, tokens
        self.sent: list[tuple[float, float, bool, str]] = []  # (sent, done, ok, error) in monotonic seconds
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._seed = seed
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = prompt_text(self._seed + 1000 * i + n, 24 + (17 * n) % 60)
            n += 1
            t0 = time.monotonic()
            a = request(self.url, prompt, self.tokens, timeout=300.0)
            with self._lock:
                self.sent.append((t0, time.monotonic(), a.ok, (a.error or "")[:160]))

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(330.0)


def errors_by_second(fleet: Any, name: str, before_s: float = 3.0, after_s: float = 20.0,
                     clients: int = 4) -> dict[str, Any]:
    """SIGKILL member `name` under a steady load; requests and errors by the second (relative to the
    kill) in which they were sent. The member stays dead: the caller restarts it."""
    with _Load(fleet.endpoint, clients) as load:
        time.sleep(before_s)
        t_kill = time.monotonic()
        fleet.kill(name)
        killed_in = time.monotonic() - t_kill
        time.sleep(max(0.0, after_s - killed_in))
    by: dict[int, list[int]] = {}
    for sent, _, ok, _ in load.sent:
        s = int((sent - t_kill) // 1)
        if -before_s <= s < after_s:
            row = by.setdefault(s, [0, 0])
            row[0] += 1
            row[1] += not ok
    failed = [sent - t_kill for sent, _, ok, _ in load.sent if not ok]
    return {"member": name, "clients": clients, "by_second": [{"second": s, "sent": n, "errors": e}
                                                             for s, (n, e) in sorted(by.items())],
            "requests": len(load.sent), "errors": len(failed),
            "last_error_sent_s": round(max(failed), 2) if failed else None,
            "errors_sent_before_kill": sum(t < 0 for t in failed),
            "error_samples": sorted({e for *_, ok, e in load.sent if not ok})[:3]}


def worker_health(metrics_url: str) -> dict[str, float]:
    """The router's `vllm_router_worker_health` gauge per worker URL ({} when it does not answer)."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5.0) as r:
            text = r.read().decode(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("vllm_router_worker_health{"):
            labels, _, value = line.rpartition(" ")
            worker = labels.split('worker="', 1)[1].split('"', 1)[0]
            with contextlib.suppress(ValueError):
                out[worker] = float(value)
    return out


def starved_member(fleet: Any, name: str, seconds: float = 60.0, clients: int = 4,
                   settle_s: float = 5.0) -> dict[str, Any]:
    """SIGSTOP member `name`'s whole session for `seconds` under load, then SIGCONT; whether the
    router ever marked it unhealthy, and what the clients saw."""
    m = fleet.member(name)
    metrics = fleet.summary()["router"]["metrics"]
    samples: list[tuple[float, float | None]] = []
    with _Load(fleet.endpoint, clients, seed=70_000) as load:
        time.sleep(2.0)
        t0 = time.monotonic()
        os.killpg(m.proc.pid, signal.SIGSTOP)
        try:
            while time.monotonic() - t0 < seconds:
                samples.append((time.monotonic() - t0, worker_health(metrics).get(m.url)))
                time.sleep(1.0)
        finally:
            os.killpg(m.proc.pid, signal.SIGCONT)
        end = time.monotonic() + settle_s
        while time.monotonic() < end:
            samples.append((time.monotonic() - t0, worker_health(metrics).get(m.url)))
            time.sleep(1.0)
    out_at = [round(t, 1) for t, h in samples if h is not None and h < 1]
    slowest = max((done - sent for sent, done, _, _ in load.sent), default=0.0)
    return {"member": name, "stopped_s": seconds, "health_samples": len(samples),
            "unhealthy_samples": len(out_at), "first_unhealthy_s": out_at[0] if out_at else None,
            "requests": len(load.sent), "errors": sum(not ok for *_, ok, _ in load.sent),
            "slowest_request_s": round(slowest, 1),
            "error_samples": sorted({e for *_, ok, e in load.sent if not ok})[:3]}


__all__ = ["errors_by_second", "starved_member", "worker_health"]
