"""Every compiled copy kernel in one place: the executor, the staging paths, shm, offload and the
rank hosts all move bytes through these.

Two loops on purpose. `copy_runs` is numba's *parallel* loop over a plan's runs, for copies that
are themselves the transfer (the local executor, shm, offload). `copy_addresses_serial` runs in
the calling thread and releases the GIL, for copies beside a transfer engine (staging windows):
after a parallel region ends its OpenMP threads spin, and on a small host that spinning took a
quarter of the CPU the engine's own threads needed.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_COPY_LOCK = threading.Lock()


@intrinsic
def _memcpy(typingctx, dst_addr, src_addr, nbytes):  # pragma: no cover - compiled
    """LLVM's memcpy between raw addresses; an intrinsic keeps `copy_runs` cacheable on disk."""
    def codegen(context, builder, signature, args):
        dst, src, n = args
        cgutils.raw_memcpy(builder, builder.inttoptr(dst, cgutils.voidptr_t),
                           builder.inttoptr(src, cgutils.voidptr_t), n, 1)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


@numba.njit(parallel=True, nogil=True, cache=True)
def copy_runs(src_base, dst_base, src_region, src_off, dst_region, dst_off, length):  # pragma: no cover - compiled
    """memcpy every run; regions are given by base address, so any process-visible memory works."""
    for i in numba.prange(length.shape[0]):
        _memcpy(dst_base[dst_region[i]] + dst_off[i], src_base[src_region[i]] + src_off[i], length[i])


@numba.njit(nogil=True, cache=True)
def copy_addresses_serial(src_addr, dst_addr, length):  # pragma: no cover - compiled
    """memcpy `length[i]` bytes from `src_addr[i]` to `dst_addr[i]`, in the calling thread.

    For copies that run beside a transfer engine (staging windows): a parallel region's OpenMP
    threads spin after it ends, and on a small host that spinning took a quarter of the CPU the
    engine's own threads needed. Releases the GIL, so concurrent windows copy in parallel.
    """
    for i in range(length.shape[0]):
        _memcpy(dst_addr[i], src_addr[i], length[i])


def int64_array(a: np.ndarray) -> np.ndarray:
    """Contiguous, writable int64: one compiled signature for every caller."""
    return np.require(a, np.int64, ["C", "W"])


def copy_addresses(src_addr: np.ndarray, dst_addr: np.ndarray, length: np.ndarray, parallel: bool = False) -> None:
    """memcpy `length[i]` bytes from `src_addr[i]` to `dst_addr[i]` for every i (compiled).

    Serial by default (`copy_addresses_serial`: staging copies run beside an engine's
    threads); `parallel` uses numba's parallel loop, for a copy that is itself the transfer.
    """
    if not len(length):
        return
    src, dst, ln = int64_array(src_addr), int64_array(dst_addr), int64_array(length)
    if not parallel:
        copy_addresses_serial(src, dst, ln)
        return
    zero_base = np.zeros(1, np.int64)
    zero_idx = np.zeros(len(ln), np.int64)
    if _needs_copy_lock():
        with _COPY_LOCK:
            copy_runs(zero_base, zero_base, zero_idx, src, zero_idx, dst, ln)
    else:
        copy_runs(zero_base, zero_base, zero_idx, src, zero_idx, dst, ln)


def _needs_copy_lock() -> bool:
    try:
        return numba.threading_layer() == "workqueue"
    except ValueError:  # no parallel function ran yet in this process
        return True
