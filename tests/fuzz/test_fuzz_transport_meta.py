"""Transport metadata and Hello bounds under fuzzing: atheris in a bounded child process
(`KVBRIDGE_FUZZ_RUNS` / `KVBRIDGE_FUZZ_SECONDS`, as tests/fuzz/test_fuzz_messages.py), and
hypothesis on the same contract (`fuzz_transport_meta.check_one_input`), on raw bytes, on
mutated valid inputs and on structured metadata with arbitrary numbers."""

from __future__ import annotations

import os
import random
import time

import msgspec
import pytest
from fuzz_messages import atheris_unavailable, run_atheris
from fuzz_transport_meta import check_one_input, seeds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.transport.agent import META_VERSION, AgentMeta, RegionInfo
from kvbridge.transport.shm import _ShmEngine

RUNS = int(os.environ.get("KVBRIDGE_FUZZ_RUNS", "20000"))
SECONDS = int(os.environ.get("KVBRIDGE_FUZZ_SECONDS", "10"))
SEEDS = seeds()
HERE = os.path.dirname(os.path.abspath(__file__))


def test_atheris_no_crash_no_hang(tmp_path) -> None:
    why = atheris_unavailable()
    if why:
        pytest.skip(why)
    r = run_atheris(RUNS, SECONDS, str(tmp_path), script=os.path.join(HERE, "fuzz_transport_meta.py"))
    print(f"atheris: {r['runs']} runs in {r['seconds']} s")
    assert not r["hung"], r["tail"]
    assert r["rc"] == 0 and not r["crashes"], f"crash (exit {r['rc']}, artifacts {r['crashes']}):\n{r['tail']}"
    assert r["runs"] > 0, r["tail"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_hypothesis_arbitrary_bytes(data: bytes) -> None:
    check_one_input(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.integers(0, 2**32 - 1), st.integers(1, 8))
def test_hypothesis_mutated_valid_inputs(seed: bytes, rnd: int, edits: int) -> None:
    rng = random.Random(rnd)
    data = bytearray(seed)
    for _ in range(edits):
        i = rng.randrange(1, len(data))
        data[i] = rng.randrange(256)
    check_one_input(bytes(data))


ints = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, -1, 1, 2**31, 2**40, 2**44 + 1, 2**63 - 1]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(max_size=80), max_size=4), st.lists(ints, max_size=4),
       st.lists(st.tuples(ints, ints, st.integers(-2, 2048)), max_size=4), st.lists(ints, max_size=4),
       st.lists(ints, max_size=4), ints, st.text(max_size=60))
def test_hypothesis_structured_metadata(names, sizes, regions, seg, off, pid, notify) -> None:
    """Well-formed msgpack with absurd numbers and names: refused in bounded time, never a crash."""
    try:
        engine = msgspec.msgpack.encode(_ShmEngine(names, sizes, seg, off))
        meta = msgspec.msgpack.encode(AgentMeta(META_VERSION, "shm", "peer", "host", pid, notify,
                                                [RegionInfo(a, n, d) for a, n, d in regions], None, 0, engine))
    except OverflowError:
        return  # not encodable by msgpack: a peer cannot send it either
    t0 = time.perf_counter()
    check_one_input(b"\0" + meta)
    assert time.perf_counter() - t0 < 0.5
