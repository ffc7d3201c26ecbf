"""`connector.peer_bounds`: a Hello's numbers are bounded before anything depends on them, and
an absurd one is refused in microseconds (it used to cost seconds and a GB per request)."""

from __future__ import annotations

import time

import pytest

from kvbridge.connector import messages as m
from kvbridge.connector.handshake import make_hello, validate_peer
from kvbridge.connector.messages import HandshakeRefused
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.core.topology import TransferTopology

SPEC = ModelSpec.uniform(32, 8, 128, "bfloat16", name="llama-like")
MINE = EngineLayout(tp_size=1, block_size=16, num_blocks=64)


def _hello(**layout) -> m.Hello:
    kw = {"tp_size": 1, "block_size": 16, "num_blocks": 64, **layout}
    return make_hello("evil", 0, "decode", "pull", SPEC, EngineLayout(**kw), "shm", "evil/0", b"")


@pytest.mark.parametrize("layout,expect", [
    ({"tp_size": 1_000_000}, "tp_size 1000000: the bound is 256"),
    ({"tp_size": 257}, "tp_size 257: the bound is 256"),
    ({"block_size": 1 << 17}, "block_size 131072: the bound is 65536 tokens"),
    ({"num_blocks": 1 << 40}, "1099511627776 blocks per rank: the bound is 2147483648"),
])
def test_absurd_hello_refused_in_microseconds(layout, expect) -> None:
    frame = m.encode(_hello(**layout))
    mine = make_hello("prefill", 0, "prefill", "pull", SPEC, MINE, "shm", "p/0", b"")
    times = []
    for _ in range(50):
        topology = TransferTopology("prefill", SPEC, MINE, 0)
        t0 = time.perf_counter()
        with pytest.raises(HandshakeRefused, match=expect):
            validate_peer(topology, mine, m.decode(frame))
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{layout}: median {times[25] * 1e6:.0f} us (decode + refusal)")
    assert times[25] < 2e-3  # ~250 us here (mostly decoding a 32-layer spec); generous for a loaded host


def test_sizes_and_addresses_bounded() -> None:
    mine = make_hello("prefill", 0, "prefill", "pull", SPEC, MINE, "shm", "p/0", b"")
    big = make_hello("evil", 0, "decode", "pull", SPEC, EngineLayout(tp_size=1, num_blocks=64), "shm", "evil/0",
                     b"x" * (600 << 10))
    with pytest.raises(HandshakeRefused, match="transport metadata: the bound is"):
        validate_peer(TransferTopology("prefill", SPEC, MINE, 0), mine, big)
    many = make_hello("evil", 0, "decode", "pull", SPEC, EngineLayout(tp_size=2, num_blocks=64), "shm", "evil/0",
                      b"", ("127.0.0.1:1",) * 3)
    with pytest.raises(HandshakeRefused, match="3 rank addresses for an engine of TP size 2"):
        validate_peer(TransferTopology("prefill", SPEC, MINE, 0), mine, many)
    ok = validate_peer(TransferTopology("prefill", SPEC, MINE, 0), mine, _hello(tp_size=8))
    assert ok.tp_size == 8
