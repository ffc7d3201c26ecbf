"""`make serve-check`: a fleet of `vllm serve` instances of four shapes behind `vllm-router`, run
as users run it, through churn, faults and starvation (issue 22 points 3-5).

One plain `vllm serve` instance (no connector) answers every prompt too; each phase sends a load
of distinct prompts through the router with `kvbridge.testing.serving.request` while something
happens to the fleet, and counts what a client saw: completed with the plain instance's tokens,
completed with other tokens (never acceptable), errors (an HTTP error or a cut stream), and how
many KV loads failed over to vLLM's recompute (`kv_load_failure_policy: recompute`, from the
connector's transfer events). After the fleet stops: processes, shared-memory segments and
listening ports it left.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvbridge.integrations.vllm.fleet import Fleet, FleetConfig, InstanceShape, healthy, port_free, vllm_serve_member
from kvbridge.integrations.vllm.fleet_processes import remove_unused_segments, session_segments, stop_session
from kvbridge.testing.rotation import errors_by_second, starved_member
from kvbridge.testing.serving import edge_cases, prompt_text, request, transfer_events

SHAPES = {"prefill": ["tp=1,block=64", "tp=2,block=32"], "decode": ["tp=2,block=32", "tp=1,block=128"]}
NEW_TOKENS = 8


def _log(msg: str) -> None:
    print(f"[serve-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Check:
    def __init__(self, work: Path, python: str | None):
        from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama
        self.work = work
        self.model = add_byte_tokenizer(make_tiny_llama(work / "tiny-llama", seed=3))
        self.stats = work / "transfers.jsonl"
        from kvbridge.proofs.vllm.cluster import free_ports
        config = FleetConfig(model=self.model, prefill=[InstanceShape.parse(t, "--prefill") for t in SHAPES["prefill"]],
                             decode=[InstanceShape.parse(t, "--decode") for t in SHAPES["decode"]],
                             log_dir=work / "fleet", port=free_ports(1), vllm_python=python,
                             stats_path=str(self.stats))
        self.fleet = Fleet(config)
        self.ref = vllm_serve_member(config, self.fleet._vllm, "reference", InstanceShape(tp=1, block=32),
                                     free_ports(1, self.fleet._promised), work, kv=None)
        self.rows: list[dict[str, Any]] = []
        self.rotation: list[dict[str, Any]] = []  # out of rotation after a kill; a starved member kept
        self._seed = 1000
        self._reference: dict[str, list[int]] = {}

    # -- phases ------------------------------------------------------------------------------------
    def wait_healthy(self, timeout: float = 1800.0) -> None:
        self.fleet.wait_ready(timeout)
        end = time.monotonic() + timeout
        while not healthy(self.ref.url):
            if time.monotonic() > end or (self.ref.proc and self.ref.proc.poll() is not None):
                raise RuntimeError(f"the plain reference instance did not start: {self.ref.log_tail(10)}")
            time.sleep(1)

    def reference(self, prompt: str) -> list[int]:
        if prompt not in self._reference:
            self._reference[prompt] = request(self.ref.url, prompt, NEW_TOKENS).token_ids
        return self._reference[prompt]

    def load(self, name: str, count: int, concurrency: int, during: Callable[[], str] | None = None) -> None:
        """`count` distinct prompts, `concurrency` at a time, while `during()` acts on the fleet."""
        prompts = [prompt_text(self._seed + i, 40 + (37 * i) % 260) for i in range(count)]
        self._seed += count
        for p in prompts:
            self.reference(p)
        loads_before = len(transfer_events(str(self.stats)))
        note = ""
        t0 = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(request, self.fleet.endpoint, p, NEW_TOKENS, stream=i % 2 == 1)
                       for i, p in enumerate(prompts)]
            if during is not None:
                note = during()
            answers = [f.result() for f in futures]
        loads = [e for e in transfer_events(str(self.stats))[loads_before:] if e.get("event") == "recv"]
        row = {"phase": name, "requests": count, "completed": sum(a.ok for a in answers),
               "equal": sum(a.ok and a.token_ids == self.reference(p) for a, p in zip(answers, prompts)),
               "wrong": sum(a.ok and a.token_ids != self.reference(p) for a, p in zip(answers, prompts)),
               "errors": sum(not a.ok for a in answers),
               "kv_loads": len({(e.get("request_id"), e.get("engine_id")) for e in loads}),
               "recomputed": len({(e.get("request_id"), e.get("engine_id")) for e in loads if not e.get("ok")}),
               "seconds": round(time.monotonic() - t0, 1), "note": note,
               "error_samples": sorted({a.error[:160] for a in answers if a.error})[:3],
               "wrong_samples": [{"tokens": a.token_ids, "reference": self.reference(p)} for a, p in
                                 zip(answers, prompts) if a.ok and a.token_ids != self.reference(p)][:3]}
        _log(f"{name}: {row}")
        self.rows.append(row)

    def edge(self) -> None:
        decode = next(m for m in self.fleet.members if m.name == "decode-0")
        cases = edge_cases(self.fleet.endpoint, decode.url, self.ref.url, block=32)
        self.rows.append({"phase": "edge cases (short prompt, full/partial prefix hit on D, streaming, chat, "
                          "8 concurrent)", "requests": len(cases), "completed": sum(c.fleet.ok for c in cases),
                          "equal": sum(c.equal for c in cases),
                          "wrong": sum(c.fleet.ok and not c.equal for c in cases),
                          "errors": sum(not c.fleet.ok for c in cases), "kv_loads": None, "recomputed": None,
                          "seconds": None, "note": "", "error_samples": [c.fleet.error for c in cases if c.fleet.error][:3]})
        _log(f"edge cases: {self.rows[-1]}")

    def kill_then(self, name: str, delay: float = 4.0) -> Callable[[], str]:
        def act() -> str:
            time.sleep(delay)
            self.fleet.kill(name)
            return f"{name} killed (SIGKILL) {delay:.0f} s into the load"
        return act

    def restart(self, name: str) -> None:
        t0 = time.monotonic()
        self.fleet.restart(name)
        self.fleet.wait_ready(1800)
        _log(f"{name} restarted as a new incarnation, healthy in {time.monotonic() - t0:.0f} s")

    def starve(self, seconds: float = 60.0) -> Callable[[], str]:
        def act() -> str:
            hogs = [subprocess.Popen(["nice", "-n", "-20", "python3", "-c", "while True: pass"])
                    for _ in range(os.cpu_count() or 2)]
            time.sleep(seconds)
            for h in hogs:
                h.kill()
                h.wait()
            return f"{len(hogs)} CPU hogs at nice -20 for {seconds:.0f} s"
        return act

    def join(self, shape: str) -> Callable[[], str]:
        def act() -> str:
            time.sleep(2.0)
            m = self.fleet.join("decode", InstanceShape.parse(shape, "--decode"))
            self.fleet.wait_ready(1800)
            self.fleet.restart_router()
            self.fleet.wait_ready(300)
            return f"{m.name} ({shape}) joined under load; router restarted with it"
        return act

    def leaks(self) -> dict[str, Any]:
        from kvbridge.integrations.vllm.fleet_processes import _pids_in_groups
        groups = {m.proc.pid for m in self.fleet.everyone() if m.proc is not None}
        ports = sorted(self.fleet.port_locks.ports)  # every port it reserved: HTTP, side channels, metrics, master
        self.fleet.stop()
        time.sleep(1)
        return {"processes_left": len(_pids_in_groups(groups)),
                "segments_left": sum(os.path.exists(f"/dev/shm/{s}") for s in self.fleet.segments),
                "segments_tracked": len(self.fleet.segments),
                "ports_left": sum(not port_free("127.0.0.1", p) for p in ports)}


def run(work: Path | None = None, python: str | None = None, quick: bool = False) -> dict[str, Any]:
    work = Path(work or tempfile.mkdtemp(prefix="kvbridge-serve-check-")).resolve()
    check = Check(work, python)
    with open(check.ref.log_path, "wb") as log:
        check.ref.proc = subprocess.Popen(check.ref.argv, env=check.ref.env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
    leaks: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        check.fleet.start()
        check.wait_healthy()
        _log(f"fleet {SHAPES} and the plain instance healthy in {time.monotonic() - t0:.0f} s")
        check.edge()
        check.load("load, nothing happens", 24, 8)
        if not quick:
            check.load("load, prefill-1 killed", 24, 8, check.kill_then("prefill-1"))
            check.restart("prefill-1")
            check.load("load after prefill-1 restarted", 16, 8)
            check.load("load, decode-1 killed", 24, 8, check.kill_then("decode-1"))
            check.restart("decode-1")
            check.load("load after decode-1 restarted", 16, 8)
            check.rotation.append(errors_by_second(check.fleet, "prefill-1"))
            _log(f"errors by second after prefill-1's kill: {check.rotation[-1]}")
            check.restart("prefill-1")
            check.rotation.append(starved_member(check.fleet, "decode-1", 60.0))
            _log(f"decode-1 stopped for 60 s: {check.rotation[-1]}")
            check.load("load, host starved", 24, 8, check.starve(60.0))
            check.load("load, decode-2 joins", 24, 8, check.join("tp=1,block=64"))
            check.load("load after the join", 16, 8)
    finally:
        leaks = check.leaks()
        ref_segments = session_segments(check.ref.proc.pid) if check.ref.proc else set()
        stop_session(check.ref.proc)
        remove_unused_segments(ref_segments)
    return {"work": str(work), "rows": check.rows, "rotation": check.rotation, "leaks": leaks}


__all__ = ["Check", "run"]
