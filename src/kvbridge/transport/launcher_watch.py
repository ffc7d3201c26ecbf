"""A watchdog on a launcher's death: a small process, in a session of its own, that holds what the
launcher hands it (descriptors: port locks) and, when the launcher ends without saying it is done
(SIGKILL, an OOM kill, a crash), execs a command that cleans up after it.

    python -m kvbridge.transport.launcher_watch FD -- COMMAND ARGS...

Why a process at the end of a socket, not a parent-death signal per member: the launcher's end is
the end of file on a socket only the launcher holds, which its kernel closes however it dies (no
pid to be reused, no forking thread to follow: PR_SET_PDEATHSIG fires when the thread that
started a child ends); the watchdog is out of reach of signals sent to the launcher's process
group; and it can hold what must outlive the launcher until the cleanup ends: a `flock` held by
a copy of the descriptor stays held, so a new launcher is not promised a dead fleet's ports while
its members still hold them. The command inherits those descriptors; they go when it exits.

What it cannot see: its own death. A watchdog killed with its launcher (`kill -9` of both, a
cgroup killed whole) leaves the cleanup to a person (`kvbridge serve --stop DIR` for a fleet).

Only the standard library until the command: it waits for a fleet's whole life.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

_DONE = b"done"
_HOLD = b"hold"
_MAX_FDS = 200  # per message, under the kernel's SCM_MAX_FD (253)


class LauncherWatch:
    """The launcher's side: start the watchdog, `hold` descriptors, `done` once cleaned up itself."""

    def __init__(self, command: Sequence[str], log_path: str | os.PathLike, cwd: str | os.PathLike | None = None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # both close-on-exec
        try:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "kvbridge.transport.launcher_watch", str(theirs.fileno()), "--", *command],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, cwd=str(cwd) if cwd is not None else None)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock: socket.socket | None = ours

    def hold(self, fds: Iterable[int]) -> None:
        """Hand the watchdog copies of `fds`: what they hold (a `flock`) lasts until its command ends."""
        fds = list(fds)
        for i in range(0, len(fds), _MAX_FDS):
            if self._sock is not None:
                socket.send_fds(self._sock, [_HOLD], fds[i:i + _MAX_FDS])

    def done(self, timeout: float = 10.0) -> None:
        """The launcher cleaned up itself: the watchdog exits without its command."""
        if self._sock is None:
            return
        try:
            self._sock.send(_DONE)
        except OSError:  # the watchdog is gone already
            pass
        self._sock.close()
        self._sock = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(args: list[str]) -> int:
    if len(args) < 3 or not args[0].isdigit() or args[1] != "--":
        print("usage: python -m kvbridge.transport.launcher_watch FD -- COMMAND...", file=sys.stderr)
        return 2
    sock = socket.socket(fileno=int(args[0]))
    held: list[int] = []
    done = False
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 64, _MAX_FDS)
        except OSError:  # the launcher's end reset: as good as closed
            msg, fds = b"", []
        held += fds
        if not msg:  # end of file: every copy of the launcher's end is closed
            break
        done = done or msg == _DONE
    sock.close()
    if done:
        return 0
    for fd in held:
        os.set_inheritable(fd, True)
    print(f"{time.strftime('%H:%M:%S')} launcher_watch: the launcher ended without cleaning up; running "
          f"{' '.join(args[2:])}", flush=True)
    try:
        os.execvp(args[2], args[2:])
    except OSError as e:
        print(f"launcher_watch: cannot run {args[2]}: {e.strerror or e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
