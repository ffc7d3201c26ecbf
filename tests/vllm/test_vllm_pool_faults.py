"""Injected pool faults never fail a request (issue 43 point 3, Done when): a real `vllm serve`
with the pool connector (TP 2, a host tier), every call it makes into the pool library raising
on every other call (`faulty_pool_connector.py`: lookups, the host tier, a tier's store / load /
put, the store client's RPCs), serves every request, streamed or not, four prompts three more
times each, with the greedy tokens a plain instance (TP 1, no faults) computes. The faults did
fire (its log names them: in a run on 2026-11-29, the batched lookups' ask / asked / wait /
step_ended, 16 stores and 2 puts) and the engine stayed up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pool_fleet import greedy_logprobs, pool_fleet

from kvbridge.integrations.vllm.fleet import InstanceShape, healthy
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import prompt_text, request

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]  # a minute of vLLM: `make fleet-tests`
HERE = Path(__file__).resolve().parent


def test_every_pool_call_raising_fails_no_request(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool-faults")
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny", seed=17))
    shapes = (("faulty", InstanceShape(tp=2, block=32)), ("plain", InstanceShape(tp=1, block=64)))
    env = {"faulty": {"PYTHONPATH": str(HERE)}}
    with pool_fleet(vllm_env, work, model, shapes[:1], b"f" * 32, connector=("FaultyPoolConnector",
                    "faulty_pool_connector"), member_env=env, member_kv={"faulty": {"host_mib": 16,
                                                                                    "host_dir": str(work)}}) as (
            master, faulty):
        texts = [prompt_text(5 + i, 90 + 40 * i) for i in range(4)]
        first = [greedy_logprobs(faulty.url, t) for t in texts]
        again = [greedy_logprobs(faulty.url, t) for _ in range(3) for t in texts]  # looked up, loaded, stored
        streamed = request(faulty.url, texts[0], 8, stream=True)
        assert healthy(faulty.url)
        log = faulty.log_path.read_text(errors="replace")
    fired = set(re.findall(r"injected fault in (\w+\.\w+)", log))
    assert {"BatchedLookups.ask", "PoolTier.store"} <= fired or len(fired) >= 4, fired  # lookups and stores at least
    assert "EngineDeadError" not in log and "Traceback" not in log
    assert [[t for t, _ in a] for a in again] == [[t for t, _ in f] for f in first] * 3
    (work / "plain").mkdir()
    with pool_fleet(vllm_env, work / "plain", model, shapes[1:], b"p" * 32) as (_, plain):
        reference = [greedy_logprobs(plain.url, t) for t in texts]
    assert [[t for t, _ in f] for f in first] == [[t for t, _ in r] for r in reference]
    assert streamed.ok, streamed.error
