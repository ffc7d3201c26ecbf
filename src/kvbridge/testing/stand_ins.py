"""Stand-ins for `vllm serve`, `vllm-router` and `vllm bench serve`, shaped like a fleet's processes:
a leader answering `/health` on its `--port` and, for an instance, a child in its session that maps
two /dev/shm segments (a kvbridge-named one and a `psm_` block) and outlives its leader, as vLLM's
EngineCore can. Why: a fleet's start, stop and its launcher's death are then tested on real
processes, ports and segments in seconds, without vLLM (whose start takes minutes here).

`make_tools(DIR)` writes `python` (this interpreter), `vllm` and `vllm-router` into DIR: give
`DIR/python` as `--vllm-python` (or KVBRIDGE_VLLM_PYTHON). `vllm bench serve` writes
`RESULT_DIR/bench-started` (its pid) and waits: a benchmark round that never ends.
`KVBRIDGE_STAND_IN_HEALTHY_AFTER_S` in their environment: `/health` answers 503 for that long
first (a start that takes a while, as vLLM's does).
Only the standard library: each stand-in starts in well under a second.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

PROGRAM = r'''
import http.server, mmap, os, subprocess, sys, time, uuid

CHILD = r"""
import mmap, os, time, uuid
ns = os.stat("/proc/self/ns/pid").st_ino
maps = []
for name in (f"kvbridge-{os.getpid()}-ns{ns}-cache-{uuid.uuid4().hex[:12]}", f"psm_{uuid.uuid4().hex[:8]}"):
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
    print("segment", name, flush=True)
while True:
    time.sleep(60)
"""


STARTED = time.monotonic()
HEALTHY_AFTER_S = float(os.environ.get("KVBRIDGE_STAND_IN_HEALTHY_AFTER_S", "0"))


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        up = time.monotonic() - STARTED >= HEALTHY_AFTER_S
        self.send_response((200 if up else 503) if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def flag(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
if tool == "vllm" and args[:2] == ["bench", "serve"]:
    with open(os.path.join(flag("--result-dir"), "bench-started"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    sys.exit(0)
if tool == "vllm" and args[:1] == ["serve"]:
    subprocess.Popen([sys.executable, "-c", CHILD])  # the EngineCore's place: same session, its own memory
host = flag("--host", "127.0.0.1")
server = http.server.ThreadingHTTPServer(("127.0.0.1" if host == "0.0.0.0" else host, int(flag("--port"))), Health)
print(tool, "listening", server.server_address[1], flush=True)
server.serve_forever()
'''


def make_tools(directory: str | os.PathLike) -> Path:
    """Write the stand-ins into `directory`; the `python` to name as the vLLM environment's."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    python = d / "python"
    if not python.exists():
        python.symlink_to(sys.executable)
    for tool in ("vllm", "vllm-router"):
        path = d / tool
        path.write_text(f"#!{sys.executable}\n{PROGRAM}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return python


__all__ = ["make_tools"]
