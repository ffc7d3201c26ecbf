"""A fleet's per-rank cost follows the law docs/serving.md ("Scale") states (issue 28 point 8):
the scans of `make fleet-scale`, at 2 engines of TP 2 a side, with real connector ranks, shm
agents and authenticated side channels on loopback in a spawned crowd process.

Counts only (connections, descriptors, ZMQ mailboxes, mapped segments, threads), never timings:
a rank's holdings grow by a fixed amount per remote engine, and prefill rank 0 pays for every
rank of every decode engine (each decode rank's handshake starts there).
"""

from __future__ import annotations

from dataclasses import asdict

from kvbridge.bench.fleet_scale import decode_scan, law, prefill_scan, zmq_caps

TP = 2
STEPS = (1, 2)
GROWN = ("fds", "eventfds")  # these carry a constant from the first connection: compared as growth


def _check(scan, side: str) -> None:
    assert [r.engines for r in scan.rows] == list(STEPS)
    for row in scan.rows:
        want = law(side, row.engines, TP)
        got = asdict(row.counts)
        assert row.side_channels == want["side_channels"], (side, row)
        assert row.transport_peers == want["transport_peers"], (side, row)
        for key in ("tcp_established", "shm_maps"):
            assert got[key] == want[key], (side, key, row)
        assert got["threads"] == scan.rows[0].counts.threads, (side, "threads grew with the fleet", row)
        assert got["tcp_listening"] == 0, row
    first, last = asdict(scan.rows[0].counts), asdict(scan.rows[-1].counts)
    grown = law(side, STEPS[-1] - STEPS[0], TP)
    for key in GROWN:
        assert last[key] - first[key] == grown[key], (side, key, scan.rows)


def test_a_decode_rank_holds_a_fixed_set_per_prefill_engine():
    _check(decode_scan(STEPS, tp=TP, crowds=1), "decode")


def test_prefill_rank_zero_holds_one_peer_per_decode_rank():
    scan = prefill_scan(STEPS, tp=TP, crowds=2)
    _check(scan, "prefill")
    # rank 1 of the same engine hears only its own readers: one decode rank per decode engine
    assert [tuple(r) for r in scan.crowd_ranks] == [(1, STEPS[-1], STEPS[-1])]


def test_zmq_refuses_the_socket_past_its_per_context_cap():
    caps = zmq_caps()
    cap = caps["max_sockets_per_context"]
    assert caps["transport_channel_peers"] == cap - 1  # its PULL is the first socket
    assert caps["side_channel_clients"] <= cap // 3  # a DEALER and its monitor pair each
