"""The connector's sidecar processes without vLLM: two "engine ranks" whose caches are shared
memory segments laid out like vLLM CPU's, one sidecar each, a request moved prefill -> decode.

This is what runs inside vLLM minus vLLM: the worker's cache is a /dev/shm segment, the sidecar
maps it by path, leases / receives over kvbridge's side channel and shm transport, and reports
`Released` / `Received` over its pipe. Every byte the decode rank's kernels would read is
checked against the prefill rank's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.integrations.vllm.cache_handles import CpuSegment, Region
from kvbridge.integrations.vllm.layout import vllm_cpu_layout, vllm_cpu_spec
from kvbridge.integrations.vllm.settings import Settings
from kvbridge.integrations.vllm.sidecar import SidecarClient, SidecarError
from kvbridge.integrations.vllm.sidecar_protocol import Abandon, Init, Received, Recv, Released, Send
from kvbridge.transport.cache import RankCache
from kvbridge.core.spec import ModelSpec
from kvbridge.transport.shm import SharedSegment

SPEC = vllm_cpu_spec(ModelSpec.uniform(2, 2, 32, "float32", name="tiny"))
SECRET = "sidecar-test-secret-0123456789"  # both sidecars of a test share it


class Engine:
    """One rank's cache in one shared segment, as the connector's allocation context makes it."""

    def __init__(self, layout, rank: int, fill: int | None = None):
        self.layout, self.rank = layout, rank
        nbytes = layout.addressing(SPEC, rank).region_nbytes
        self.offsets = [int(o) for o in np.cumsum([0, *nbytes[:-1]])]
        self.seg = SharedSegment(sum(nbytes), f"test-sidecar-r{rank}")
        if fill is not None:
            gen = torch.Generator().manual_seed(fill)
            self.seg.tensor.copy_(torch.randint(0, 256, (self.seg.nbytes,), dtype=torch.uint8, generator=gen))
        self.cache = RankCache(SPEC, layout, rank, [self.seg.view(o, n) for o, n in zip(self.offsets, nbytes)])

    def init(self, engine_id: str, produce: bool, port: int, **settings) -> Init:
        nbytes = self.layout.addressing(SPEC, self.rank).region_nbytes
        return Init(engine_id, self.rank, produce, not produce, SPEC, self.layout.plain(),
                    [CpuSegment(self.seg.path, self.seg.nbytes)],
                    [Region(0, o, n) for o, n in zip(self.offsets, nbytes)],
                    Settings(**{"side_channel_port": port, "lease_seconds": 20, "transfer_timeout": 20,
                                "handshake_timeout": 10, "secret": SECRET, **settings}))


def wait(clients, want, timeout=60.0):
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in clients:
            got.extend(c.events())
        if want(got):
            return got
        time.sleep(0.01)
    raise AssertionError(f"events so far: {got}")


def kv(engine: Engine, ids, n: int) -> torch.Tensor:
    comps = len(SPEC.layers[0].components)
    return torch.cat([engine.cache.read_tokens(li, c, np.asarray(ids), np.arange(n), as_int=True).flatten(1)
                      for li in range(2) for c in range(comps)], dim=1)


@pytest.mark.parametrize("p_block,d_block,transport,mode", [
    (32, 32, "shm", "pull"), (64, 32, "shm", "pull"), (32, 64, "shm", "push"),
    (32, 32, "nixl", "pull"), (32, 32, "mooncake", "pull")])
def test_prefill_sidecar_to_decode_sidecar(p_block, d_block, transport, mode):
    from kvbridge.connector.transports import unavailable_reason
    if unavailable_reason(transport):
        pytest.skip(f"{transport}: {unavailable_reason(transport)}")
    p = Engine(vllm_cpu_layout(1, p_block, 8), 0, fill=1)
    d = Engine(vllm_cpu_layout(1, d_block, 8), 0)
    port = free_ports(1)
    n, p_ids, d_ids = 70, (5, 2, 7)[: -(-70 // p_block)], (6, 1, 3)[: -(-70 // d_block)]
    prod = SidecarClient(p.init("P", True, port, transport=transport, mode=mode))
    cons = SidecarClient(d.init("D", False, free_ports(1), transport=transport, mode=mode))
    try:
        assert prod.ready.address == f"127.0.0.1:{port}" and cons.ready.address == ""
        prod.send(Send("req-1", (p_ids,), n))
        cons.send(Recv("dec-1", "req-1", "P", prod.ready.address, (d_ids,), n, 0))
        events = wait([prod, cons], lambda ev: any(isinstance(e, Released) for e in ev)
                      and any(isinstance(e, Received) for e in ev))
        assert Received("dec-1", True) in events and Released("req-1", "done") in events
        assert torch.equal(kv(d, d_ids, n), kv(p, p_ids, n))
    finally:
        prod.close()
        cons.close()
    assert not prod.alive and not cons.alive


def test_an_unnamed_request_waits_for_its_claimant_not_the_only_decode_engine_connected():
    """vLLM's router names no decode engine to the prefill instance, and decode engines connect to
    a prefill engine on their first request from it. With decode-1 connected (it read req-1) and
    decode-0 not yet, req-2 is held until decode-0 claims it, then moved to decode-0; leasing it to
    the only engine connected left decode-0 waiting for it until its deadline."""
    p = Engine(vllm_cpu_layout(1, 32, 8), 0, fill=5)
    d0, d1 = Engine(vllm_cpu_layout(1, 32, 8), 0), Engine(vllm_cpu_layout(1, 32, 8), 0)
    n, p_ids, d_ids = 70, [(5, 2, 7), (1, 3, 4)], (6, 1, 3)
    prod = SidecarClient(p.init("P", True, free_ports(1)))
    cons = [SidecarClient(d.init(f"decode-{i}", False, free_ports(1))) for i, d in enumerate((d0, d1))]
    try:
        prod.send(Send("req-1", (p_ids[0],), n))
        cons[1].send(Recv("dec-1", "req-1", "P", prod.ready.address, (d_ids,), n, 0))
        first = wait([prod, cons[1]], lambda ev: Received("dec-1", True) in ev and Released("req-1", "done") in ev)
        prod.send(Send("req-2", (p_ids[1],), n))
        time.sleep(1.0)  # the prefill sidecar holds req-2 with decode-1 its only engine
        cons[0].send(Recv("dec-2", "req-2", "P", prod.ready.address, (d_ids,), n, 0))
        events = wait([prod, cons[0], cons[1]], lambda ev: any(isinstance(e, Received) for e in ev), timeout=30)
        assert Received("dec-2", True) in events, (first, events)
        assert torch.equal(kv(d0, d_ids, n), kv(p, p_ids[1], n))
        assert torch.equal(kv(d1, d_ids, n), kv(p, p_ids[0], n))  # decode-1 got nothing of req-2
    finally:
        for c in (prod, *cons):
            c.close()


def test_a_claim_that_arrives_before_the_prefill_finished_is_honoured_at_once():
    """The router hands the decode engine a request as soon as the prefill instance answers, and
    the prefill worker tells its sidecar a step later: the decode engine's claim often arrives
    first. The prefill sidecar keeps it and leases the request the moment it is told, not at the
    next periodic heartbeat (lease/6: 100 s here, so the bound below is liveness, not speed)."""
    p = Engine(vllm_cpu_layout(1, 32, 8), 0, fill=5)
    d = Engine(vllm_cpu_layout(1, 32, 8), 0)
    n, p_ids, d_ids = 70, [(5, 2, 7), (1, 3, 4)], [(6, 1, 3), (0, 2, 4)]
    long = {"lease_seconds": 600, "transfer_timeout": 600}
    prod = SidecarClient(p.init("P", True, free_ports(1), **long))
    cons = SidecarClient(d.init("decode-0", False, free_ports(1), **long))
    try:
        prod.send(Send("req-1", (p_ids[0],), n))
        cons.send(Recv("dec-1", "req-1", "P", prod.ready.address, (d_ids[0],), n, 0))
        wait([prod, cons], lambda ev: Received("dec-1", True) in ev and Released("req-1", "done") in ev)
        cons.send(Recv("dec-2", "req-2", "P", prod.ready.address, (d_ids[1],), n, 0))  # claims req-2
        time.sleep(1.0)
        t0 = time.monotonic()
        prod.send(Send("req-2", (p_ids[1],), n))
        events = wait([prod, cons], lambda ev: any(isinstance(e, Received) for e in ev), timeout=90)
        assert Received("dec-2", True) in events, events
        assert time.monotonic() - t0 < 50.0, "leased at a periodic heartbeat, not on the claim"
        assert torch.equal(kv(d, d_ids[1], n), kv(p, p_ids[1], n))
    finally:
        for c in (prod, cons):
            c.close()


def test_a_stopped_sidecar_never_holds_the_step_that_sends_to_it():
    """Issue 31: the worker sends a step's commands from the engine step. With the decode sidecar
    stopped (SIGSTOP: a starved process), a step's worth of commands far beyond the pipe's buffer
    is sent and every call returns, the rest waiting in the client's outbox; once the sidecar is
    continued, the request among them is moved and its bytes are the prefill rank's."""
    import os
    import signal
    import threading

    p = Engine(vllm_cpu_layout(1, 32, 8), 0, fill=3)
    d = Engine(vllm_cpu_layout(1, 32, 8), 0)
    n, p_ids, d_ids = 70, (5, 2, 7), (6, 1, 3)
    prod = SidecarClient(p.init("P", True, free_ports(1)))
    cons = SidecarClient(d.init("D", False, free_ports(1)))
    try:
        prod.send(Send("req-1", (p_ids,), n))
        os.kill(cons.proc.pid, signal.SIGSTOP)
        # Abandons of an engine it never met are ignored by the sidecar: only the pipe fills.
        filler = [Abandon("nobody", f"r{i:05d}-" + "x" * 64) for i in range(4000)]
        steps = [filler[i:i + 500] for i in range(0, len(filler), 500)]
        steps[-1].append(Recv("dec-1", "req-1", "P", prod.ready.address, (d_ids,), n, 0))
        sender = threading.Thread(target=lambda: [cons.send_all(s) for s in steps], daemon=True)
        sender.start()
        sender.join(120)  # liveness, not speed: a blocking write returns only once the sidecar reads
        assert not sender.is_alive(), "a send waited for the stopped sidecar"
        assert cons.unsent > 100_000
        os.kill(cons.proc.pid, signal.SIGCONT)
        events = wait([prod, cons], lambda ev: any(isinstance(e, Received) for e in ev)
                      and any(isinstance(e, Released) for e in ev))
        assert Received("dec-1", True) in events and Released("req-1", "done") in events
        assert cons.unsent == 0
        assert torch.equal(kv(d, d_ids, n), kv(p, p_ids, n))
    finally:
        if cons.alive:
            os.kill(cons.proc.pid, signal.SIGCONT)
        prod.close()
        cons.close()
    assert not prod.alive and not cons.alive


def test_sidecar_refuses_bad_init_and_reports_it():
    p = Engine(vllm_cpu_layout(1, 32, 8), 0)
    init = p.init("P", True, free_ports(1))
    init.regions = [init.regions[0], Region(0, p.seg.nbytes, init.regions[1].nbytes)]  # past the segment
    with pytest.raises(SidecarError, match="outside the .*segment"):
        SidecarClient(init)


def test_settings_name_unknown_and_bad_fields():
    from kvbridge.errors import ConfigError
    with pytest.raises(ConfigError, match="side_chanel_port"):
        Settings.from_extra({"side_chanel_port": 1})
    with pytest.raises(ConfigError, match="mode"):
        Settings.from_extra({"mode": "teleport"})
    assert Settings.from_extra({"side_channel_port": 6000, "insecure": True}).side_channel_port == 6000
