"""Ports (issue 28 point 5): every port a fleet binds is checked free on the interface that binds it
and reserved against a launcher starting beside it (an exclusive flock per port, held until stop
or the launcher's end); a collision with a port the user named is one line, exit 2, before
anything starts. Real sockets, real locks, a second real process; no vLLM started (dry runs).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app
from kvbridge.transport.ports import PortReservations, port_free, reserved

HOLDER = """
import sys, time
from kvbridge.transport.ports import PortReservations
r = PortReservations()
print(r.run(["127.0.0.1", "127.0.0.1"]), flush=True)
sys.stdin.read()
"""


def test_a_port_another_launcher_holds_is_never_promised_and_comes_back_when_it_ends():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        base = int(holder.stdout.readline())
        assert port_free("127.0.0.1", base)  # nothing listens: only the reservation holds it
        assert reserved(base) and reserved(base + 1)  # and free_ports (the pool's master, tests) skips it
        mine = PortReservations()
        why = mine.take(base, "127.0.0.1")
        assert "reserved by another kvbridge launcher" in why and "\n" not in why
        assert not {base, base + 1} & {mine.run(["127.0.0.1"] * 3) + i for i in range(3)}
        mine.release()
    finally:
        holder.stdin.close()  # the launcher ends: the kernel drops its locks
        holder.wait(30)
    assert not reserved(base)
    again = PortReservations()
    assert again.take(base, "127.0.0.1") == ""
    again.release()


def test_a_port_is_checked_on_the_interface_that_binds_it():
    server = socket.socket()
    server.bind(("127.0.0.2", 0))  # a server on another loopback address than 127.0.0.1
    server.listen()
    port = server.getsockname()[1]
    try:
        r = PortReservations()
        assert "127.0.0.2:" in r.take(port, "127.0.0.2")  # in use there
        assert "0.0.0.0:" in r.take(port, "0.0.0.0")  # every interface: in use on one of them
        assert r.take(port, "127.0.0.1") == ""  # the old 127.0.0.1-only check saw it free
        r.release()
    finally:
        server.close()


def _vllm_tools() -> Path | None:
    python = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    return python if (python.parent / "vllm").is_file() and (python.parent / "vllm-router").is_file() else None


@pytest.mark.skipif(_vllm_tools() is None, reason="kvbridge serve needs .venv-vllm's vllm and vllm-router (make vllm-env)")
def test_two_fleets_starting_side_by_side_get_disjoint_ports_and_the_same_port_is_one_line(tmp_path):
    from kvbridge.integrations.vllm.fleet import Fleet, FleetConfig, InstanceShape
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama

    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "m", seed=1))
    probe = PortReservations()
    port, other = probe.run(["127.0.0.1"]), probe.run(["127.0.0.1"])  # free ports for the routers
    probe.release()

    def config(p: int) -> FleetConfig:
        return FleetConfig(model=model, prefill=[InstanceShape(tp=2)], decode=[InstanceShape(tp=1, block=64)],
                           log_dir=tmp_path / "logs", port=p, vllm_python=str(_vllm_tools()), pool="start")

    first = Fleet(config(port))
    try:
        held = set(first.summary()["ports"])
        master = first.master
        assert {port, master.rpc_port, master.metrics_port, first._prometheus} <= held
        assert len(held) == 1 + 3 + 2 + 2 + 1  # router, prefill HTTP + 2 ranks, decode HTTP + 1, master, metrics
        second = Fleet(config(other))
        assert not held & set(second.summary()["ports"])
        second.port_locks.release()
        r = CliRunner().invoke(app, ["serve", str(model), "--prefill", "tp=1", "--decode", "tp=1", "--port",
                                     str(port), "--vllm-python", str(_vllm_tools()), "--dry-run"])
        assert r.exit_code == 2, r.output
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert len(lines) == 1 and f"--port {port}" in lines[0] and "another kvbridge launcher" in lines[0], r.output
    finally:
        first.port_locks.release()
