"""Two `vllm serve` instances of different shapes share prefixes through one Mooncake Store pool
(issue 23 points 2-3): instance A (TP 1, block 64) serves a prompt and stores its blocks; instance
B (TP 2, block 32, another process) gets a prompt sharing that prefix, reports it as an external
prefix-cache hit, loads it, and answers with A's tokens (A computed the prompt itself, the store
being empty: a plain instance's answer; B's own computation agrees with A's on a prompt nobody
stored, which is no hit).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest

from kvbridge.integrations.vllm.fleet import FleetConfig, InstanceShape, healthy, vllm_serve_member
from kvbridge.integrations.vllm.fleet_processes import stop_session
from kvbridge.pool.master import MooncakeMaster
from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import metric_total, prompt_text, request

pytestmark = pytest.mark.vllm
START_S = 900.0


def _tokens(url: str, prompt: str) -> list[int]:
    body = json.dumps({"model": "model", "prompt": prompt}).encode()
    req = urllib.request.Request(f"{url}/tokenize", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["tokens"]


def _wait_stored(master: MooncakeMaster, model, tokens: list[int], blocks: int, timeout: float = 300.0) -> None:
    """Until the store holds the first `blocks` pool blocks of `tokens` whole (A stores them at its
    next engine step after the request finished, asynchronously to the reply)."""
    from kvbridge.core.spec import LayerSpec, ModelSpec
    from kvbridge.integrations.vllm.layout import vllm_cpu_layout, vllm_cpu_spec
    from kvbridge.offload.keys import chained_block_hashes, group_keys
    from kvbridge.pool.store import StoreClient, StoreConfig
    from kvbridge.pool.tier import PoolConfig, PoolIndex

    spec = vllm_cpu_spec(ModelSpec(tuple(LayerSpec("full", 2, 32, 32) for _ in range(2)), "float32", "tiny"))
    client = StoreClient(StoreConfig(master.address, master.metadata_url, segment_bytes=0))
    try:
        index = PoolIndex(spec, client, PoolConfig(model_id=str(model.resolve()), block_tokens=64),
                          lambda bt, n: vllm_cpu_layout(1, bt, n))  # the connector's `vllm_staging`
        keys = group_keys(chained_block_hashes(tokens[:blocks * 64], 64), 0)
        end = time.monotonic() + timeout
        while not all(index.hits(keys)):
            assert time.monotonic() < end, "instance A never stored the prompt's blocks"
            time.sleep(0.5)
    finally:
        client.close()


def _kv(master: MooncakeMaster, secret_file: str) -> dict:
    return {"kv_connector": "KVBridgePoolConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
                "master": master.address, "metadata_url": master.metadata_url, "secret_file": secret_file,
                "block_tokens": 64, "segment_mib": 32, "staging_blocks": 16}}


def test_two_instances_of_different_shapes_share_a_prefix(vllm_env, tmp_path):
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "tiny-llama", seed=5))
    secret = tmp_path / "pool.key"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    master = MooncakeMaster.start(tmp_path / "master.log")
    config = FleetConfig(model=model, prefill=[], decode=[], log_dir=tmp_path)
    vllm = str(vllm_env.python.parent / "vllm")
    port_a = free_ports(1)
    port_b = free_ports(1, {port_a})
    members = [vllm_serve_member(config, vllm, "pool-a", InstanceShape(tp=1, block=64), port_a, tmp_path,
                                 kv=_kv(master, str(secret))),
               vllm_serve_member(config, vllm, "pool-b", InstanceShape(tp=2, block=32), port_b, tmp_path,
                                 kv=_kv(master, str(secret)))]
    for m in members:
        with open(m.log_path, "wb") as log:
            m.proc = subprocess.Popen(m.argv, env=m.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + START_S
        for m in members:
            while not healthy(m.url):
                assert m.proc.poll() is None, m.log_tail(30)
                assert time.monotonic() < end, f"{m.name} did not start"
                time.sleep(1)
        a, b = members
        # A computes the prompt itself (the store is empty): the plain answer. It stores the blocks.
        prefix = prompt_text(1, 300)  # 300 byte tokens: four 64-token pool blocks, then the ending
        shared = prefix + " but a second ending here"
        reference = request(a.url, shared, 8)
        assert reference.ok, reference.error
        _wait_stored(master, model, _tokens(a.url, prefix), 4)
        before = metric_total(b.url, "vllm:external_prefix_cache_hits_total")
        hit = request(b.url, shared, 8)
        assert hit.ok, hit.error
        got = metric_total(b.url, "vllm:external_prefix_cache_hits_total") - before
        assert got >= 256, f"B reported {got} external hit tokens; logs: {b.log_tail(20)}"
        assert hit.token_ids == reference.token_ids
        # A prompt nobody stored: no external hit on B, and B computing it agrees with A.
        before = metric_total(b.url, "vllm:external_prefix_cache_hits_total")
        fresh = prompt_text(2, 200)
        assert request(b.url, fresh, 8).token_ids == request(a.url, fresh, 8).token_ids
        assert metric_total(b.url, "vllm:external_prefix_cache_hits_total") == before
        for m in members:
            assert "Traceback" not in m.log_path.read_text(errors="replace"), m.log_tail(40)
    finally:
        for m in members:
            if m.proc is not None:
                stop_session(m.proc)
        master.stop()
