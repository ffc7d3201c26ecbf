"""What a running fleet started, on disk beside its logs, so that something other than its launcher
can stop it (issue 43 point 2): the launcher's watchdog once the launcher died without stopping
it (`transport/launcher_watch.py` execs `python -m kvbridge.integrations.vllm.fleet_record reap
FILE MARK`), and `kvbridge serve --stop DIR` (`stop_dir`), for a fleet whose launcher runs or whose
launcher and watchdog are both gone.

The record, `LOG_DIR/fleet-TAG.json` (0600, replaced by a rename at each change), names the
launcher (pid and start), the fleet's mark (a random id in every member's environment as
KVBRIDGE_FLEET, inherited by each of its processes: vLLM's EngineCore, workers, kvbridge's
sidecars), every session a member led (leader pid, start, name), the segment ledger, and the
secret file the fleet wrote (never one it was given).

Reaping: the fleet's processes are this user's processes that carry its mark, are in the session
of a recorded leader that is still the same process, or are the ledger's processes, still the same;
each gets SIGTERM and SIGCONT (a member the benchmark SIGSTOPped acts on neither otherwise),
SIGKILL after GRACE_S, each through a pidfd checked against its start (a reused pid is never
signalled). Then the segments of the ledger no process maps, the secret file and the record go;
the port locks go when the reaper exits (it holds the watchdog's copies).

What remains: the log directory and its logs (the user's); a process that dropped the mark from
its environment and left its session (none of vLLM's or kvbridge's do); a segment made and unmapped
between two of the launcher's notes by a process without kvbridge's name for it (`SegmentLedger`).
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.fleet_processes import (SegmentLedger, _all_pids, _mapped_segments, _shm_names_by_inode,
                                                        process_start, signal_process)

MARK = "KVBRIDGE_FLEET"
GRACE_S = 5.0  # SIGTERM's time before SIGKILL: a fleet stops within seconds of its launcher's death
LAUNCHER_WAIT_S = 120.0  # `--stop` lets a running launcher stop its fleet itself this long (20 s per member)
MAX_BYTES = 16 << 20


class Leader(msgspec.Struct, frozen=True):
    pid: int
    start: int
    name: str


class FleetRecord(msgspec.Struct, kw_only=True):
    version: int = 1
    tag: str
    mark: str
    launcher_pid: int
    launcher_start: int
    secret_file: str = ""
    leaders: list[Leader] = []
    segments: list[str] = []
    procs: list[tuple[int, int]] = []

    def write(self, path: Path) -> None:
        """Replace `path` by a rename: a reader sees the old record or the new one, never half."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(self))
        os.replace(tmp, path)


def read_record(path: Path) -> FleetRecord:
    """The record at `path` if this user wrote it (owned by this user, writable by nobody else, no
    link): a record names processes to kill. One line otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read this fleet record ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022 or not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path}: not a fleet record this user wrote (owner uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):04o}): not used")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: a fleet record over {MAX_BYTES >> 20} MiB: not used")
    try:
        return msgspec.json.decode(data, type=FleetRecord)
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: not a fleet record ({str(e)[:120]})") from None


def _marked(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start) of process `pid`, None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[2]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def fleet_processes(record: FleetRecord) -> dict[int, int]:
    """pid -> start of every live process of the fleet (see the module docstring)."""
    mark = f"{MARK}={record.mark}".encode()
    groups = {lead.pid for lead in record.leaders if process_start(lead.pid) == lead.start}
    seen = dict(record.procs)
    out = {}
    for pid in _all_pids():
        info = _stat(pid)
        if info is None or info[0] in "ZX" or pid in (os.getpid(), record.launcher_pid):
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
                continue
        except OSError:
            continue
        if info[1] in groups or seen.get(pid) == info[2] or _marked(pid, mark):
            out[pid] = info[2]
    return out


def _alive(procs: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in procs.items() if (info := _stat(pid)) and info[2] == start
            and info[0] not in "ZX"}


def reap(record: FleetRecord, path: Path, note: Callable[[str], None] = lambda line: None) -> tuple[int, int]:
    """Stop everything `record` names and remove what it left; (processes ended, segments removed).
    `note` gets a line per pass (the watchdog's log)."""
    ledger = SegmentLedger.from_json({"segments": record.segments, "procs": record.procs})
    procs, ended = fleet_processes(record), set()
    for _ in range(3):  # a process forked meanwhile (a worker starting) is found in the next pass
        names = _shm_names_by_inode()  # once per pass, not per process
        for pid, start in procs.items():
            ledger.procs.setdefault(pid, start)
            ledger.segments |= _mapped_segments(pid, names)
        for sig in (signal.SIGTERM, signal.SIGCONT):
            for pid, start in procs.items():
                signal_process(pid, start, sig)
        end = time.monotonic() + GRACE_S
        while _alive(procs) and time.monotonic() < end:
            time.sleep(0.05)
        stubborn = _alive(procs)
        for pid, start in stubborn.items():
            signal_process(pid, start, signal.SIGKILL)
        note(f"{len(procs)} processes sent SIGTERM, {len(stubborn)} of them SIGKILL after {GRACE_S:.0f} s")
        end = time.monotonic() + 10.0
        while _alive(procs) and time.monotonic() < end:
            time.sleep(0.05)
        ended |= set(procs)
        procs = fleet_processes(record)
        if not procs:
            break
    removed = ledger.remove_unused()
    for file in ([record.secret_file] if record.secret_file else []) + [str(path)]:
        try:
            os.unlink(file)
        except FileNotFoundError:
            pass
    return len(ended), removed


def launcher_alive(record: FleetRecord) -> bool:
    info = _stat(record.launcher_pid)
    return info is not None and info[2] == record.launcher_start and info[0] not in "ZX"


def stop_dir(directory: Path) -> list[str]:
    """`kvbridge serve --stop DIR`: every fleet recorded in `directory` stopped, through its launcher
    (SIGTERM: its own clean stop) while that runs, else reaped here; one line per fleet."""
    if not directory.is_dir():
        raise ConfigError(f"--stop {directory}: not a directory (give a fleet's --log-dir)")
    paths = sorted(directory.glob("fleet-*.json"))
    if not paths:
        return [f"nothing to stop in {directory}: no fleet record (a fleet's launcher or watchdog removes it "
                "once the fleet is stopped)"]
    lines = []
    for path in paths:
        record = read_record(path)
        by = ""
        if launcher_alive(record):
            signal_process(record.launcher_pid, record.launcher_start, signal.SIGTERM)
            end = time.monotonic() + LAUNCHER_WAIT_S
            while launcher_alive(record) and time.monotonic() < end:
                time.sleep(0.2)
            if not path.exists():
                lines.append(f"fleet {record.tag} stopped by its launcher (pid {record.launcher_pid})")
                continue
            signal_process(record.launcher_pid, record.launcher_start, signal.SIGKILL)
            by = f"; its launcher (pid {record.launcher_pid}) did not stop it within {LAUNCHER_WAIT_S:.0f} s: killed"
        if not path.exists():  # its watchdog finished meanwhile
            lines.append(f"fleet {record.tag} stopped by its watchdog")
            continue
        ended, removed = reap(record, path)
        secret = f", its secret file {record.secret_file} removed" if record.secret_file else ""
        lines.append(f"fleet {record.tag} stopped: {ended} processes ended, {removed} segments removed{secret}{by}")
    return lines


def main(args: list[str]) -> int:
    """`reap FILE MARK`: what the watchdog runs once the launcher died. Without the record (its
    log directory removed meanwhile), the processes that carry MARK are still found and stopped."""
    if len(args) not in (2, 3) or args[0] != "reap":  # MARK optional: a watchdog of an older kvbridge
        print("usage: python -m kvbridge.integrations.vllm.fleet_record reap FILE MARK", file=sys.stderr)
        return 2
    path = Path(args[1])
    if not path.exists() and len(args) == 2:
        return 0
    try:
        record = read_record(path) if path.exists() else FleetRecord(tag=path.stem.removeprefix("fleet-"),
                                                                     mark=args[2], launcher_pid=0, launcher_start=0)
    except ConfigError as e:
        print(f"fleet_record: {e}", file=sys.stderr)
        return 1
    ended, removed = reap(record, path, lambda line: print(line, flush=True))
    print(f"{time.strftime('%H:%M:%S')} fleet {record.tag}: its launcher died; {ended} processes ended, {removed} "
          "segments removed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
