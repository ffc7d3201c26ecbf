"""A fleet across two hosts (issue 28 point 1): two network namespaces joined by a veth pair (the
`namespaces` fixture), one fleet file, one `kvbridge serve --fleet FILE --on HOST` per host as an
operator types it. Host a runs a prefill instance (TP 1, block 64) and the router; host b a
decode instance of another shape (TP 2, block 32); the KV moves over Mooncake's TCP transport,
so the decode ranks can reach the prefill ranks' memory only over the veth link.

Every answer through the router (asked from inside host a) must equal a plain `vllm serve`
instance's (TP 1, block 32, no connector, in the test's own namespace); the decode ranks must
have loaded the prompts' KV (their transfer events), and host b's veth must have received at
least those bytes. SIGTERM stops each host's part, leaving none of its processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.core.secrets import write_secret_file
from kvbridge.integrations.vllm.fleet import FleetConfig, InstanceShape, healthy, vllm_serve_member
from kvbridge.integrations.vllm.fleet_processes import (_pids_in_groups, remove_unused_segments, session_segments,
                                                        stop_session)
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import first_json_line, prompt_text, request, transfer_events
from kvbridge.transport.ports import PortReservations

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]  # `make fleet-tests`: minutes of vLLM (re)starts
START_S = 1200.0
CLIENT = Path(__file__).with_name("netns_client.py")


def _fleet_file(path: Path, addr_a: str, addr_b: str, ports: list[int]) -> Path:
    router, prefill, decode = ports[0], ports[1], ports[3]  # prefill: HTTP + 1 side port; decode: HTTP + 2
    path.write_text(f"""\
[router]
host = "{addr_a}"
port = {router}

[[instance]]
name = "prefill-0"
role = "prefill"
host = "{addr_a}"
port = {prefill}
shape = "tp=1,block=64,transport=mooncake"

[[instance]]
name = "decode-0"
role = "decode"
host = "{addr_b}"
port = {decode}
shape = "tp=2,block=32,transport=mooncake"
""")
    return path


def _rx_bytes(ns: str) -> int:
    """Bytes received by namespace `ns`'s veth end."""
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show"], capture_output=True, text=True, check=True)
    return sum(link["stats64"]["rx"]["bytes"] for link in json.loads(out.stdout) if link["ifname"] != "lo")


def _ask(ns: str, url: str, requests: list[dict], concurrent: int) -> list[dict]:
    """The answers of `url` to `requests`, asked from inside namespace `ns`."""
    args = {"url": url, "requests": requests, "max_tokens": 8, "concurrent": concurrent}
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(CLIENT), json.dumps(args)],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_a_fleet_across_two_hosts_answers_as_one_instance(vllm_env, namespaces, tmp_path):
    (ns_a, addr_a), (ns_b, addr_b) = namespaces
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "tiny-llama", seed=3))
    secret = tmp_path / "fleet.secret"
    write_secret_file(secret)  # 0600: what an operator copies to every host
    probe = PortReservations()  # ports no launcher beside this test holds (the reservations are host-wide)
    base = probe.run(["127.0.0.1"] * 6)
    ports = [base + i for i in range(6)] + [probe.run(["127.0.0.1"])]
    probe.release()
    fleet = _fleet_file(tmp_path / "fleet.toml", addr_a, addr_b, ports)
    stats = tmp_path / "transfers-b.jsonl"
    kvbridge = str(Path(sys.executable).parent / "kvbridge")

    def host(ns: str, addr: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", ns, kvbridge, "serve", str(model), "--fleet", str(fleet),
                                 "--on", addr, "--secret-file", str(secret), "--log-dir", str(tmp_path / ns),
                                 "--vllm-python", str(vllm_env.python), "--json", *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    serve_a = host(ns_a, addr_a)
    serve_b = host(ns_b, addr_b, "--stats-path", str(stats))
    ref = vllm_serve_member(FleetConfig(model=model, prefill=[], decode=[], log_dir=tmp_path),
                            str(vllm_env.python.parent / "vllm"), "reference", InstanceShape(tp=1, block=32),
                            ports[6], tmp_path, kv=None)
    with open(ref.log_path, "wb") as log:
        ref.proc = subprocess.Popen(ref.argv, env=ref.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    pids: list[int] = []
    try:
        part_b = first_json_line(serve_b, START_S, "host b")
        part_a = first_json_line(serve_a, START_S, "host a")
        assert [i["name"] for i in part_a["instances"]] == ["prefill-0"] and part_a["router"]["pid"]
        assert [i["name"] for i in part_b["instances"]] == ["decode-0"] and part_b["router"]["on"] == addr_a
        assert part_a["instances"][0]["url"].startswith(f"http://{addr_a}:")
        assert part_b["instances"][0]["url"].startswith(f"http://{addr_b}:")
        pids = [part_a["router"]["pid"]] + [i["pid"] for p in (part_a, part_b) for i in p["instances"]]
        end = time.monotonic() + START_S
        while not healthy(ref.url):
            assert ref.proc.poll() is None and time.monotonic() < end, ref.log_tail(20)
            time.sleep(1)
        rx = _rx_bytes(ns_b)
        prompts = [{"prompt": prompt_text(1, 20)}, {"prompt": prompt_text(2, 3 * 64 + 5)},
                   {"prompt": prompt_text(3, 2 * 64), "stream": True}, {"prompt": prompt_text(4, 75), "chat": True}]
        together = [{"prompt": prompt_text(100 + i, 64 + 13 * i)} for i in range(4)]
        got = _ask(ns_a, part_a["router"]["url"], prompts, 1) + _ask(ns_a, part_a["router"]["url"], together, 4)
        for r, g in zip(prompts + together, got):
            want = request(ref.url, r["prompt"], 8, stream=r.get("stream", False), chat=r.get("chat", False))
            assert want.ok and g["error"] is None, (g["error"], want.error)
            assert g["token_ids"] == want.token_ids and g["token_ids"], (r, g["token_ids"], want.token_ids)
        loads = [e for e in transfer_events(str(stats)) if e.get("event") == "recv"]
        assert loads and all(e["ok"] for e in loads), loads[-3:]
        assert {e["rank"] for e in loads} == {0, 1}  # both decode ranks read their heads from host a
        moved = sum(e["nbytes"] for e in loads)
        assert moved > 0 and _rx_bytes(ns_b) - rx >= moved, (moved, _rx_bytes(ns_b) - rx)
    finally:
        codes = []
        for serve in (serve_a, serve_b):
            if serve.poll() is None:
                os.killpg(serve.pid, signal.SIGTERM)
        for serve in (serve_a, serve_b):
            try:
                codes.append(serve.wait(180))
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                codes.append(serve.wait(30))
        ref_segments = session_segments(ref.proc.pid)
        stop_session(ref.proc)
        remove_unused_segments(ref_segments)
    assert codes == [0, 0], (codes, serve_a.stderr.read()[-2000:], serve_b.stderr.read()[-2000:])
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")] and not _pids_in_groups(set(pids)), \
        "processes of the fleet left running"
    assert secret.exists()  # the operator's secret is read, never removed
