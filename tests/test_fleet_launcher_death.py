"""A fleet lives and dies with its launcher (issue 43 point 2): `kvbridge serve` or `kvbridge bench
--serve` SIGKILLed (an OOM kill, `kill -9`) leaves no member process, no reserved port, no
segment, no secret file; `kvbridge serve --stop DIR` stops a fleet whose launcher and watchdog
are both gone, or one whose launcher still runs (through it).

Real commands, processes, ports and /dev/shm files; the members are stand-ins for `vllm serve`,
`vllm-router` and `vllm bench serve` (`kvbridge.testing.stand_ins`: a leader on its port and,
for an instance, a child in its session mapping two segments, as vLLM's EngineCore does), and
`--pool start` runs the real `mooncake_master`. A fleet's processes are found by their working
directory (every member runs in its log directory), so nothing here trusts the code under test
to say what it started.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.testing.stand_ins import make_tools
from kvbridge.transport.ports import free_ports, port_free, reserved

KVBRIDGE = str(Path(sys.executable).parent / "kvbridge")
GONE_WITHIN_S = 20.0  # "within seconds": the watchdog gives SIGTERM 5 s, then SIGKILL; a loaded 2-core host


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
    return add_byte_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("model") / "m", seed=1))


def _in_dir(*dirs: Path) -> dict[int, str]:
    """Live processes (pid -> state) whose working directory is one of `dirs`."""
    wanted = {str(d.resolve()) for d in dirs}
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{d}/cwd")
            state = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cwd in wanted and state != "Z":
            out[int(d)] = state
    return out


def _members(d: Path) -> dict[int, str]:
    """Those of `_in_dir(d)` that are the fleet's members (not its watchdog, which the benchmark does not pause)."""
    return {pid: state for pid, state in _in_dir(d).items()
            if b"launcher_watch" not in open(f"/proc/{pid}/cmdline", "rb").read()}


def _segments(*dirs: Path) -> set[str]:
    """The /dev/shm names the stand-in instances of these log directories made."""
    return {line.split()[1] for d in dirs for log in d.glob("*.log")
            for line in log.read_text(errors="replace").splitlines() if line.startswith("segment ")}


def _listening(*dirs: Path) -> list[int]:
    """The ports the stand-ins of these log directories listen on."""
    return [int(line.split()[2]) for d in dirs for log in d.glob("*.log")
            for line in log.read_text(errors="replace").splitlines() if " listening " in line]


def _until(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (got := cond()):
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def _line(proc: subprocess.Popen, timeout: float) -> str:
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise AssertionError(f"no line from {proc.args} within {timeout:.0f} s")
    return proc.stdout.readline()


def _serve(model: Path, tools: Path, log_dir: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    launcher = subprocess.Popen([KVBRIDGE, "serve", str(model), "--prefill", "tp=1", "--decode", "tp=1",
                                 "--vllm-python", str(tools), "--log-dir", str(log_dir), "--port",
                                 str(free_ports(1)), "--json", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    line = _line(launcher, 180)
    assert line.startswith("{"), (line, launcher.stderr.read() if launcher.poll() is not None else "")
    summary = json.loads(line)
    # every instance's EngineCore stand-in has made its segments
    _until(lambda: len(_segments(log_dir)) == 2 * len(summary["instances"]), 60, "the instances' segments")
    return launcher, summary


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone(dirs: list[Path], ports: list[int], segments: set[str], pids: tuple[int, ...] = ()) -> None:
    """Every process of the fleets (those in their log directories and `pids`), their ports,
    segments, secret and record files gone."""
    _until(lambda: not _in_dir(*dirs) and not [p for p in pids if _alive(p)], GONE_WITHIN_S,
           f"every fleet process gone (left: {_in_dir(*dirs)}, {[p for p in pids if _alive(p)]})")
    _until(lambda: not [p for p in ports if reserved(p) or not port_free("127.0.0.1", p)], GONE_WITHIN_S,
           "every port free and unreserved")
    _until(lambda: not [s for s in segments if os.path.exists(f"/dev/shm/{s}")], GONE_WITHIN_S,
           "every segment removed")
    left = [p.name for d in dirs for p in (*d.glob("fleet-*.secret"), *d.glob("fleet-*.json"))]
    assert not left, left


def _cleanup(dirs: list[Path], *procs: subprocess.Popen, pids: tuple[int, ...] = ()) -> None:
    """Whatever a failed run left (today's code leaves the fleet): killed, its segments unlinked."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for pid in [*_in_dir(*dirs), *(p for p in pids if _alive(p))]:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    for s in _segments(*dirs):
        if os.path.exists(f"/dev/shm/{s}"):
            os.unlink(f"/dev/shm/{s}")


def test_a_sigkilled_launcher_takes_its_whole_fleet_with_it(model, tmp_path):
    tools, log_dir = make_tools(tmp_path / "tools"), tmp_path / "logs"
    launcher, extra = None, []
    try:
        launcher, summary = _serve(model, tools, log_dir, "--pool", "start")
        before, master = _in_dir(log_dir), summary["pool"]["pid"]  # the master runs where its launcher does
        extra.append(master)
        leaders = {i["pid"] for i in summary["instances"]} | {summary["router"]["pid"]}
        assert leaders < set(before) and _alive(master), (leaders, before)  # and the instances' children
        assert len(before) >= len(leaders) + len(summary["instances"])
        assert list(log_dir.glob("fleet-*.secret")) and all(reserved(p) for p in summary["ports"])
        segments = _segments(log_dir)
        launcher.kill()  # SIGKILL: nothing of the launcher runs again
        launcher.wait()
        _gone([log_dir], summary["ports"], segments, (master,))
    finally:
        _cleanup([log_dir], *([launcher] if launcher else []), pids=tuple(extra))


def test_a_sigkilled_bench_stops_both_its_fleets_the_paused_one_too(tmp_path):
    tools = make_tools(tmp_path / "tools")
    env = {**os.environ, "KVBRIDGE_VLLM_PYTHON": str(tools), "TMPDIR": str(tmp_path)}
    bench = subprocess.Popen([KVBRIDGE, "bench", "--serve", "--repeats", "1", "--json"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dirs: list[Path] = []
    extra: list[int] = []
    try:
        started = _until(lambda: bench.poll() is None and list(tmp_path.glob("kvbridge-bench-serve-*/warmup/"
                                                                             "bench-started")), 240,
                         "the first `vllm bench serve` (warm-up of kvbridge's fleet)")[0]
        work = started.parent.parent
        dirs = [work / "kvbridge", work / "nixl"]
        client = int(started.read_text())
        extra.append(client)
        # NIXL's fleet is SIGSTOPped meanwhile, one process after another: wait until all are stopped
        # (on a busy host the first read caught one still running, state S).
        paused = _until(lambda: (m := _members(dirs[1])) and set(m.values()) == {"T"} and m, 60,
                        "NIXL's fleet stopped (state T) while kvbridge's is measured")
        loaded = _members(dirs[0])
        assert loaded and "T" not in loaded.values(), loaded
        segments = _segments(*dirs)
        ports = _listening(*dirs)
        assert len(ports) == 2 * 3, ports  # each fleet's two instances and router
        bench.kill()
        bench.wait()
        _gone(dirs, ports, segments)
        _until(lambda: not _alive(client), GONE_WITHIN_S, "the load generator (`vllm bench serve`) gone too")
    finally:
        _cleanup(dirs, bench, pids=tuple(extra))


def test_stop_dir_stops_a_fleet_whose_launcher_and_watchdog_are_gone(model, tmp_path):
    tools, log_dir = make_tools(tmp_path / "tools"), tmp_path / "logs"
    launcher = None
    try:
        launcher, summary = _serve(model, tools, log_dir)
        segments = _segments(log_dir)
        os.kill(summary["watchdog"]["pid"], signal.SIGKILL)  # both gone: nothing stops the fleet by itself
        launcher.kill()
        launcher.wait()
        time.sleep(1.0)
        assert len(_in_dir(log_dir)) >= 3, _in_dir(log_dir)  # orphaned, still serving
        r = subprocess.run([KVBRIDGE, "serve", "--stop", str(log_dir)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
        assert len(lines) == 1 and "stopped" in lines[0], lines
        _gone([log_dir], summary["ports"], segments)
    finally:
        _cleanup([log_dir], *([launcher] if launcher else []))


def test_stop_dir_stops_a_running_launchers_fleet_through_the_launcher(model, tmp_path):
    tools, log_dir = make_tools(tmp_path / "tools"), tmp_path / "logs"
    launcher = None
    try:
        launcher, summary = _serve(model, tools, log_dir)
        segments = _segments(log_dir)
        r = subprocess.run([KVBRIDGE, "serve", "--stop", str(log_dir)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert launcher.wait(60) == 0  # SIGTERM: its own clean stop
        _gone([log_dir], summary["ports"], segments)
    finally:
        _cleanup([log_dir], *([launcher] if launcher else []))


def _one_error_line(args: list[str]) -> str:
    from typer.testing import CliRunner

    from kvbridge.cli import app
    r = CliRunner().invoke(app, args)
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


def test_stop_refuses_what_it_cannot_stop_in_one_line(model, tmp_path):
    assert "--stop" in _one_error_line(["serve", "--stop", str(tmp_path / "nothing-here")])
    assert "give no MODEL" in _one_error_line(["serve", str(model), "--stop", str(tmp_path)])
    assert "--stop DIR" in _one_error_line(["serve"])
    (tmp_path / "fleet-0000.json").write_text("{}")
    (tmp_path / "fleet-0000.json").chmod(0o666)  # anyone could have written it: it names processes to kill
    assert "not a fleet record this user wrote" in _one_error_line(["serve", "--stop", str(tmp_path)])
