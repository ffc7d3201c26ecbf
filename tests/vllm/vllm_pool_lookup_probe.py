"""Probe, run with .venv-vllm's python: how often the pool scheduler asks the store about a request.

Why: vLLM asks a connector for a waiting request's external hits at every step until it can
allocate the request's blocks, and a request for its prompt's log-probs reads no cache at all (vLLM
drops any hit for it). A lookup per step cost a master round trip each and inflated the pool's
counters 29-47x beside vLLM's own hit count (an outside trial: 10 requests on 40 blocks).

The `PoolScheduler`, its thread and index, the master, the store client and vLLM's `Request` are
the real ones; only the connector around the scheduler is a namespace with the attributes it reads.
Prints one JSON object of observations; `test_vllm_pool_lookup.py` asserts on them.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvbridge.core.spec import ModelSpec
from kvbridge.integrations.vllm.layout import vllm_cpu_spec
from kvbridge.integrations.vllm.pool_config import PoolSettings, vllm_staging
from kvbridge.integrations.vllm.pool_identity import request_group_keys
from kvbridge.integrations.vllm.pool_scheduler import PoolScheduler
from kvbridge.pool.master import MooncakeMaster
from kvbridge.pool.store import StoreClient
from kvbridge.pool.tier import PoolIndex

BLOCK = 64
WAIT_S = 300.0  # how long an answer may take on a starved host: the probe polls, it never sleeps a fixed time


def _request(rid: str, tokens: list[int], **sampling) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, **sampling), None)


def _ask(sched: PoolScheduler, request: Request, times: int) -> list[tuple[int | None, bool]]:
    """The answer to the first lookup (polled until it is one), then `times` more as vLLM asks a
    request it could not schedule."""
    end = time.monotonic() + WAIT_S
    while (first := sched.lookup(request, 0))[0] is None:
        assert time.monotonic() < end, "no answer to a lookup"
        time.sleep(0.01)
    return [first] + [sched.lookup(request, 0) for _ in range(times)]


def main() -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvbridge-lookup-probe-"))
    master = MooncakeMaster.start(work / "master.log")
    try:
        settings = PoolSettings(master=master.address, insecure=True, lookup_timeout_ms=WAIT_S * 1000)
        spec = vllm_cpu_spec(ModelSpec.uniform(2, 2, 64, "float32", name="probe"))  # as `pool_spec` gives it
        groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                                   FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                                     dtype=torch.float32))]
        conn = SimpleNamespace(settings=settings, config=settings.pool_config("probe-model"), spec=spec,
                               block_size=BLOCK, _kv_cache_config=KVCacheConfig(16, [], groups))
        sched = PoolScheduler(conn)
        writer = StoreClient(settings.store_config(lend=True))
        try:
            return _observe(sched, writer, spec, conn)
        finally:
            sched.close()
            writer.close()
    finally:
        master.stop()


def _observe(sched: PoolScheduler, writer: StoreClient, spec: ModelSpec, conn: SimpleNamespace) -> dict:
    index = PoolIndex(spec, writer, conn.config, vllm_staging)
    tokens = list(range(300))
    stored = _request("stored", tokens)
    # Two of the prompt's four whole pool blocks in the store (their bytes do not matter to a lookup).
    names = [n for key in request_group_keys(stored, tokens[:4 * BLOCK], BLOCK, 1)[0][:2]
             for n in index.layout.keys(key)]
    buf = torch.zeros(64, dtype=torch.uint8)
    writer.register(buf.data_ptr(), buf.numel())
    assert writer.put(names, [[(buf.data_ptr(), 64)]] * len(names)) == [0] * len(names)
    seen = {"stored": _ask(sched, stored, 5),
            # the local prefix cache grew meanwhile: the same answer, less what is local now
            "stored_local": [sched.lookup(stored, 64), sched.lookup(stored, 128)],
            "missed": _ask(sched, _request("missed", list(range(1000, 1300))), 5),
            "prompt_logprobs": [sched.lookup(_request("logprobs", tokens, prompt_logprobs=1), 0)
                                for _ in range(3)]}
    counts = sched.tally.take()
    seen["counts"] = dict(counts.data) if counts else {}
    sched.finished(stored, ([],))  # it ends (aborted while it waited): a new request of its id asks again
    seen["after_finished"] = _ask(sched, stored, 0)
    counts = sched.tally.take()
    seen["counts_after"] = dict(counts.data) if counts else {}
    return seen


if __name__ == "__main__":
    print(json.dumps(main()))
