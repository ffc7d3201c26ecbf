"""The figure sheet runs the scenarios CI runs, and the hostile-frame scenario holds."""

from __future__ import annotations

import importlib.util
import logging
import pathlib

import test_connector_soak
import test_connector_soak_multiprocess

from kvbridge.testing import reliability

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("reliability_report", ROOT / "scripts" / "reliability_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_uses_the_ci_scenarios() -> None:
    mod = _script()
    assert mod.SCENARIOS["soak"] is reliability.soak is test_connector_soak.soak
    assert mod.SCENARIOS["garbage_frames"] is reliability.garbage_frames
    assert (mod.SCENARIOS["multiprocess_soak"] is reliability.multiprocess_soak
            is test_connector_soak_multiprocess.multiprocess_soak)
    # the atheris runner tests/fuzz/test_fuzz_messages.py calls (that directory is not importable from here)
    fuzz = mod.SCENARIOS["atheris"]
    assert fuzz.__name__ == "run_atheris"
    assert pathlib.Path(fuzz.__code__.co_filename).resolve() == ROOT / "tests" / "fuzz" / "fuzz_messages.py"
    sheet = (ROOT / "docs" / "reliability.md").read_text()
    assert "## Load held through multi-process engines" in sheet and "atheris" in sheet


def test_garbage_frames_refused_and_service_continues() -> None:
    logging.getLogger("kvbridge").setLevel(logging.ERROR)
    g = reliability.garbage_frames(500)
    assert g["refused"] == g["sent"] == 500 and g["aborts_counted"] == 0 and g["released_before"] == 0
    assert g["after_ok"], g["after_reason"]
