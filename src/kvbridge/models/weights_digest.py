"""A digest of a model's weights that is cheap to take and tells other weights of one shape apart.

Why not hash every byte: a 70B model is 140 GB, and an engine states its KV identity at start.
Why not names and sizes alone: a fine-tune has the same shapes as its base. So each weight file
contributes its name, size and, for safetensors, its header (every tensor's dtype, shape and
offsets) and a sample of every tensor's bytes (its first and last `SAMPLE` bytes): a fine-tune,
a partial one included, changes whole tensors, and each tensor is sampled. Other formats
(`.bin`, `.pt`, `.gguf`, ...) contribute evenly spaced samples of the file. Files are read, never
loaded; a directory without weight files (a config only: weights drawn from a seed) digests as
such.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from kvbridge.errors import ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack")
SAMPLE = 4096
"""Bytes read at each end of every tensor (and at each sample point of other files)."""
FILE_SAMPLES = 64
MAX_FILES = 4096
MAX_HEADER = 100 << 20  # safetensors' own bound on its JSON header


def _sample(f, h, start: int, end: int) -> None:
    """Hash `SAMPLE` bytes at each end of `[start, end)` of open file `f` (all of it when short)."""
    n = end - start
    spans = [(start, n)] if n <= 2 * SAMPLE else [(start, SAMPLE), (end - SAMPLE, SAMPLE)]
    for at, length in spans:
        f.seek(at)
        h.update(f.read(length))


def _safetensors(path: Path, size: int, h) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ConfigError(f"{path.name}: not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ConfigError(f"{path.name}: safetensors header of {n} bytes in a file of {size}")
        raw = f.read(n)
        h.update(raw)
        try:
            header = json.loads(raw)
        except ValueError:
            raise ConfigError(f"{path.name}: safetensors header is not JSON") from None
        base = 8 + n
        for name in sorted(k for k in header if k != "__metadata__"):
            offsets = header[name].get("data_offsets") if isinstance(header[name], dict) else None
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                    or not 0 <= offsets[0] <= offsets[1] <= size - base):
                raise ConfigError(f"{path.name}: tensor {name[:80]!r} has data offsets {str(offsets)[:80]} outside "
                                  f"the file")
            _sample(f, h, base + offsets[0], base + offsets[1])


def _other(path: Path, size: int, h) -> None:
    with open(path, "rb") as f:
        for i in range(FILE_SAMPLES):
            at = (size - SAMPLE) * i // max(1, FILE_SAMPLES - 1) if size > SAMPLE else 0
            f.seek(at)
            h.update(f.read(SAMPLE))


def weights_digest(directory: str | os.PathLike) -> str:
    """The digest of the weight files in `directory` (see the module); hex, 32 characters."""
    root = Path(directory)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if len(files) > MAX_FILES:
        raise ConfigError(f"{root}: {len(files)} weight files, more than {MAX_FILES}")
    h = hashlib.blake2b(digest_size=16, person=b"kvb-weights")
    h.update(str(len(files)).encode())
    for p in files:
        size = p.stat().st_size
        h.update(f"\0{p.relative_to(root).as_posix()}\0{size}\0".encode())
        (_safetensors if p.suffix == ".safetensors" else _other)(p, size, h)
    return h.hexdigest()


__all__ = ["weights_digest"]
