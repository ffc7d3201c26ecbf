"""The CUDA twin of `copy.copy_runs`: one Triton kernel launch moves every run of a plan.

Why a kernel: the torch fallback (`LocalExecutor._execute_torch`) builds one index per element on
the host and uploads it, so a 512 MiB plan (Llama-3-8B, 4096 tokens, TP1 -> TP2) moved at
0.73 GB/s on an H200 beside 1,824 GB/s for a device copy of the same bytes (docs/gpu.md,
2026-11-26). Here the host sends one (source address, destination address, length) triple per
piece, and each Triton program copies one piece in words of the widest size that every address and
length allows. Runs longer than a piece (`BLOCK * STEPS` words) are cut on the host, so no
program walks a long run alone and short runs waste at most one masked step.

Triton is imported lazily: it ships with CUDA builds of torch, not with the CPU build CI uses, so
`available()` answers whether this path can run and the executor falls back to torch otherwise.
The kernel reads and writes raw device addresses: callers validate every run against its region
first (the executor does), and every address must lie on one device.
"""

from __future__ import annotations

import contextlib
import functools

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 1024  # words one program moves per step
STEPS = 2  # steps per program: a piece is at most BLOCK * STEPS words (16 KiB in 8-byte words)


def available() -> bool:
    """Whether Triton can be imported (CUDA builds of torch ship it)."""
    return _kernel() is not None


@functools.cache
def _kernel():  # pragma: no cover - needs triton (a CUDA torch build)
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_pieces(src_addr, dst_addr, words, WIDTH: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        piece = tl.program_id(0)
        if WIDTH == 8:
            kind = tl.int64
        elif WIDTH == 4:
            kind = tl.int32
        elif WIDTH == 2:
            kind = tl.int16
        else:
            kind = tl.int8
        src = tl.load(src_addr + piece).to(tl.pointer_type(kind))
        dst = tl.load(dst_addr + piece).to(tl.pointer_type(kind))
        n = tl.load(words + piece)
        offs = tl.arange(0, BLOCK)
        for step in range(STEPS):  # a constant trip count (pieces hold at most STEPS * BLOCK words):
            at = step * BLOCK + offs  # TRITON_INTERPRET=1, CI's run of this kernel, cannot loop to a loaded bound
            keep = at < n
            tl.store(dst + at, tl.load(src + at, mask=keep), mask=keep)

    return copy_pieces


def word_width(*arrays: np.ndarray) -> int:
    """The widest word (1, 2, 4 or 8 bytes) dividing every value of `arrays`."""
    bits = np.int64(8)
    for a in arrays:
        if len(a):
            bits |= np.bitwise_or.reduce(a.astype(np.int64, copy=False))
    return int(bits & -bits)


def pieces(src_addr: np.ndarray, dst_addr: np.ndarray, length: np.ndarray,
           piece_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs into pieces of at most `piece_bytes` (a multiple of the word width)."""
    count = np.maximum(-(-length // piece_bytes), 1)
    if (count == 1).all():
        return src_addr, dst_addr, length
    run = np.repeat(np.arange(len(length)), count)
    first = np.cumsum(count) - count
    shift = (np.arange(len(run)) - first[run]) * piece_bytes
    return src_addr[run] + shift, dst_addr[run] + shift, np.minimum(length[run] - shift, piece_bytes)


@dataclass(frozen=True)
class Pieces:
    """A plan's runs cut into pieces and uploaded: (source, destination, words) per piece."""

    triples: torch.Tensor  # int64 [3, pieces] on the device
    width: int  # bytes per word

    def __len__(self) -> int:
        return int(self.triples.shape[1])


def prepare(src_addr: np.ndarray, dst_addr: np.ndarray, length: np.ndarray, device: torch.device) -> Pieces:
    """Cut the runs (empty ones dropped) into pieces and upload the triples to `device`."""
    keep = length > 0
    src_addr, dst_addr, length = src_addr[keep], dst_addr[keep], length[keep]
    width = word_width(src_addr, dst_addr, length)
    s, d, n = pieces(src_addr, dst_addr, length, BLOCK * STEPS * width)
    return Pieces(torch.from_numpy(np.stack([s, d, n // width]).astype(np.int64)).to(device), width)


def launch(prepared: Pieces, kernel=None) -> None:  # pragma: no cover - needs triton
    """Launch the copy of `prepared` on the current stream of its device (asynchronous, like any
    CUDA copy). `kernel` defaults to the compiled one; CI passes the interpreted one (with
    TRITON_INTERPRET=1 and CPU tensors)."""
    kernel = kernel or _kernel()
    if kernel is None:
        raise RuntimeError("the CUDA copy kernel needs Triton, which this torch build does not ship")
    if not len(prepared):
        return
    t = prepared.triples
    with torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext():
        kernel[(len(prepared),)](t[0], t[1], t[2], WIDTH=prepared.width, BLOCK=BLOCK, STEPS=STEPS)
