"""Supervised (issue 28 point 3), with real `vllm serve` instances, vLLM's router and the pool's
mooncake_master, started by `kvbridge serve` as an operator starts it.

A fleet of 2 prefill and 2 decode instances with its own master (`--pool start`) under a steady load
through the router: prefill-1 (with KVBRIDGE_SUPERVISE_ALL=1), then decode-1, then the master is
SIGKILLed (its whole session).
Each time, without anything restarting the router, the fleet must be back to full strength by itself
(the member restarted on its ports, the router's gauge marking every instance healthy, the master
accepting, a restarted instance serving requests the router sends it), no process of the dead
incarnation left, and every request sent 10 s or more after the kill served (point 2: the survivors
take the load meanwhile). Last, the master is killed while the test holds its RPC port, so every
restart dies at once: `kvbridge serve` gives up, exits 1 with the master's log's last lines, and
leaves no process and no other port behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from kvbridge.integrations.vllm.fleet import port_free
from kvbridge.integrations.vllm.fleet_processes import session_pids
from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import prompt_text, request
from kvbridge.testing.supervision import KINDS, ServeProcess, _running, kill_and_recover, supervised_fleet_argv

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]  # `make fleet-tests`: minutes of vLLM (re)starts
# Each instance restart is a vLLM start (about a minute on an idle 2-core machine): the default run
# kills one instance and the master, a bounded sample for CI; KVBRIDGE_SUPERVISE_ALL=1 kills each
# kind (prefill, decode, master), as the check does.
KILLED = KINDS if os.environ.get("KVBRIDGE_SUPERVISE_ALL") else ("decode-1", "master")


def test_killed_members_come_back_by_themselves_and_one_that_keeps_dying_ends_the_fleet(vllm_env, tmp_path):
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "tiny-llama", seed=3))
    port = free_ports(1)
    serve = ServeProcess(supervised_fleet_argv(model, port, tmp_path / "fleet", str(vllm_env.python)))
    held = None
    leaders: set[int] = set()
    try:
        summary = serve.wait_summary(900)
        for i, member in enumerate(KILLED):
            leaders.add(serve.pid(member))
            r = kill_and_recover(serve, member, seed=90_000 + 10_000 * i)
            print(json.dumps(r))
            assert r["full_strength"] and not r["old_session_left"], r
            assert r["sent_10s_after_kill"] >= 5 and r["failed_10s_after_kill"] == 0, r
            assert r["sent_after_back"] >= 3 and r["failed_after_back"] == 0, r
            if member != "master":
                assert r["served_by_new_incarnation_after_s"] is not None, r
        assert request(summary["endpoint"], prompt_text(5, 200), 8).ok
        for m in [i["name"] for i in summary["instances"]] + ["router"]:
            leaders.add(serve.pid(m))
        # A master that cannot come back (its RPC port held): every restart exits at once.
        host, rpc = summary["pool"]["master"].rsplit(":", 1)
        os.killpg(serve.pid("master"), signal.SIGKILL)
        held = socket.socket()
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for _ in range(100):  # the killed master's socket closes as it exits
            try:
                held.bind((host, int(rpc)))
                break
            except OSError:
                time.sleep(0.01)
        held.listen()
        rc = serve.wait(300)
        stderr = serve.stderr.decode(errors="replace")
        assert rc == 1, (rc, stderr[-3000:])
        assert "master died" in stderr and "times in a row" in stderr and "last lines of that log" in stderr, \
            stderr[-3000:]
        died = [e for _, e in serve.events if e["member"] == "master" and e["event"] == "died"]
        print(json.dumps({"gave_up_rc": rc, "master_deaths": [(e["deaths_in_a_row"], e["rc"], e["restart_in_s"])
                                                              for e in died]}))
        leaders |= {e["pid"] for _, e in serve.events if e["event"] == "restarted"}
        left = [p for p in session_pids(*leaders) if _running(p)]
        assert not left, f"processes of the fleet left after it gave up: {left}"
        assert all(port_free("127.0.0.1", p) for p in summary["ports"] if p != int(rpc)), summary["ports"]
    finally:
        serve.stop()
        if held is not None:
            held.close()
