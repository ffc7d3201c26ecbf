"""Standalone `vllm serve` members for tests that run instances outside a `Fleet` (the pool's):
started in sessions of their own, waited for until healthy, their logs checked for tracebacks on
a clean exit, and stopped with everything they started whatever happens."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvbridge.integrations.vllm.fleet import healthy
from kvbridge.integrations.vllm.fleet_processes import Member, stop_session


@contextmanager
def running(members: Sequence[Member], cwd: Path, start_s: float) -> Iterator[None]:
    for m in members:
        with open(m.log_path, "wb") as log:
            m.proc = subprocess.Popen(m.argv, env=m.env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=cwd)
    try:
        end = time.monotonic() + start_s
        for m in members:
            while not healthy(m.url):
                assert m.proc.poll() is None, m.log_tail(30)
                assert time.monotonic() < end, f"{m.name} did not start"
                time.sleep(1)
        yield
        for m in members:
            text = m.log_path.read_text(errors="replace")
            assert "Traceback" not in text and "EngineDeadError" not in text, m.log_tail(40)
    finally:
        for m in members:
            if m.proc is not None:
                stop_session(m.proc)


__all__ = ["running"]
