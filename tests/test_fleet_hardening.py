"""Local hardening of the fleet's plumbing (issue 43 point 5): port locks in a per-user, 0700,
owner-checked directory (a shared /tmp directory with 0666 lock files let any local user hold
every launcher's ports); a segment ledger a reused pid cannot fool; no `preexec_fn` (unsafe in a
threaded parent: the parent-death signal comes from an exec wrapper); a bad environment value
refused in one line naming it. Real files, processes and pids; no vLLM (stand-in tools).
"""

from __future__ import annotations

import ast
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app
from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.fleet_processes import SegmentLedger
from kvbridge.testing.stand_ins import make_tools
from kvbridge.transport.ports import PortReservations, reserved

SRC = Path(__file__).resolve().parents[1] / "src" / "kvbridge"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another user's directory, a chosen pid)")


def test_port_locks_live_in_a_private_directory_of_this_user():
    r = PortReservations()
    base = r.run(["127.0.0.1"])
    try:
        d = os.lstat(r.lock_dir)
        assert stat.S_ISDIR(d.st_mode) and d.st_uid == os.geteuid() and stat.S_IMODE(d.st_mode) == 0o700, r.lock_dir
        lock = os.lstat(os.path.join(r.lock_dir, f"{base}.lock"))
        assert lock.st_uid == os.geteuid() and stat.S_IMODE(lock.st_mode) == 0o600
        parent = os.lstat(os.path.dirname(r.lock_dir))
        assert parent.st_uid == os.geteuid() and not stat.S_IMODE(parent.st_mode) & 0o077
        assert reserved(base)
    finally:
        r.release()


def _refused(lock_dir: Path) -> str:
    with pytest.raises(ConfigError) as e:
        PortReservations(str(lock_dir)).run(["127.0.0.1"])
    assert "\n" not in str(e.value) and str(lock_dir) in str(e.value), str(e.value)
    return str(e.value)


def test_a_lock_directory_that_is_a_link_or_open_to_others_is_refused_in_one_line(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert "symbolic link" in _refused(tmp_path / "link")
    wide = tmp_path / "wide"
    wide.mkdir()
    wide.chmod(0o777)  # any local user could plant and hold lock files in it
    assert "0777" in _refused(wide)


@root_only
def test_a_lock_directory_another_user_owns_is_refused_in_one_line(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    assert "owned by uid 65534" in _refused(theirs)


MEMBER = """
import mmap, os, sys, time, uuid
ns = os.stat("/proc/self/ns/pid").st_ino
name = f"kvbridge-{os.getpid()}-ns{ns}-cache-{uuid.uuid4().hex[:12]}"
fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
os.close(fd)
print(name, flush=True)
if sys.argv[1] == "unmap":
    m.close()
time.sleep(600)
"""


def _member(mode: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", MEMBER, mode], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    return p, p.stdout.readline().strip()


def _with_pid(pid: int, mode: str) -> tuple[subprocess.Popen, str] | None:
    """A process given `pid` (ns_last_pid), or None when another process of the host took it first."""
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p, name = _member(mode)
        if p.pid == pid:
            return p, name
        p.kill()
        p.wait()
        os.unlink(f"/dev/shm/{name}")
    return None


@root_only
def test_the_ledger_never_claims_the_segments_of_a_process_that_reuses_a_fleet_pid():
    ours, mine = _member("unmap")  # a fleet process that made a segment and lost its mapping
    ledger = SegmentLedger()
    ledger.track(ours.pid)
    os.killpg(ours.pid, signal.SIGKILL)
    ours.wait()
    time.sleep(0.05)
    other = None
    try:
        got = _with_pid(ours.pid, "unmap")
        if got is None:
            pytest.skip(f"pid {ours.pid} was taken by another process of the host 50 times")
        other, theirs = got
        ledger.track()  # a later note of the fleet: the pid now names another program's process
        owned = ledger.own()
        assert mine in owned, owned  # made by the fleet's process: the fleet's to remove
        assert theirs not in owned, owned  # made by the newcomer with the same pid
        ledger.remove_unused()
        assert os.path.exists(f"/dev/shm/{theirs}") and not os.path.exists(f"/dev/shm/{mine}")
    finally:
        if other is not None:
            other.kill()
            other.wait()
        for name in (mine, *([theirs] if other is not None else [])):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_no_preexec_fn_anywhere_in_the_library():
    found = [f"{path.relative_to(SRC)}:{node.lineno}" for path in SRC.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.keyword)
             and node.arg == "preexec_fn"]
    assert not found, found


PARENT = """
import subprocess, sys, threading, time
from kvbridge.transport.parent_death import parent_death_command
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # a threaded parent
child = subprocess.Popen(parent_death_command(["sleep", "600"]), start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_parent_death_wrapper_ends_its_command_when_the_parent_dies():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.5)
    assert open(f"/proc/{child}/comm").read().strip() == "sleep"  # exec'd, same pid
    parent.kill()
    parent.wait()
    end = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and "Z" not in open(f"/proc/{child}/stat").read().rsplit(")", 1)[1][:3]:
        assert time.monotonic() < end, "the command outlived its parent"
        time.sleep(0.05)


def test_the_parent_death_wrapper_runs_nothing_once_its_parent_is_gone():
    r = subprocess.run([sys.executable, "-m", "kvbridge.transport.parent_death", "--parent", "1", "--",
                        "sh", "-c", "echo ran"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "ran" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "parent 1 already gone" in lines[0], r.stderr


@pytest.fixture()
def model(tmp_path):
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
    return add_byte_tokenizer(make_tiny_llama(tmp_path / "m", seed=1))


@pytest.mark.parametrize("name, value", [("KVBRIDGE_VLLM_IDLE_WAIT_S", "soon"), ("KVBRIDGE_VLLM_IDLE_WAIT_S", "-1"),
                                         ("KVBRIDGE_START_METHOD", "fork-please"),
                                         ("KVBRIDGE_STEP_PROFILE", "/proc/no-such-dir"),
                                         ("KVBRIDGE_VLLM_PYTHON", "/no/such/python")])
def test_a_bad_environment_value_is_one_line_naming_it(model, tmp_path, monkeypatch, name, value):
    tools = make_tools(tmp_path / "tools")
    monkeypatch.setenv(name, value)
    args = ["serve", str(model), "--prefill", "tp=1", "--decode", "tp=1", "--dry-run"]
    if name != "KVBRIDGE_VLLM_PYTHON":
        args += ["--vllm-python", str(tools)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0] and value in lines[0], r.output
