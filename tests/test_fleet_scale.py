"""A fleet's per-rank cost follows the law docs/serving.md ("Scale") states (issue 28 point 8):
the scans of `make fleet-scale`, at 2 engines of TP 2 a side, with real connector ranks, shm
agents and authenticated side channels on loopback in a spawned crowd process.

Counts only (connections, descriptors, ZMQ mailboxes, mapped segments, threads), never timings:
a rank's holdings grow by a fixed amount per remote engine, and prefill rank 0, where every
decode rank's handshake starts, holds only the decode ranks that read it (issue 44.1).
"""

from __future__ import annotations

import resource
import subprocess
import sys
from dataclasses import asdict

from kvbridge.bench.fleet_scale import decode_scan, law, prefill_scan, zmq_caps
from kvbridge.transport.descriptors import socket_budget

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


def test_prefill_rank_zero_holds_only_the_decode_ranks_that_read_it():
    """Issue 44.1: every decode rank says Hello to rank 0 first, to learn the engine's ranks;
    before, each Hello connected rank 0's transport to it (TP peers per decode engine)."""
    scan = prefill_scan(STEPS, tp=TP, crowds=2)
    _check(scan, "prefill")
    # rank 1 of the same engine hears only its own readers: one decode rank per decode engine
    assert [tuple(r) for r in scan.crowd_ranks] == [(1, STEPS[-1], STEPS[-1])]
    # A restarted prefill engine: every decode rank of the crowd reaches it at once, none times out.
    assert scan.storm["decode_ranks"] == STEPS[-1] * TP and scan.storm["failed"] == 0, scan.storm


def test_zmq_contexts_hold_as_many_sockets_as_the_descriptors_allow():
    """Issue 44.2: ZMQ's default 1,023 sockets per context capped a transport channel at 1,022
    peers and a process's side channels at 341 (docs/fleet-scale.json of 2026-11-27)."""
    caps = zmq_caps(probe_peers=2048)
    budget = caps["max_sockets_per_context"]
    assert budget == socket_budget() == max(1023, min(65535, caps["descriptor_limit"] // 4))
    assert caps["transport_channel_peers"] == min(2048, budget - 1)  # its PULL is the first socket
    if budget >= 3 * 2048 + 64:  # room for every probe client (3 sockets each) in the side channel's context
        assert caps["side_channel_clients"] == 2048, caps
    assert caps["side_channel_clients"] <= budget // 3  # a DEALER and its monitor pair each


def test_a_process_raises_its_soft_descriptor_limit_to_the_hard_one():
    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard)); "
            "from kvbridge.connector.side_channel import SideChannelClient; "
            "c = SideChannelClient('127.0.0.1:9', b'probe'); c.close(); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    soft, hard = (int(v) for v in out.stdout.split())
    assert soft == min(hard if hard != resource.RLIM_INFINITY else soft, 1 << 17) and soft > 256


def test_the_socket_budget_follows_the_limit():
    assert socket_budget(1024) == 1023  # never below ZMQ's default
    assert socket_budget(20_000) == 5_000  # a quarter: two or more contexts, each socket a descriptor or two
    assert socket_budget(1 << 20) == 65535  # what libzmq can poll
