"""Regenerate docs/reliability.md from the same bounded scenarios CI runs.

    .venv/bin/python scripts/reliability_report.py [--requests N] [--fuzz-runs N --fuzz-seconds S]

The scenarios are the functions in `kvbridge.testing.reliability` that
tests/connector/test_connector_soak.py, test_connector_soak_multiprocess.py and
test_connector_reliability_report.py call, and the atheris runner of tests/fuzz/fuzz_messages.py
that tests/fuzz/test_fuzz_messages.py calls.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time

from kvbridge.testing.reliability import garbage_frames, multiprocess_soak, soak
from kvbridge.connector.transports import unavailable_reason

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_messages", os.path.join(ROOT, "tests", "fuzz",
                                                                                "fuzz_messages.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FUZZ = _fuzz_module()
SCENARIOS = {"soak": soak, "multiprocess_soak": multiprocess_soak, "garbage_frames": garbage_frames,
             "atheris": FUZZ.run_atheris}
"""What this sheet runs; a test checks these are the functions the CI tests import."""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _quarters(samples: list[dict], key: str) -> str:
    return " / ".join(f"{x[key] / (1 << 20):.1f}" if key == "rss" else str(x[key]) for x in samples)


def _security_rows() -> tuple[list[tuple[str, str]] | None, str]:
    """The forged-peer test's rows (it writes them when KVBRIDGE_SECURITY_REPORT names a file)."""
    import json
    import subprocess
    with tempfile.TemporaryDirectory(prefix="kvbridge-security-") as tmp:
        out = os.path.join(tmp, "rows.json")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            os.path.join(ROOT, "tests", "security", "test_forged_peer.py")],
                           env={**os.environ, "KVBRIDGE_SECURITY_REPORT": out}, capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0 or not os.path.exists(out):
            return None, (r.stdout + r.stderr).strip().splitlines()[-1:][0] if (r.stdout + r.stderr).strip() else "?"
        return [tuple(x) for x in json.load(open(out))], ""


def _cli_bound_rows() -> list[str]:
    """Absurd command-line values and configs, as a user types them: exit code, seconds, the line."""
    import json
    import subprocess
    kvbridge = os.path.join(os.path.dirname(sys.executable), "kvbridge")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbridge-bounds-") as tmp:
        configs = {"nan.json": '{"model_type": "llama", "num_hidden_layers": NaN}', "list.json": "[1, 2]",
                   "deep.json": '{"a":' * 5000 + "1" + "}" * 5000,
                   "huge.json": json.dumps({"model_type": "llama", "num_hidden_layers": 10 ** 6, "hidden_size": 64,
                                            "num_attention_heads": 4})}
        for name, text in configs.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        cases = [["plan", "llama-3-8b", "--decode-tp", "1000000"], ["plan", "llama-3-8b", "--tokens", "10000000"],
                 ["demo", "--prompt-len", "100000"], ["verify", "--cases", "100000000"],
                 *[["plan", os.path.join(tmp, name)] for name in configs]]
        for args in cases:
            t0 = time.monotonic()
            r = subprocess.run([kvbridge, *args], capture_output=True, text=True, timeout=120)
            lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
            shown = " ".join(a if not a.startswith(tmp) else os.path.basename(a) for a in args)
            line = lines[0].replace(tmp + "/", "") if len(lines) == 1 else f"{len(lines)} lines"
            rows.append(f"| `kvbridge {shown}` | {r.returncode} | {time.monotonic() - t0:.1f} | {line} |")
    return rows


def serving_lines(path: str) -> list[str]:
    """The `make serve-check` fleet table from its JSON (`--serve-check`), when there is one: the
    fleet needs vLLM and half an hour, so it is measured by that target, not by this script. The
    table is a generated block (scripts/serve_tables.py renders it from the same JSON)."""
    if not os.path.isfile(path):
        return []
    report = json.load(open(path))
    if not report.get("faults"):
        return []
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from serve_tables import faults_table
    return ["## Serving fleets under churn, faults and starvation", "",
            "`make serve-check` (`kvbridge.testing.serve_check`): `kvbridge serve` with prefill TP 1 / block 64, "
            "prefill TP 2 / block 32, decode TP 2 / block 32 and decode TP 1 / block 128 behind `vllm-router`, "
            "a plain `vllm serve` instance beside it; each phase sends distinct prompts (every other one "
            "streamed) through the router while something happens to the fleet. equal: the plain instance's "
            "tokens; wrong: other tokens; errors: what a client saw as an HTTP error or a cut stream; recomputed: "
            "KV loads that failed over to vLLM's recompute (`kv_load_failure_policy: recompute`).", "",
            "<!-- serve-check: faults_table -->", *faults_table(report), "<!-- /serve-check -->", ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000, help="requests of each soak (CI: 2000)")
    ap.add_argument("--fuzz-runs", type=int, default=50000, help="atheris inputs (CI: 50000)")
    ap.add_argument("--fuzz-seconds", type=int, default=20, help="atheris time bound (CI: 20)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "reliability.md"))
    ap.add_argument("--serve-check", default=os.path.join(ROOT, "docs", "serve-check.json"),
                    help="make serve-check's JSON, rendered as the serving section when present")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    lines = ["# Reliability figures", "",
             "Generated by `.venv/bin/python scripts/reliability_report.py` "
             f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs). Each figure names the test that "
             "asserts it in CI.", "", "## Load held in one process", "",
             "Every prefill rank (TP 2) and the decode rank (TP 1) in one process, driven by one loop.", "",
             "| transport | requests | in flight | ok | failed | bytes moved | checksums verified | releases "
             "(twice) | RSS first→last quarter | fds first→last | fds before→after | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lost = 0
    failed: list[str] = []  # the first reasons of each soak that lost requests, printed below its table
    kinds = ("shm", "mooncake" if unavailable_reason("mooncake") is None else "nixl")
    for kind in kinds:
        r = soak(kind, args.requests, 64)
        failed += [f"in-process {kind}: {why}" for why in r["failures"][:3]]
        s0, s1 = r["samples"][0], r["samples"][-1]
        lost += r["failed"] + (r["requests"] - r["completed"])
        lines.append(f"| {kind} | {r['requests']} | {r['in_flight']} | {r['ok']} | {r['failed']} | {_mib(r['bytes'])} "
                     f"| {r['checksums_verified']} | {r['releases']} ({r['released_twice']}) | {_mib(s0['rss'])} → "
                     f"{_mib(s1['rss'])} | {s0['fds']} → {s1['fds']} | {r['before']['fds']} → {r['after']['fds']} "
                     f"| {r['seconds']:.1f} |")
    lines += ["", *(f"- FAILED {why}" for why in failed)] if failed else []
    failed = []
    lines += ["", "Reproduce: `KVBRIDGE_SOAK_REQUESTS=2000 .venv/bin/python -m pytest tests/connector/"
              "test_connector_soak.py` (asserts RSS growth < 16 MiB and fds ±2 from the first to the last quarter, "
              "every request checksum-verified, each lease released exactly once per prefill rank).", ""]
    lines += ["## Load held through multi-process engines", "",
              "Each prefill rank (TP 2) and each decode rank (TP 1) is its own OS process, as the multi-process "
              "demo runs them; the parent only schedules. Every request gets fresh random bytes in its source "
              "blocks on every prefill rank and poisoned destination rows on the decode rank before it is "
              "received, so the end-to-end checksum each decode rank verifies proves that request's bytes "
              "moved (a slot is reused only after the decode rank reported and both prefill ranks released).",
              "",
              "| transport | processes | requests | in flight | ok | failed | bytes moved | checksums verified "
              "| releases (twice, never) | /dev/shm segments in run → after | seconds |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    per_process = ["", "| transport | process | RSS per quarter (MiB) | open fds per quarter |", "|---|---|---|---|"]
    for kind in kinds:
        r = multiprocess_soak(kind, args.requests, 64)
        lost += r["failed"] + (r["requests"] - r["completed"])
        failed += [f"multi-process {kind}: {why}" for why in r["failures"][:3]]
        shm = sorted(set(r["shm_samples"]))
        lines.append(f"| {kind} | {r['processes']} + parent | {r['requests']} | {r['in_flight']} | {r['ok']} "
                     f"| {r['failed']} | {_mib(r['bytes'])} | {r['checksums_verified']} | {r['releases']} "
                     f"({r['released_twice']}, {r['never_released']}) | {'/'.join(map(str, shm))} → "
                     f"{r['shm_after']} | {r['seconds']:.1f} |")
        for name, samples in r["samples"].items():
            per_process.append(f"| {kind} | {name} | {_quarters(samples, 'rss')} | {_quarters(samples, 'fds')} |")
    lines += per_process
    lines += ["", *(f"- FAILED {why}" for why in failed)] if failed else []
    lines += ["", "Reproduce: `KVBRIDGE_MP_SOAK_REQUESTS=2000 .venv/bin/python -m pytest tests/connector/"
              "test_connector_soak_multiprocess.py` (asserts, for every process, RSS growth < 16 MiB and fds ±8 "
              "from the first to the last quarter; every request ok and checksum-verified on fresh bytes; each "
              "request released exactly once by each prefill rank, after it was read; no /dev/shm segment left "
              "after the processes stop).", ""]
    with tempfile.TemporaryDirectory(prefix="kvbridge-fuzz-") as tmp:
        fz = FUZZ.run_atheris(args.fuzz_runs, args.fuzz_seconds, tmp) if FUZZ.atheris_unavailable() is None else None
    fuzz_ok = None if fz is None else fz["rc"] == 0 and not fz["crashes"] and not fz["hung"] and fz["runs"] > 0
    if fz is None:
        fuzz_line = f"- atheris fuzzing of the side-channel decoder: not run here ({FUZZ.atheris_unavailable()})."
    else:
        verdict = ("no crash, no hang" if fuzz_ok
                   else f"FAILED (exit {fz['rc']}, hung {fz['hung']}, artifacts {fz['crashes']})")
        fuzz_line = (f"- atheris (libFuzzer, coverage-guided) on the side channel's decode path "
                     f"(`side_channel._decode_parts` on the server and client, with and without the HMAC secret, "
                     f"and `messages.decode` of transport notifications), arbitrary bytes and mutations of valid "
                     f"frames of every message type: {fz['runs']} inputs in {fz['seconds']} s of fuzzing "
                     f"({fz['wall_seconds']:.0f} s with the child's start-up), {verdict}; only "
                     f"`ProtocolError`s, every decoded message re-encodes to itself, every signed frame replayed is "
                     f"refused. Reproduce: `KVBRIDGE_FUZZ_RUNS={args.fuzz_runs} KVBRIDGE_FUZZ_SECONDS="
                     f"{args.fuzz_seconds} .venv/bin/python -m pytest tests/fuzz/test_fuzz_messages.py` (longer: "
                     "`KVBRIDGE_FUZZ_RUNS=0 KVBRIDGE_FUZZ_SECONDS=600`; or run `tests/fuzz/fuzz_messages.py` with "
                     "libFuzzer flags); the same contract under hypothesis: 800 examples of arbitrary and mutated "
                     "frames in that file.")
    g = garbage_frames(500)
    sec_rows, sec_why = _security_rows()
    lost += 0 if sec_rows else 1
    lines += ["## Bad inputs tried", "",
              f"- {g['sent']} hostile frames into a live prefill rank ({', '.join(f'{k}: {v}' for k, v in g['kinds'].items())}): "
              f"{g['refused']} refused, {g['aborts_counted']} acted on; a real request afterwards "
              f"{'succeeded' if g['after_ok'] else 'FAILED: ' + g['after_reason']}. "
              "Reproduce: `pytest tests/connector/test_connector_reliability_report.py`.",
              "- Refused before any byte moves, each with a test: source block ids outside the registered regions "
              "(`test_connector_lifecycle.py::test_source_block_ids_outside_the_regions_are_refused_before_any_byte_moves`), "
              "push destinations outside the regions, a plan reaching past the request's blocks, more tokens than "
              "the blocks hold, messages before a handshake, every truncation of a valid frame, wrong part counts "
              "(`test_connector_hostile.py`), a message claiming another identity (lifecycle), unknown engine / "
              "wrong fingerprint / version / role / mode / transport (`test_connector_handshake.py`), malformed, "
              "oversized, other-version frames and hypothesis fuzz of the decoder, 600 examples "
              "(`test_connector_messages.py`), missing / wrong / replayed / stale / reflected HMACs and MACs sent "
              "to a secret-less peer (`test_connector_auth.py`).",
              fuzz_line,
              "- Corruption in flight (a byte flipped in the source after the checksum, or in the destination "
              "before verification) fails exactly the affected request on exactly the affected decode rank, with "
              "its id and reason (`test_connector_integrity.py`, pull and push, TP 2→3 and 3→1).", "",
              "## An attacker on loopback", "",
              "A real `prefill-server` process (push mode over shm, secret from a 0600 file), attacked with raw "
              "ZMQ sockets and only public facts; then a legitimate decode client. Each row is what the server "
              "answered (docs/security.md has the threat model).", "",
              "| attempt | outcome |", "|---|---|",
              *([f"| {what} | {outcome} |" for what, outcome in sec_rows] if sec_rows
                else [f"| forged-peer test | FAILED: {sec_why} |"]),
              "", "Reproduce: `.venv/bin/python -m pytest -s tests/security/test_forged_peer.py` (asserts each "
              "refusal, no announcement, no file opened or mapped, < 64 MiB and < 5 ms of CPU per refused frame, "
              "and that the real client is served after).", "",
              "## Absurd input from the command line or a config", "",
              "| command | exit | seconds | output |", "|---|---|---|---|", *_cli_bound_rows(), "",
              "Reproduce: `.venv/bin/python -m pytest tests/test_cli.py tests/models/test_untrusted_config.py`.", "",
              *serving_lines(args.serve_check),
              "## Faults survived", "",
              "- prefill rank killed mid-transfer, decode rank that never reads (lease expiry, released once), "
              "abort mid-transfer: `tests/connector/test_connector_faults.py` (pull and push, real processes).",
              "- garbage on the side channel of a live prefill rank (above): refused, service continues.",
              "- decode rank killed mid-transfer (its prefill rank releases once after the lease, the surviving "
              "decode rank completes its share), side channel dropped mid-request (both requests fail with reasons "
              "within the deadline, every lease released once, fds and shm segments do not grow, the next requests "
              "succeed after reconnecting), a prefill peer restarting under the same engine id (the old request "
              "fails with a reason; a changed layout under the same id is refused at registration; a fresh "
              "consumer handshakes and new requests succeed): `tests/connector/test_connector_faults_more.py`.",
              "- network link cut mid-request between two namespaces (`ip link set down` on both veth ends; shm pull "
              "and Mooncake push): in-flight requests fail within their timeout with their ids, a request received "
              "after the cut fails at once with no byte landed, each prefill rank releases each request exactly "
              "once, and after the link is back new requests complete byte-exact: "
              "`tests/connector/test_connector_link_cut.py`.",
              "- resources after faults, checked exactly after a warm-up cycle of the same kind: decode rank killed "
              "(test process fds 12 = 12 and shm segments 1 = 1, were 22 -> 26 and 1 -> 2; the surviving prefill "
              "rank's peers and mapped segments back to 0, were 2 -> 4), peer restart (fds 20 = 20, were +8 to +10 "
              "per cycle), link cut (fds, segments, registered regions and peers back to the warm-up level).",
              "",
              "## What was lost", "",
              ("Nothing: every soak request (in one process and through multi-process engines) completed and "
               f"verified;{' the fuzzer found no crash or hang;' if fuzz_ok else ''} every failure in the tests "
               "above is the intended one and carries its request id and reason." if lost == 0 and fuzz_ok is not False
               else f"{lost} soak requests failed or did not complete"
               f"{'; the fuzzer found a crash or hang' if fuzz_ok is False else ''}: see above."), ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0 if lost == 0 and fuzz_ok is not False else 1


if __name__ == "__main__":
    sys.exit(main())
