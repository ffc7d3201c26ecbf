"""The processes of a fleet: the vLLM environment, free ports, health, `vllm serve` command lines,
process sessions and the shared-memory segments they map. No policy here: `fleet.py` decides."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvbridge.errors import ConfigError
from kvbridge.transport.ports import PortsExhausted, free_ports, port_free  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from kvbridge.integrations.vllm.fleet_config import FleetConfig, InstanceShape

REPO = Path(__file__).resolve().parents[4]


def vllm_python(python: str | os.PathLike | None = None) -> str:
    """The interpreter that runs vLLM: `python`, $KVBRIDGE_VLLM_PYTHON, .venv-vllm, or this one; a
    `python` or KVBRIDGE_VLLM_PYTHON that names no file is refused in one line (not passed over for
    another), and finding none says where it looked and how to name one."""
    if python and not Path(python).is_file():
        raise ConfigError(f"--vllm-python {str(python)[:200]!r}: no such file (the python of an environment with vLLM)")
    named = os.environ.get("KVBRIDGE_VLLM_PYTHON")
    if not python and named and not Path(named).is_file():
        raise ConfigError(f"KVBRIDGE_VLLM_PYTHON {named[:200]!r}: no such file (the vLLM environment's python)")
    beside_repo = REPO / ".venv-vllm" / "bin" / "python"
    for cand in (python, named, beside_repo):
        if cand and Path(cand).is_file():
            return str(cand)
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin not in (None, "namespace"):  # not a directory named vllm in the cwd
        return sys.executable
    # Where it looked, and every way to name one: run from another directory (or from an installed
    # kvbridge) a bare "run make vllm-env" sent users to rebuild 3.4 GB they already had.
    looked = ("no --vllm-python", "KVBRIDGE_VLLM_PYTHON unset", f"{beside_repo} (no such file)",
              f"{sys.executable} (no vllm module)")
    raise ConfigError(f"no vLLM environment (looked at: {'; '.join(looked)}): pass --vllm-python PATH, the python "
                      f"of an environment with vLLM, or set KVBRIDGE_VLLM_PYTHON, or run `make vllm-env` in the "
                      f"kvbridge repository (creates .venv-vllm, ~3.4 GB)")


@dataclass
class Member:
    """One process of the fleet: an instance (`prefill-0`, `decode-1`) or the router."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    http_port: int
    shape: InstanceShape | None = None
    engine_id: str | None = None
    proc: subprocess.Popen | None = None
    side_port: int | None = None  # an instance's first side-channel port (one per rank from it)
    role: str = ""  # an instance's: prefill or decode (the router's --prefill / --decode)

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.argv_host)}:{self.http_port}"

    argv_host: str = "127.0.0.1"

    def state(self) -> str:
        """'stopped', 'exited (rc N)', 'ready' or 'starting' (health not yet 200)."""
        if self.proc is None:
            return "stopped"
        rc = self.proc.poll()
        if rc is not None:
            return f"exited (rc {rc})"
        return "ready" if healthy(self.url) else "starting"

    def log_tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


    def cause(self) -> str:
        """The last error line of the member's log (`log_cause`), '' when it has none."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 20)))  # the last MiB: a cause is near the end
                return log_cause(f.read().decode(errors="replace"))
        except OSError:
            return ""


# `ValueError: ...`, `(EngineCore pid=12) torch.OutOfMemoryError: ...`,
# `(Worker pid=7) ERROR 11-26 23:48:03 [multiproc_executor.py:953] AssertionError: ...`
_ERROR_LINE = re.compile(r"(?:^|[\s\])])((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception): \S.*)$")
_GENERIC = ("See root cause above", "Engine core initialization failed", "Traceback (most recent call last)")


def log_cause(text: str) -> str:
    """The last line of a vLLM log that names an exception and its message, skipping vLLM's own
    'See root cause above' wrappers: what to tell a user whose instance died at start."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        m = _ERROR_LINE.search(line)
        if m and not any(g in line for g in _GENERIC):
            cause = m.group(1)
            return cause if len(cause) <= 400 else cause[:397] + "..."
    return ""


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def find_tool(python: str, name: str) -> str | None:
    """`name` (an executable) beside the vLLM environment's interpreter, or on PATH."""
    beside = Path(python).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def vllm_serve_member(c: FleetConfig, vllm: str, name: str, shape: InstanceShape, http_port: int, log_dir: Path,
                      kv: dict[str, Any] | None) -> Member:
    """One `vllm serve` instance of the fleet's model and settings; `kv` None: a plain instance
    (no connector: the reference every fleet answer must equal)."""
    argv = [vllm, "serve", str(Path(c.model).resolve()), "--host", c.host, "--port", str(http_port),
            "--served-model-name", "model", "--dtype", c.dtype, "--max-model-len", str(c.max_model_len),
            "--block-size", str(shape.block), "--tensor-parallel-size", str(shape.tp),
            "--pipeline-parallel-size", str(shape.pp), "--enforce-eager"]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": str(c.kv_cache_gib),
           "TORCHINDUCTOR_CACHE_DIR": str(log_dir / f"inductor-{name}"), **c.extra_env}
    # uvicorn closes a connection idle for this long (vLLM's default 5 s), and under uvloop its timer
    # runs before the socket is read: a starved instance, continued, reset every pooled connection on
    # which the router had sent a request meanwhile (HTTP 500 "Connection reset by peer"). Longer
    # than the router's pool keeps an idle connection (50 s in its source) plus a minute's stop: the router
    # always closes first.
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "600")
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # see proofs/vllm/cluster._instance_config
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
    return Member(name, argv, env, log_dir / f"{name}.log", http_port, shape, argv_host=c.host)


def _all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _pids_in_groups(groups: set[int], zombies: bool = True) -> list[int]:
    """Processes whose process group is one of `groups` (each member leads its own session);
    `zombies` False: only those not yet dead (a zombie holds no port or memory)."""
    out = []
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups and (zombies or fields[0] != "Z"):
            out.append(pid)
    return out


def _mapped_inodes(pid: int) -> dict[int, str]:
    """The /dev/shm files process `pid` maps: inode -> the name its mapping was made under."""
    out: dict[int, str] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/dev/shm/" not in line:
                    continue
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[4].isdigit():
                    out[int(fields[4])] = fields[5].split("/dev/shm/", 1)[1].split(" (deleted)")[0].strip()
    except OSError:
        pass
    return out


def _shm_names_by_inode() -> dict[int, set[str]]:
    """Every file in /dev/shm by inode (a POSIX named semaphore is mapped under the temporary name
    glibc made it as, `sem.XXXXXX (deleted)`, and lives on as its hard link `sem.NAME`)."""
    out: dict[int, set[str]] = {}
    try:
        with os.scandir("/dev/shm") as entries:
            for e in entries:
                with contextlib.suppress(OSError):
                    if e.is_file(follow_symlinks=False):
                        out.setdefault(e.inode(), set()).add(e.name)
    except OSError:
        pass
    return out


def _mapped_segments(pid: int, names: dict[int, set[str]] | None = None) -> set[str]:
    """Names of /dev/shm files process `pid` maps, by the name they were mapped under and by every
    name their inode has now (`names`: `_shm_names_by_inode()`, taken once for many pids)."""
    names = _shm_names_by_inode() if names is None else names
    out: set[str] = set()
    for inode, name in _mapped_inodes(pid).items():
        out |= names.get(inode, set()) or {name}
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def exit_status(proc: subprocess.Popen) -> int | None:
    """`proc`'s return code once it has exited (negative: the signal), None while it runs, without
    reaping it: until it is reaped its pid, and so its process group's id, cannot be reused, and
    what is left of its session can be killed safely (`Fleet.retire`)."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere
        return proc.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def retire_session(proc: subprocess.Popen, ledger: SegmentLedger) -> None:
    """Kill what is left of the session `proc` leads once `proc` has exited (a vLLM instance's
    EngineCore, workers and kvbridge sidecar may live on, holding its ports and memory), then reap
    `proc`. The ledger notes the session's processes and segments first (removed at stop). While
    `proc` is unreaped its pid, the session's id, cannot be reused, so the kill reaches only its
    processes; once reaped, only those the ledger saw (`kill_seen`)."""
    ledger.track(proc.pid)
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        end = time.monotonic() + 30
        while set(_pids_in_groups({proc.pid}, zombies=False)) - {proc.pid} and time.monotonic() < end:
            time.sleep(0.05)
    else:
        kill_seen(proc.pid, ledger)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def kill_seen(leader: int, ledger: SegmentLedger) -> None:
    """SIGKILL the processes now in session `leader` that the ledger saw in it (a reaped leader's
    pid can be reused: only processes the fleet saw, the same processes, are its)."""
    for pid in _pids_in_groups({leader}):
        if (start := ledger.procs.get(pid)) is not None:
            signal_process(pid, start, signal.SIGKILL)


def stop_session(proc: subprocess.Popen | None, timeout: float = 20.0, ledger: SegmentLedger | None = None) -> None:
    """SIGTERM the process session `proc` leads, then SIGKILL what is left of it after `timeout`.

    What its processes map in /dev/shm is noted before and while it stops (vLLM's `psm_*` blocks,
    `sem.mp-*` semaphores, shm communicators: a killed worker, or vLLM on its own stop, leaves
    them). With a fleet's `ledger` they are its to remove at its stop; without one, those no live
    process maps are removed here once the session is gone (`SegmentLedger`: only its own)."""
    if proc is None:
        return
    own = ledger if ledger is not None else SegmentLedger()
    own.track(proc.pid)
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        end, noted = time.monotonic() + wait, time.monotonic()
        while time.monotonic() < end and _group_alive(proc.pid):
            proc.poll()
            time.sleep(0.1)
            if time.monotonic() - noted > 1.0:  # a process's stop may map (or make) more
                own.track(proc.pid)
                noted = time.monotonic()
        if not _group_alive(proc.pid):
            break
    proc.poll()
    if ledger is None:
        own.remove_unused()


def session_segments(*leaders: int) -> set[str]:
    """The /dev/shm names the processes of the sessions these pids lead map now."""
    names = _shm_names_by_inode()
    return {name for pid in _pids_in_groups(set(leaders)) for name in _mapped_segments(pid, names)}


def session_pids(*leaders: int) -> set[int]:
    """The processes of the sessions these pids lead, now."""
    return set(_pids_in_groups(set(leaders)))


def segments_named_by(pids: set[int]) -> set[str]:
    """kvbridge segments in /dev/shm that processes `pids` of this PID namespace created (the
    creator's pid and namespace are in the name)."""
    from kvbridge.transport.shm import SHM_DIR, pid_namespace, segment_owner
    ours, out = pid_namespace(), set()
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else ():
        owner = segment_owner(name)
        if owner is not None and owner[0] in pids and owner[1] == ours:
            out.add(name)
    return out


def process_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (a zombie's too), None when there is
    no process `pid`. A pid names one process only together with its start: pids are reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _wall(ticks: int) -> float:
    """A process start (`process_start`) as seconds since the epoch, to a clock tick."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")


def signal_process(pid: int, start: int, sig: int) -> bool:
    """Send `sig` to process `pid` only if it is still the one that started at `start`; True when
    sent. Through a pidfd where there is one (the check and the signal then name one process);
    else a check just before the kill."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        if process_start(pid) != start:
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _segments_by_creator() -> dict[int, list[str]]:
    """kvbridge segments in /dev/shm made in this PID namespace, by their creator's pid."""
    from kvbridge.transport.shm import SHM_DIR, pid_namespace, segment_owner
    ours, out = pid_namespace(), {}
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else ():
        owner = segment_owner(name)
        if owner is not None and owner[1] == ours:
            out.setdefault(owner[0], []).append(name)
    return out


def _made_while(names: Iterable[str], start: int, until: int | None) -> set[str]:
    """Those of `names` (/dev/shm files) made (their ctime) after process start `start` and before
    `until` (another process's start), as seconds since the epoch to a clock tick."""
    low, high = _wall(start), _wall(until) if until is not None else None
    out = set()
    for name in names:
        try:
            made = os.stat(f"/dev/shm/{name}").st_ctime
        except OSError:
            continue
        if made >= low and (high is None or made < high):
            out.add(name)
    return out


class SegmentLedger:
    """The shared-memory segments of one fleet's processes (issue 28 point 4): those they map
    (vLLM's TP channels, Python's multiprocessing blocks and semaphores, kvbridge's caches), seen
    by `track` while they run, and the kvbridge segments its processes created (named by their
    pid). Killed processes leave theirs in /dev/shm; `remove_unused` unlinks exactly these, once
    no live process maps them: nothing by age, nothing of another program or fleet.

    Pid-reuse-proof (issue 43 point 5): a process is its pid and its start (`procs`); a kvbridge
    segment named by one of its pids is the fleet's only if the file was made (its ctime) while
    that process lived: after its start and, once another process has the pid, before that one's
    start. A process seen dead or replaced is settled (its segments noted) and pruned."""

    def __init__(self) -> None:
        self.segments: set[str] = set()
        self.procs: dict[int, int] = {}  # pid -> start (`process_start`) of the fleet's process with that pid

    def track(self, *leaders: int) -> None:
        """Note the processes of these sessions and what they map; settle those that ended."""
        made = _segments_by_creator()
        if leaders:
            for pid in session_pids(*leaders):
                start = process_start(pid)
                if start is None:
                    continue
                if (old := self.procs.get(pid)) is not None and old != start:
                    self.segments |= _made_while(made.get(pid, ()), old, start)
                self.procs[pid] = start
            self.segments |= session_segments(*leaders)
        for pid, start in list(self.procs.items()):
            if (now := process_start(pid)) != start:  # ended, or its pid is another process's now
                self.segments |= _made_while(made.get(pid, ()), start, now)
                del self.procs[pid]

    def live(self, pids: Iterable[int]) -> set[int]:
        """Those of `pids` that are the fleet's processes (the same ones) now."""
        return {pid for pid in pids if pid in self.procs and process_start(pid) == self.procs[pid]}

    def own(self) -> set[str]:
        self.track()
        made = _segments_by_creator()
        return self.segments | {name for pid, start in self.procs.items()
                                for name in _made_while(made.get(pid, ()), start, None)}

    def remove_unused(self) -> int:
        return remove_unused_segments(self.own())

    def to_json(self) -> dict[str, Any]:
        return {"segments": sorted(self.segments), "procs": sorted(self.procs.items())}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SegmentLedger:
        ledger = cls()
        ledger.segments = set(data.get("segments", ()))
        ledger.procs = {int(pid): int(start) for pid, start in data.get("procs", ())}
        return ledger


def remove_unused_segments(names: set[str]) -> int:
    """Unlink those of `names` that no live process maps (killed vLLM processes leave theirs)."""
    inodes = _shm_names_by_inode()
    still_used = {name for pid in _all_pids() for name in _mapped_segments(pid, inodes)}
    removed = 0
    for name in names - still_used:
        try:
            os.unlink(f"/dev/shm/{name}")
            removed += 1
        except OSError:
            pass
    return removed


# The router's health checks (issue 28 point 2). A SIGKILLed instance's port refuses at once, so a
# check every second takes it out of rotation after HEALTH_FAILURES checks (5 s); a starved one
# answers late, and vllm-router checks every worker of a round together and starts the next round
# only when the slowest check ends, so a member stopped for S seconds fails about S / 30 + 1
# checks: 3 for a minute, kept. (vLLM's router defaults: every 60 s, 5 s timeout, 3 failures:
# a dead instance stayed in rotation for minutes and a starved one was taken out.)
HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S, HEALTH_FAILURES = 1, 30, 5


def health_flags() -> list[str]:
    return ["--health-check-interval-secs", str(HEALTH_INTERVAL_S), "--health-check-timeout-secs",
            str(HEALTH_TIMEOUT_S), "--health-failure-threshold", str(HEALTH_FAILURES)]


__all__ = ["HEALTH_FAILURES", "HEALTH_INTERVAL_S", "HEALTH_TIMEOUT_S", "Member", "PortsExhausted", "health_flags", "exit_status", "find_tool", "free_ports", "healthy", "kill_seen", "port_free",
           "process_start", "remove_unused_segments", "retire_session", "SegmentLedger", "segments_named_by",
           "session_pids", "session_segments", "signal_process", "stop_session", "vllm_python", "vllm_serve_member"]
