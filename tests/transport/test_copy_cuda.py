"""The CUDA copy kernel (transport/copy_cuda.py). Its compiled form needs a GPU (`make gpu-check`
runs it there: docs/gpu.md); here Triton's interpreter runs the same kernel on CPU tensors over
random legal plans, and the host side (words, pieces) is checked on every axis by hypothesis."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import InvalidRequest
from kvbridge.transport import copy_cuda
from kvbridge.transport.cache import RankCache
from kvbridge.transport.local import LocalExecutor
from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _byte_pairs(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Every (source byte, destination byte) the runs copy, sorted."""
    run = np.repeat(np.arange(len(length)), length)
    within = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    out = np.stack([src[run] + within, dst[run] + within])
    return out[:, np.lexsort(out[::-1])]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20), st.integers(0, 700)), min_size=1,
                max_size=30), st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([2, 16, 4096]))
def test_pieces_copy_the_same_bytes_in_the_widest_word(runs, scale, piece_words):
    src, dst, length = (np.array(c, dtype=np.int64) * scale for c in zip(*runs))
    width = copy_cuda.word_width(src, dst, length)
    assert width == min(8, 1 << min(int(np.log2(np.bitwise_and(v, -v))) for v in [
        int(np.bitwise_or.reduce(np.concatenate([src, dst, length]))) | 8]))
    s, d, n = copy_cuda.pieces(src, dst, length, piece_words * width)
    assert (n <= piece_words * width).all() and all((a % width == 0).all() for a in (s, d, n))
    assert np.array_equal(_byte_pairs(s, d, n), _byte_pairs(src, dst, length))


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed here (it installs with the test extra on x86-64 "
                    "Linux); the compiled kernel runs on a GPU in make gpu-check")
def test_interpreted_kernel_executes_random_plans_exactly():
    script = Path(__file__).with_name("interpreted_copy.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(script), "40", "7"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    cases, runs, pieces = (int(w) for w in out.stdout.split()[1::2])
    assert cases == 40 and pieces > runs > 0  # every byte checked, long runs cut into pieces


def test_triton_backend_refuses_cpu_tensors():
    spec = ModelSpec.uniform(num_layers=1, num_kv_heads=2, head_dim=8)
    caches = RankCache.allocate_engine(spec, EngineLayout(num_blocks=2), fill=None)
    with pytest.raises(InvalidRequest, match="one CUDA device"):
        LocalExecutor(caches, caches, backend="triton")
    assert LocalExecutor(caches, caches).backend == "numba"  # auto on CPU tensors never picks the kernel
