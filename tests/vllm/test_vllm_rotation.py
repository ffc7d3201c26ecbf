"""Out of rotation in seconds, a starved member kept (issue 28 point 2), with real `vllm serve`
instances behind `vllm-router` as `kvbridge serve` configures it.

A fleet of two prefill instances and one decode instance under a steady load of 4 clients:
prefill-1 is SIGKILLed; only requests sent before the router's health checks take it out may fail
(none sent more than 10 s after the kill). prefill-1 restarted, prefill-0's whole session is then
stopped (SIGSTOP) for 60 s under load and continued: the router's own health gauge never marks it
unhealthy and no request fails (they wait).
"""

from __future__ import annotations

import json

import pytest

from kvbridge.integrations.vllm.fleet import Fleet, FleetConfig, InstanceShape
from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.rotation import errors_by_second, starved_member

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]  # `make fleet-tests`: minutes of vLLM (re)starts


def test_a_killed_member_leaves_rotation_in_seconds_and_a_starved_one_stays(vllm_env, tmp_path):
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "tiny-llama", seed=3))
    config = FleetConfig(model=model, prefill=[InstanceShape(block=32), InstanceShape(block=32)],
                         decode=[InstanceShape(block=32)], log_dir=tmp_path / "fleet", port=free_ports(1),
                         vllm_python=str(vllm_env.python))
    fleet = Fleet(config)
    try:
        fleet.start()
        fleet.wait_ready(900)
        killed = errors_by_second(fleet, "prefill-1", before_s=3.0, after_s=20.0)
        print(json.dumps(killed))
        assert killed["requests"] > 20, killed
        late = [b for b in killed["by_second"] if b["second"] >= 10 and b["errors"]]
        assert not late, killed
        assert sum(b["sent"] for b in killed["by_second"] if b["second"] >= 10) >= 10, killed  # served, not idle
        fleet.restart("prefill-1")
        fleet.wait_ready(900)
        starved = starved_member(fleet, "prefill-0", 60.0)
        print(json.dumps(starved))
        assert starved["health_samples"] >= 55 and starved["unhealthy_samples"] == 0, starved
        assert starved["errors"] == 0 and starved["requests"] > 0, starved
        assert starved["slowest_request_s"] >= 30, starved  # the stop was felt: requests waited for it
    finally:
        fleet.stop()
