"""Two fleets on one host (issue 28 points 4 and 5): started side by side, they get disjoint ports
(reserved, not only checked); one stops and removes only its own shared memory, and the other
serves on with every segment it had. Real `vllm serve` instances behind two `vllm-router`s.
"""

from __future__ import annotations

import os

import pytest

from kvbridge.integrations.vllm.fleet import Fleet, FleetConfig, InstanceShape
from kvbridge.integrations.vllm.fleet_processes import session_segments
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
from kvbridge.testing.serving import prompt_text, request
from kvbridge.transport.ports import PortReservations

pytestmark = [pytest.mark.vllm, pytest.mark.fleet]  # `make fleet-tests`: minutes of vLLM (re)starts


def test_two_fleets_start_side_by_side_and_stop_apart(vllm_env, tmp_path):
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "tiny-llama", seed=3))
    probe = PortReservations()
    ports = [probe.run(["127.0.0.1"]) for _ in range(2)]
    probe.release()
    fleets = [Fleet(FleetConfig(model=model, prefill=[InstanceShape()], decode=[InstanceShape()],
                                log_dir=tmp_path / f"fleet-{i}", port=p, vllm_python=str(vllm_env.python)))
              for i, p in enumerate(ports)]
    a, b = fleets
    try:
        assert not set(a.summary()["ports"]) & set(b.summary()["ports"])
        for f in fleets:
            f.start()
        for f in fleets:
            f.wait_ready(900)
        text = prompt_text(5, 100)
        before = request(b.endpoint, text, 8)
        assert before.ok and request(a.endpoint, text, 8).ok
        # (a mapped file may be unlinked already: Python's semaphores are, named only in /proc/PID/maps)
        b_segments = {s for s in session_segments(*(m.proc.pid for m in b.everyone()))
                      if os.path.exists(f"/dev/shm/{s}")}
        assert any(s.startswith("kvbridge-") for s in b_segments), b_segments
        a.stop()
        assert all(os.path.exists(f"/dev/shm/{s}") for s in b_segments), \
            [s for s in b_segments if not os.path.exists(f"/dev/shm/{s}")]
        assert not [s for s in a.segments if os.path.exists(f"/dev/shm/{s}")]
        after = request(b.endpoint, prompt_text(6, 120), 8)
        assert after.ok, after.error
        assert request(b.endpoint, text, 8).token_ids == before.token_ids
    finally:
        for f in fleets:
            f.stop()
