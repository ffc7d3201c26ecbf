"""Only its own (issue 28 point 4): a fleet's stop removes the shared-memory segments its processes
mapped or created and nothing else; the stale-segment reaper spares segments of other PID
namespaces. Real processes and real /dev/shm files; no vLLM needed (a fleet member here is a
Python process in its own session that maps what vLLM's processes map: a kvbridge segment and a
multiprocessing block).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kvbridge.integrations.vllm.fleet_processes import SegmentLedger, _group_alive, stop_session
from kvbridge.transport.shm import SharedSegment, pid_namespace, reap_stale_segments

MEMBER = """
import sys, time
from multiprocessing import shared_memory
from kvbridge.transport.shm import SharedSegment
seg = SharedSegment(4096, "cache")
block = shared_memory.SharedMemory(create=True, size=4096)
print(seg.path.rsplit("/", 1)[1], block.name, flush=True)
time.sleep(600)
"""


def _touch(name: str) -> str:
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    return path


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stop_removes_the_fleets_segments_and_spares_everyone_elses():
    member = subprocess.Popen([sys.executable, "-c", MEMBER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    bystander = subprocess.Popen(["sleep", "600"])  # another program's live process in this namespace
    foreign: list[str] = []
    try:
        names = member.stdout.readline().split()
        assert len(names) == 2, names
        ledger = SegmentLedger()
        ledger.track(member.pid)
        assert set(names) <= ledger.own()
        # Created during the fleet's life, mapped by nobody: another program's block, a second
        # fleet's kvbridge segment of a live process, one of another PID namespace's dead pid.
        foreign = [_touch(f"psm_{uuid.uuid4().hex[:8]}"), _touch(f"vllm_{uuid.uuid4().hex[:8]}"),
                   _touch(f"kvbridge-{bystander.pid}-ns{pid_namespace()}-cache-{uuid.uuid4().hex[:12]}"),
                   _touch(f"kvbridge-{_dead_pid()}-ns{pid_namespace() + 1}-cache-{uuid.uuid4().hex[:12]}")]
        os.killpg(member.pid, signal.SIGKILL)  # a crash: nothing of it cleans up
        end = time.monotonic() + 10
        while _group_alive(member.pid) and time.monotonic() < end:
            member.poll()
            time.sleep(0.05)
        member.wait()
        # The crash left them; the kvbridge one only until any process's next shm allocation reaps
        # it (its pid is dead), which another program on the host may do at any moment.
        assert os.path.exists(f"/dev/shm/{names[1]}"), names
        # Both removed by the ledger, or the kvbridge one by a concurrent test's reaper first.
        assert ledger.remove_unused() in (1, 2)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
        assert all(os.path.exists(p) for p in foreign), [p for p in foreign if not os.path.exists(p)]
    finally:
        bystander.kill()
        bystander.wait()
        if member.poll() is None:
            os.killpg(member.pid, signal.SIGKILL)
            member.wait()
        for p in foreign:
            if os.path.exists(p):
                os.unlink(p)


STUBBORN = """
import multiprocessing, signal, time
from multiprocessing import shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopped only by the SIGKILL that follows
block = shared_memory.SharedMemory(create=True, size=4096)
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, kept until shutdown
# /proc/PID/maps shows it under glibc's temporary name (deleted), not this one
print(block.name, "sem." + lock._semlock.name.lstrip("/"), flush=True)
time.sleep(600)
"""


def test_a_stopped_session_leaves_nothing_it_mapped_and_spares_the_rest():
    # A plain instance stopped as `running`, the demo and the bench stop theirs (no fleet ledger):
    # it ignores SIGTERM and is SIGKILLed, so vLLM-like leftovers (a psm_ block, a sem.mp-
    # semaphore) are removed by stop_session itself, and another program's file stays.
    member = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    foreign = _touch(f"psm_{uuid.uuid4().hex[:8]}")
    try:
        names = member.stdout.readline().split()
        assert len(names) == 2 and names[1].startswith("sem.mp-"), names
        stop_session(member, timeout=1.0)
        assert not _group_alive(member.pid)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names), names
        assert os.path.exists(foreign)
    finally:
        if member.poll() is None:
            os.killpg(member.pid, signal.SIGKILL)
            member.wait()
        for n in [foreign] + [f"/dev/shm/{n}" for n in locals().get("names", [])]:
            if os.path.exists(n):
                os.unlink(n)


def test_the_reaper_judges_only_segments_of_its_own_pid_namespace():
    dead = _dead_pid()
    ours = _touch(f"kvbridge-{dead}-ns{pid_namespace()}-cache-{uuid.uuid4().hex[:12]}")
    # The same dead pid named by another namespace (say why it is named, not made: this test runs
    # everywhere; the next one makes a real namespace where it can) and a name without one.
    theirs = _touch(f"kvbridge-{dead}-ns{pid_namespace() + 1}-cache-{uuid.uuid4().hex[:12]}")
    legacy = _touch(f"kvbridge-{dead}-cache-{uuid.uuid4().hex[:12]}")
    try:
        removed = reap_stale_segments()
        assert ours in removed and not os.path.exists(ours)
        assert os.path.exists(theirs) and os.path.exists(legacy)
        assert theirs not in removed and legacy not in removed
    finally:
        for p in (ours, theirs, legacy):
            if os.path.exists(p):
                os.unlink(p)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a PID namespace needs root and util-linux's unshare")
def test_a_live_segment_of_another_pid_namespace_survives_the_reaper():
    # The owner's pid inside its namespace is set to one no process has here, so a reaper that
    # believed the name's pid would find it dead and remove a live process's segment.
    import random
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    pid = random.randrange(pid_max // 2, pid_max - 10)
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    script = (f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid && {sys.executable} -c "
              "'import time; from kvbridge.transport.shm import SharedSegment; s = SharedSegment(4096, \"ns\"); "
              "print(s.path, flush=True); time.sleep(600)'")
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    path = ""
    try:
        path = inner.stdout.readline().strip()
        assert path.startswith(f"/dev/shm/kvbridge-{pid}-ns"), path
        assert not os.path.exists(f"/proc/{pid}")  # dead as far as this namespace can tell
        reap_stale_segments()
        assert os.path.exists(path), "the reaper removed a live segment of another PID namespace"
    finally:
        os.killpg(inner.pid, signal.SIGKILL)
        inner.wait()
        if path and os.path.exists(path):
            os.unlink(path)
