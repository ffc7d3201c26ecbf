"""`kvbridge serve --router-policy kv_aware` (issue 45): what the fleet launches, checked on its
dry run (no vLLM started: the vLLM environment's tools are only looked up; the real fleet is
tests/vllm/test_vllm_kv_routing.py): every prefill
instance publishes its KV events to a loopback port of the launcher's relay and serves /render,
the router scores prefill instances by the relayed events, every port is reserved and distinct,
and the pool connector announces its stores only where the relay reads them."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app

pytestmark = pytest.mark.vllm  # dry runs, seconds: in CI's vLLM pass, where the environment exists
runner = CliRunner()


@pytest.fixture(scope="module")
def vllm_python(vllm_env) -> str:
    if not (vllm_env.python.parent / "vllm-router").is_file():
        pytest.skip("kvbridge serve --dry-run needs the vLLM environment's vllm-router (kvbridge[serve])")
    return str(vllm_env.python)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
    return add_byte_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("m") / "m", seed=1))


def _commands(output: str) -> dict[str, list[str]]:
    names = re.findall(r"^# (\S+)", output, re.M)
    lines = [ln for ln in output.splitlines() if ln.startswith("/")]
    return dict(zip(names, (shlex.split(ln) for ln in lines)))


def _flag(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_prefill_instances_publish_to_the_relay_and_the_router_reads_it(model, vllm_python):
    r = runner.invoke(app, ["serve", str(model), "--prefill", "tp=1,block=64", "--prefill", "tp=1,block=32",
                            "--decode", "tp=1,block=32", "--router-policy", "kv_aware", "--vllm-python",
                            vllm_python, "--dry-run"])
    assert r.exit_code == 0, r.output
    cmds = _commands(r.output)
    ports = set()
    for name in ("prefill-0", "prefill-1"):
        argv = cmds[name]
        (events,) = _flag(argv, "--kv-events-config")
        cfg = json.loads(events)
        assert cfg["enable_kv_cache_events"] and cfg["topic"] == ""
        # a host, not a wildcard: vLLM's publisher connects, and nothing listens beyond loopback
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", cfg["endpoint"])
        ports.add(int(cfg["endpoint"].rsplit(":", 1)[1]))
        assert "--enable-scale-out" in argv
    assert not _flag(cmds["decode-0"], "--kv-events-config") and "--enable-scale-out" not in cmds["decode-0"]
    router = cmds["router"]
    assert _flag(router, "--prefill-policy") == ["kv_aware"] and _flag(router, "--decode-policy") == ["round_robin"]
    sources = dict(s.split("=", 1) for s in _flag(router, "--pd-kv-events"))
    assert set(sources) == set(_flag(router, "--prefill"))
    relayed = {int(e.rsplit(":", 1)[1]) for e in sources.values()}
    assert all(e.startswith("tcp://127.0.0.1:") for e in sources.values())
    assert len(ports | relayed) == 4  # four distinct ports, none an instance's
    http = {int(u.rsplit(":", 1)[1]) for u in _flag(router, "--prefill") + _flag(router, "--decode")}
    assert not (ports | relayed) & http


def test_the_pool_announces_stores_only_on_prefill_instances(model, vllm_python):
    r = runner.invoke(app, ["serve", str(model), "--prefill", "tp=1,block=64", "--decode", "tp=1,block=32",
                            "--router-policy", "kv_aware", "--pool", "start", "--pool-host-mib", "64",
                            "--vllm-python", vllm_python, "--dry-run"])
    assert r.exit_code == 0, r.output
    cmds = _commands(r.output)

    def pool_events(name: str) -> bool:
        kv = json.loads(_flag(cmds[name], "--kv-transfer-config")[0])
        (pool,) = [c for c in kv["kv_connector_extra_config"]["connectors"]
                   if c["kv_connector"] == "KVBridgePoolConnector"]
        return pool["kv_connector_extra_config"]["kv_events"]

    assert pool_events("prefill-0") and not pool_events("decode-0")


def test_other_policies_start_no_relay(model, vllm_python):
    r = runner.invoke(app, ["serve", str(model), "--prefill", "tp=1", "--decode", "tp=1", "--vllm-python",
                            vllm_python, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "--kv-events-config" not in r.output and "--pd-kv-events" not in r.output


def test_a_policy_the_router_lacks_is_one_line(model, vllm_python):
    r = runner.invoke(app, ["serve", str(model), "--prefill", "tp=1", "--decode", "tp=1", "--router-policy",
                            "kv-aware-please", "--vllm-python", vllm_python, "--dry-run"])
    assert r.exit_code == 2 and "kv_aware" in r.output and "Traceback" not in r.output
