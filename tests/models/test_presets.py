"""Presets answer without transformers, and what they answer is what transformers derives."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbridge.errors import ConfigError
from kvbridge.models.presets import PRESETS, derive_all, preset_spec


def test_stored_preset_specs_equal_what_transformers_derives():
    """If this fails, regenerate with `python -m kvbridge.models.presets`."""
    derived = derive_all()
    assert set(derived) == set(PRESETS)
    for name, spec in derived.items():
        assert preset_spec(name) == spec, name


def test_plan_on_a_preset_imports_no_transformers():
    code = ("import sys; from kvbridge.cli.app import load_spec; s = load_spec('llama-3-8b'); "
            "print(s.num_layers, 'transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["32", "False", "False"]


def test_unknown_preset_is_refused():
    with pytest.raises(ConfigError, match="unknown preset"):
        preset_spec("llama-99")
