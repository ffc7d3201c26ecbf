"""The pool across two 'hosts' (network namespaces joined by a veth pair: the `namespaces` fixture),
through Mooncake's TCP transport: the master and a writer engine in one namespace, a reader of
another shape in the other. The reader reaches the writer's memory only over the veth link."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvbridge.pool.master import MooncakeMaster

SIDE = Path(__file__).with_name("netns_side.py")


def _start(ns: str, role: str, args: dict) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(SIDE), role, json.dumps(args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _result(proc: subprocess.Popen, timeout: float = 180) -> dict:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if sel.select(1):
            line = proc.stdout.readline()
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
            if not line:
                break
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"no result (rc {proc.poll()}): {proc.stderr.read()[-2000:]}")


def test_a_reader_on_another_host_loads_what_a_writer_stored(namespaces, tmp_path):
    (ns_a, addr_a), (ns_b, addr_b) = namespaces
    master = MooncakeMaster.prepare(tmp_path / "master.log", addr_a)
    master.argv = ["ip", "netns", "exec", ns_a, *master.argv]  # the master lives on host a
    with open(master.log_path, "wb") as log:
        master.proc = subprocess.Popen(master.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    common = {"master": master.address, "metadata_url": master.metadata_url, "blocks": 6}
    writer = _start(ns_a, "writer", {**common, "host": addr_a})
    try:
        assert _result(writer) == {"stored": 6}
        reader = _start(ns_b, "reader", {**common, "host": addr_b})
        got = _result(reader)
        assert got["loaded"] == 6 and got["exact"] and got["bytes"] > 0, got
        assert reader.wait(60) == 0
    finally:
        writer.stdin.close()
        writer.wait(60)
        master.stop()
