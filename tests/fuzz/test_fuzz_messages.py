"""The side-channel decoder under fuzzing: atheris (libFuzzer, coverage-guided) in a bounded child
process, and hypothesis on the same contract (`fuzz_messages.check_one_input`) in this one.

CI: `KVBRIDGE_FUZZ_RUNS` inputs (default 50,000) or `KVBRIDGE_FUZZ_SECONDS` of fuzzing (default 20),
whichever ends first, under a hard wall clock. A longer run:
`KVBRIDGE_FUZZ_RUNS=0 KVBRIDGE_FUZZ_SECONDS=600 .venv/bin/python -m pytest tests/fuzz -s`
(0 runs: bounded by time only)."""

from __future__ import annotations

import os
import random

import pytest
from fuzz_messages import atheris_unavailable, check_one_input, run_atheris, seeds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

RUNS = int(os.environ.get("KVBRIDGE_FUZZ_RUNS", "50000"))
SECONDS = int(os.environ.get("KVBRIDGE_FUZZ_SECONDS", "20"))
SEEDS = seeds()


def test_atheris_no_crash_no_hang(tmp_path) -> None:
    why = atheris_unavailable()
    if why:
        pytest.skip(why)
    r = run_atheris(RUNS, SECONDS, str(tmp_path))
    print(f"atheris: {r['runs']} runs in {r['seconds']} s (wall {r['wall_seconds']:.1f} s, corpus "
          f"{r['corpus_files']} files)")
    assert not r["hung"], f"the fuzzer did not finish within its wall clock:\n{r['tail']}"
    assert r["rc"] == 0 and not r["crashes"], f"crash (exit {r['rc']}, artifacts {r['crashes']}):\n{r['tail']}"
    assert r["runs"] > 0, r["tail"]
    if RUNS > 0 and r["seconds"] is not None and r["seconds"] < SECONDS:
        assert r["runs"] == RUNS, r["tail"]  # stopped by the run count, not early


def test_seeds_are_accepted() -> None:
    for s in SEEDS:
        check_one_input(s)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=1024))
def test_hypothesis_arbitrary_bytes(data: bytes) -> None:
    check_one_input(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SEEDS), st.integers(0, 2**32 - 1), st.integers(1, 8))
def test_hypothesis_mutated_valid_frames(seed: bytes, rnd: int, edits: int) -> None:
    """Valid frames of every type and path (with and without the secret), bytes flipped, dropped,
    inserted, duplicated or truncated."""
    rng = random.Random(rnd)
    data = bytearray(seed)
    for _ in range(edits):
        op = rng.randrange(5) if len(data) > 1 else 2  # (a byte or none left: insert)
        i = rng.randrange(1, len(data)) if len(data) > 1 else len(data)
        if op == 0:
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            del data[i]
        elif op == 2:
            data.insert(i, rng.randrange(256))
        elif op == 3:
            j = rng.randrange(i, len(data) + 1)
            data[i:i] = data[i:j]
        else:
            del data[i:]
    check_one_input(bytes(data))
