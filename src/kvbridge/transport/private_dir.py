"""Directories of one local user for kvbridge's locks and sockets: created 0700, and an existing one
used only if it is a real directory (no symbolic link) this user owns and nobody else can write
or read.

Why: a directory every user shares (the old `/tmp/kvbridge-ports`, mode 1777, with 0666 lock
files) lets any local user create it first or open and hold its lock files, blocking every
launcher of every user. A per-user directory another user has planted or opened up is refused in
one line naming it (a ConfigError), never used.

Where: `/run/user/UID/kvbridge` when the system gives this user a runtime directory there (private
by construction: nobody else can create it), else `/tmp/kvbridge-UID`. Fixed per user and host,
not read from the environment, so every process of a user (a login shell, cron, ssh without a
session manager) agrees on it.
"""

from __future__ import annotations

import os
import stat

from kvbridge.errors import ConfigError


def private_dir(path: str) -> str:
    """`path`, created 0700 if missing, once checked to be a directory only this user can use."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"{path}: cannot create this private directory ({e.strerror or e})") from None
    try:
        st = os.lstat(path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"{path} is a symbolic link, not a private directory: remove it")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path} is not a directory: remove it")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{path} is owned by uid {st.st_uid}, not this user ({os.geteuid()}): another user made it; "
                          "remove it")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise ConfigError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users could hold its locks; "
                          f"`chmod 700 {path}`, or remove it")
    return path


def runtime_dir() -> str:
    """This user's private kvbridge directory (see the module docstring), checked."""
    uid = os.geteuid()
    run = f"/run/user/{uid}"
    try:
        st = os.lstat(run)
        system = stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not stat.S_IMODE(st.st_mode) & 0o077
    except OSError:
        system = False
    return private_dir(os.path.join(run, "kvbridge") if system else f"/tmp/kvbridge-{uid}")


__all__ = ["private_dir", "runtime_dir"]
