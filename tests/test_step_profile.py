"""`integrations.vllm.step_profile`: off unless asked (no clock, no file), and when on, one
readable line per timed call from each process, on the host's monotonic clock."""

from __future__ import annotations

import os
import time

from kvbridge.integrations.vllm.step_profile import StepProfile, read_profiles


def test_off_by_default_writes_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KVBRIDGE_STEP_PROFILE", raising=False)
    prof = StepProfile()
    assert not prof.on
    with prof.span("schedule") as span:
        span.note(1, 2)
    prof.flush()
    assert list(tmp_path.iterdir()) == []


def test_spans_are_recorded_with_their_counts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVBRIDGE_STEP_PROFILE", str(tmp_path))
    prof = StepProfile()
    t0 = time.monotonic()
    with prof.span("start_load_kv") as span:
        span.note(3, 0)
    prof.record("sidecar", t0, 0.0125, "1.500", 2)
    prof.record("skipped", t0, 0.0)
    prof.flush()
    rows = read_profiles(tmp_path)[os.getpid()]
    assert [r[0] for r in rows] == ["start_load_kv", "sidecar", "skipped"]
    assert rows[0][3] == ["3", "0"] and rows[0][1] >= t0 and rows[0][2] >= 0
    assert rows[1][2] == 12.5 and rows[1][3] == ["1.500", "2"]
    quiet = StepProfile(str(tmp_path / "q"), min_ms=1.0)
    (tmp_path / "q").mkdir()
    quiet.record("short", t0, 0.0005)
    quiet.record("long", t0, 0.002)
    quiet.flush()
    assert [r[0] for r in read_profiles(tmp_path / "q")[os.getpid()]] == ["long"]
