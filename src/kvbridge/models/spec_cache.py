"""A model directory's spec, remembered between runs: `kvbridge serve` checks its shapes before
anything starts, and deriving the spec (`spec_from_hf_config`) imports transformers and torch,
5-7 s at every start (more on a loaded host) for a model whose config did not change.

The key is everything the derivation reads or runs: the directory's `config.json` and its
Python files (a model's own config class, `auto_map`), kvbridge's model code, and the installed
transformers' version. The entry keeps the warning lines the derivation wrote, and a hit writes
them again, so a start says the same either way. Entries live in `~/.cache/kvbridge/specs`
(`$XDG_CACHE_HOME`), a directory of this user's, mode 0700; an entry that cannot be read or
written is derived again, never trusted half-written (written beside, then renamed).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import msgspec

from kvbridge.core.spec import ModelSpec

_CODE = ("models", "core/spec.py")
"""kvbridge's code the derivation runs (under src/kvbridge): a change of it is a new key."""


KEEP = 256
"""Entries kept (a few hundred bytes each)."""


class _Entry(msgspec.Struct, frozen=True):
    spec: ModelSpec
    warnings: str = ""


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvbridge" / "specs"


def _code_digest() -> bytes:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in _CODE:
        p = root / part
        for f in sorted(p.rglob("*.py") if p.is_dir() else [p]):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.digest()


def key(model_dir: str | os.PathLike) -> str:
    d = Path(model_dir)
    h = hashlib.sha256(b"kvbridge-spec-1\0")
    try:
        h.update(metadata.version("transformers").encode())
    except metadata.PackageNotFoundError:
        h.update(b"no transformers")
    h.update(_code_digest())
    for f in [d / "config.json", *sorted(d.glob("*.py"))]:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:40]


def spec_of_dir(model_dir: str | os.PathLike) -> ModelSpec:
    """`spec_from_hf_config(model_dir)`, from the cache when the key's inputs are unchanged (its
    warning lines written to stderr again); a refusal is never cached."""
    from kvbridge.models import spec_from_hf_config

    try:
        entry_path = cache_dir() / f"{key(model_dir)}.json"
    except OSError:  # config.json unreadable: the derivation says so in its own words
        return spec_from_hf_config(str(model_dir))
    with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
        entry = msgspec.json.decode(entry_path.read_bytes(), type=_Entry)
        sys.stderr.write(entry.warnings)
        return entry.spec
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            spec = spec_from_hf_config(str(model_dir))
    finally:
        sys.stderr.write(said.getvalue())
    with contextlib.suppress(OSError):
        entry_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry_path.parent, prefix=".spec-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.encode(_Entry(spec, said.getvalue())))
            os.replace(tmp, entry_path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _prune(entry_path.parent)
    return spec


def _prune(d: Path) -> None:
    """At most `KEEP` entries: the least recently written go (a test suite's temporary models)."""
    entries = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    for old in entries[:max(0, len(entries) - KEEP)]:
        with contextlib.suppress(OSError):
            old.unlink()


__all__ = ["cache_dir", "key", "spec_of_dir"]
