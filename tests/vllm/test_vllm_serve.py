"""`kvbridge serve` as users run it (issue 22 points 2-3): real `vllm serve` instances of different
shapes behind `vllm-router`, an OpenAI-compatible HTTP client, prefix caching on.

One fleet: prefill TP 1 / block 64, decode TP 2 / block 32 (a pair vLLM's NixlConnector refuses),
started by the CLI as a user would, with the shared pool (`--pool start`: a mooncake_master of the
fleet's, every instance's connector vLLM's MultiConnector of P/D then pool); beside it one plain `vllm serve` instance (TP 1, block 32,
no connector) answers every prompt too. Every edge case (`kvbridge.testing.serving.edge_cases`:
a prompt shorter than a block, a full and a partial prefix-cache hit on the decode instance,
streamed and not, completions and chat, 8 concurrent prompts) must give the plain instance's
tokens, with no error; the decode ranks must have loaded KV through kvbridge; and SIGTERM must
stop the fleet leaving no process, port or shared-memory segment of it behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.integrations.vllm.fleet import FleetConfig, InstanceShape, healthy, port_free, vllm_serve_member
from kvbridge.integrations.vllm.fleet_processes import remove_unused_segments, session_segments, stop_session
from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import edge_cases, first_json_line, metric_total, prompt_text, request, transfer_events

pytestmark = pytest.mark.vllm
START_S = 900.0


def _pool_hits(fleet: dict, reference_url: str) -> None:
    """The pool is used: a prompt the prefill instance computed (and stored) is an external hit on the
    decode instance, which never saw it, and its answer is the plain instance's."""
    prefill, decode = (next(i for i in fleet["instances"] if i["name"] == n) for n in ("prefill-0", "decode-0"))
    text = prompt_text(77, 300)
    keys = metric_total(fleet["pool"]["metrics"], "master_key_count")
    assert request(prefill["url"], text, 8).ok
    end = time.monotonic() + 300
    while metric_total(fleet["pool"]["metrics"], "master_key_count") < keys + 4 * 4:  # 4 blocks x 2 layers x 2 heads
        assert time.monotonic() < end, "the prefill instance never stored the prompt in the pool"
        time.sleep(0.5)
    hits = metric_total(decode["url"], "vllm:external_prefix_cache_hits_total")
    got = request(decode["url"], text, 8)
    assert got.ok and got.token_ids == request(reference_url, text, 8).token_ids
    assert metric_total(decode["url"], "vllm:external_prefix_cache_hits_total") - hits >= 256


def test_serve_fleet_answers_as_one_instance_and_stops_clean(vllm_env, tmp_path):
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "tiny-llama", seed=3))
    logs = tmp_path / "fleet"
    stats = tmp_path / "transfers.jsonl"
    port = free_ports(1)
    pool_key = tmp_path / "pool.key"  # kept across the fleet's restarts (here: read from it)
    pool_key.write_bytes(os.urandom(32).hex().encode())
    pool_key.chmod(0o600)
    cli = [str(Path(sys.executable).parent / "kvbridge")]
    serve = subprocess.Popen([*cli, "serve", str(model), "--prefill", "tp=1,block=64", "--decode", "tp=2,block=32",
                              "--port", str(port), "--log-dir", str(logs), "--stats-path", str(stats), "--pool", "start",
                              "--pool-secret-file", str(pool_key), "--vllm-python", str(vllm_env.python), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    config = FleetConfig(model=model, prefill=[], decode=[], log_dir=tmp_path)
    ref = vllm_serve_member(config, str(vllm_env.python.parent / "vllm"), "reference", InstanceShape(tp=1, block=32),
                            free_ports(1, {port}), tmp_path, kv=None)
    with open(ref.log_path, "wb") as log:
        ref.proc = subprocess.Popen(ref.argv, env=ref.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        fleet = first_json_line(serve, START_S)
        end = time.monotonic() + START_S
        while not healthy(ref.url) and time.monotonic() < end:
            assert ref.proc.poll() is None, ref.log_tail(20)
            time.sleep(1)
        decode = next(i for i in fleet["instances"] if i["name"] == "decode-0")
        cases = edge_cases(fleet["endpoint"], decode["url"], ref.url, block=32)
        rows = [c.row() for c in cases]
        assert all(c.fleet.ok for c in cases), [r for r in rows if r["fleet_error"]]
        assert all(c.equal for c in cases), [r for r in rows if not r["equal"]]
        loads = [e for e in transfer_events(str(stats)) if e.get("event") == "recv"]
        assert loads and all(e["ok"] for e in loads), loads[-3:]
        assert {e["rank"] for e in loads} == {0, 1}  # both decode ranks read their heads through kvbridge
        _pool_hits(fleet, ref.url)
        pids = [i["pid"] for i in fleet["instances"]] + [fleet["router"]["pid"], fleet["pool"]["pid"]]
        segments = session_segments(*pids)
        assert any(s.startswith("kvbridge-") for s in segments), segments
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            rc = serve.wait(120)
        finally:
            ref_segments = session_segments(ref.proc.pid)
            stop_session(ref.proc)
            remove_unused_segments(ref_segments)
    assert rc == 0, serve.stderr.read()[-2000:]
    left = [p for p in pids if os.path.exists(f"/proc/{p}")]
    from kvbridge.integrations.vllm.fleet_processes import _pids_in_groups
    assert not left and not _pids_in_groups(set(pids)), "fleet processes left running"
    assert not [s for s in segments if os.path.exists(f"/dev/shm/{s}")], "fleet segments left in /dev/shm"
    assert pool_key.read_bytes() and not list(logs.glob("*.secret")), "the fleet removes its own secret, not the pool's"
    ports = [port, int(fleet["pool"]["master"].rsplit(":", 1)[1]), int(fleet["pool"]["metrics"].rsplit(":", 1)[1]),
             int(fleet["router"]["metrics"].rsplit(":", 1)[1])] + [int(i["url"].rsplit(":", 1)[1])
                                                                   for i in fleet["instances"]]
    assert set(ports) <= set(fleet["ports"]), (ports, fleet["ports"])  # every port it binds was reserved
    assert all(port_free("127.0.0.1", p) for p in fleet["ports"]), fleet["ports"]  # side channels too
    from kvbridge.transport.ports import PortReservations
    after = PortReservations()
    assert not [p for p in fleet["ports"] if after.take(p, "127.0.0.1")], "reservations outlived the fleet"
    after.release()
