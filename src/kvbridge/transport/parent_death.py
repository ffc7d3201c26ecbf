"""Run a command that dies with the process that started it: a tiny exec wrapper that asks Linux
for a parent-death signal (PR_SET_PDEATHSIG), checks its parent is still the one that started it,
and execs the command in its own place (same pid; the signal survives exec).

    python -m kvbridge.transport.parent_death --parent PID [--signal TERM] -- COMMAND ARGS...

Why a wrapper, not `preexec_fn`: `preexec_fn` runs Python between fork and exec, which is unsafe
in a parent with threads (a lock another thread held at fork stays held forever in the child:
kvbridge's launchers have threads). The wrapper runs after exec, in a fresh interpreter.

Why `--parent`: a parent that dies between the fork and the prctl would never signal; the wrapper
then sees another parent and runs nothing (one line on stderr, exit 1).

What it does not do: the signal follows the *thread* that forked the child (Linux's rule), so a
command started from a thread that then ends gets it at once: start such commands from a thread
that lives as long as they should. It reaches the command's process only, not its children; a
fleet's members have a watchdog for that (`launcher_watch.py`).
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def parent_death_command(argv: list[str], sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """`argv` run through the wrapper: it gets `sig` when this process (the calling thread) ends."""
    return [sys.executable, "-m", "kvbridge.transport.parent_death", "--parent", str(os.getpid()), "--signal",
            sig.name.removeprefix("SIG"), "--", *argv]


def main(args: list[str]) -> int:
    opts: dict[str, str] = {}
    while len(args) >= 2 and args[0] in ("--parent", "--signal"):
        opts[args[0]], args = args[1], args[2:]
    if not args or args[0] != "--" or len(args) < 2 or not opts.get("--parent", "").isdigit():
        print("usage: python -m kvbridge.transport.parent_death --parent PID [--signal NAME] -- COMMAND...",
              file=sys.stderr)
        return 2
    try:
        sig = signal.Signals[f"SIG{opts.get('--signal', 'TERM')}"]
    except KeyError:
        print(f"parent_death: --signal {opts['--signal'][:20]!r} is no signal name (TERM, KILL, ...)", file=sys.stderr)
        return 2
    parent, command = int(opts["--parent"]), args[1:]
    try:
        import ctypes
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as e:  # not Linux: the command runs without the signal
        print(f"parent_death: no parent-death signal here ({e}); running {command[0]} without it", file=sys.stderr)
    if os.getppid() != parent:
        print(f"parent_death: parent {parent} already gone; not running {command[0]}", file=sys.stderr)
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"parent_death: cannot run {command[0]}: {e.strerror or e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
