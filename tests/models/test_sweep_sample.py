"""The bounded CI sample of the model sweep (`make models` runs all of it): one architecture per
state kind, plus a rotation of the architectures docs/models.md lists as moved, chosen by
KVBRIDGE_SWEEP_SEED (default: the day number, so CI covers a different few each day; the test id
names the architecture, so a failure reproduces with `-k`). Each moved architecture also writes its
`--dump-decode-cache` file and reads it back bit for bit (`model_sweep.check_dump`)."""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path

import pytest

from kvbridge.proofs.model_sweep import PAIRS, causal_lm_types, representatives, sweep_one

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
ROTATION = 3


def _documented_moved() -> list[str]:
    if not DOC.is_file():
        return []
    return sorted(m.group(1) for m in re.finditer(r"^\| (\S+) \| [^|]* \| moved \|", DOC.read_text(), re.M))


def _sample() -> list[str]:
    reps = list(dict.fromkeys(representatives().values()))
    seed = int(os.environ.get("KVBRIDGE_SWEEP_SEED", int(time.time() // 86400)))
    installed = set(causal_lm_types())
    rest = [a for a in _documented_moved() if a not in reps and a in installed]
    return reps + random.Random(seed).sample(rest, min(ROTATION, len(rest)))


@pytest.mark.parametrize("arch", _sample())
def test_sampled_architecture_moves_bit_exactly(arch):
    row = sweep_one(arch, timeout=300)
    assert row.status == "moved", f"{arch}: {row.status}: {row.detail}"
    assert len(row.pairs) == len(PAIRS)


@pytest.mark.parametrize("arch", ["openai-gpt", "xlnet", "gemma4_assistant"])
def test_architectures_without_a_cache_of_their_own_are_refused_in_one_line_naming_the_layers(arch):
    row = sweep_one(arch, timeout=120)
    assert row.status == "refused" and re.match(r"layers? 0\b", row.detail) and "\n" not in row.detail, row.detail
    assert "nothing to move" in row.detail
