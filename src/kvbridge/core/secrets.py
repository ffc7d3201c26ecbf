"""A fleet's shared secrets (the side channel's, the pool's seals and key names): made, read, checked.

Why one module: a secret decides whether a network peer can make a rank act at all, or read and
poison a shared pool, so the rules live in one place for every user: a secret is at least
`MIN_SECRET_BYTES` bytes; a secret file is read once, must be a regular file we own (no
symlink) that neither group nor others may read, and its whole content (one trailing newline
stripped) is the secret; `generate_secret` is what loopback demos and tests hand to the other
half. A secret never travels on a command line (`ps` shows it): only its file's path does.
"""

from __future__ import annotations

import os
import secrets as _random
import stat
from typing import Any

from kvbridge.errors import ConfigError

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096


def generate_secret() -> bytes:
    """32 random bytes (hex text, so it can be written to a file and passed on a command line)."""
    return _random.token_hex(32).encode()


def check_secret(secret: Any, what: str = "the side-channel secret") -> bytes:
    """`secret` as bytes, or `ConfigError` naming what is wrong with it (`what`: which secret, for the message)."""
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise ConfigError(f"{what} must be bytes, got {type(secret).__name__}")
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ConfigError(f"{what} must be at least {MIN_SECRET_BYTES} bytes (and at most "
                          f"{MAX_SECRET_BYTES}), got {len(secret)}")
    return bytes(secret)


def read_secret_file(path: str | os.PathLike) -> bytes:
    """The secret in `path`; `ConfigError` (one line) if it is missing, not ours, or readable by others."""
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"secret file {name}: no such file") from None
    except OSError as e:
        raise ConfigError(f"secret file {name}: cannot open it ({e.strerror or e}; symlinks are refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"secret file {name}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"secret file {name}: mode {stat.S_IMODE(st.st_mode):04o} lets group or others "
                              f"access it; chmod 600 {name}")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"secret file {name}: owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
        if st.st_size > MAX_SECRET_BYTES + 1:
            raise ConfigError(f"secret file {name}: {st.st_size} bytes, above the bound {MAX_SECRET_BYTES}")
        data = os.read(fd, MAX_SECRET_BYTES + 2)
    finally:
        os.close(fd)
    if data.endswith(b"\n"):
        data = data[:-1]
    if data.endswith(b"\r"):
        data = data[:-1]
    return check_secret(data, f"secret file {name}")


def write_secret_file(path: str | os.PathLike, secret: bytes | None = None) -> bytes:
    """Create `path` (mode 0600, must not exist) holding `secret` (generated when None); the secret."""
    secret = check_secret(secret if secret is not None else generate_secret())
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    return secret


def resolve_secret(secret: Any = None, secret_file: str | os.PathLike | None = None,
                   insecure: bool = False) -> bytes | None:
    """The secret a connector uses, from exactly one of `secret` / `secret_file`, or None when the
    caller said `insecure`; `ConfigError` when none (or both, or insecure with a secret) is given."""
    given = [n for n, v in (("secret", secret), ("secret_file", secret_file)) if v not in (None, b"", "")]
    if len(given) > 1:
        raise ConfigError("give the side-channel secret once: secret or secret_file, not both")
    if insecure:
        if given:
            raise ConfigError(f"insecure=True and a {given[0]} contradict each other: drop one")
        return None
    if secret_file not in (None, ""):
        return read_secret_file(secret_file)
    if secret not in (None, b"", ""):
        return check_secret(secret)
    raise ConfigError("the side channel needs a shared secret: pass secret= or secret_file= (the same on both "
                      "engines), or insecure=True to run unauthenticated on a trusted network")


__all__ = ["MAX_SECRET_BYTES", "MIN_SECRET_BYTES", "check_secret", "generate_secret",
           "read_secret_file", "resolve_secret", "write_secret_file"]
