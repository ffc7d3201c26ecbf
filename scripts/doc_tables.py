"""The docs' figure tables outside the serving runs, rendered from committed JSON (issue 43 point
6): docs/reliability.json (written by scripts/reliability_report.py) and the records of one-off
runs that cannot be repeated by a script here, transcribed with their date, machine and source
(docs/transports.json, docs/security.json, docs/vllm.json, docs/gpu.json, docs/pool-bench.json).

Each block sits between `<!-- figures: NAME -->` and `<!-- /figures -->` in a doc (the machinery
is scripts/doc_blocks.py's, shared with scripts/serve_tables.py); `python scripts/doc_tables.py`
rewrites every block from the JSON, `--check` exits 1 naming the docs whose blocks differ, or when
a JSON holds a machine path or name (tests/test_doc_tables.py runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_blocks  # noqa: E402  (scripts/ is not a package)

ROOT = Path(__file__).resolve().parents[1]
DOCS_DIR = ROOT / "docs"
SOURCES = ("reliability", "transports", "security", "vllm", "gpu", "pool-bench")
"""The JSON files (docs/NAME.json) the blocks render from; a renderer gets them all, by NAME."""
DOCS = tuple(DOCS_DIR / f"{n}.md" for n in ("reliability", "transports", "security", "vllm", "gpu", "pool"))
BLOCK = doc_blocks.block_pattern("figures")


# -- docs/reliability.json: scripts/reliability_report.py's record ---------------------------------

def _lost(rel: dict[str, Any]) -> int:
    """Soak requests that failed or did not complete, and 1 if the forged-peer test failed."""
    soaks = rel["soak"] + rel["multiprocess_soak"]
    return sum(r["failed"] + r["requests"] - r["completed"] for r in soaks) + (0 if rel["forged_peer"]["rows"] else 1)


def fuzz_ok(rel: dict[str, Any]) -> bool | None:
    """None when atheris was not run, else whether it ran inputs and found no crash or hang."""
    fz = rel["fuzz"]
    if fz.get("not_run"):
        return None
    return fz["rc"] == 0 and not fz["crashes"] and not fz["hung"] and fz["runs"] > 0


def report_ok(rel: dict[str, Any]) -> bool:
    return _lost(rel) == 0 and fuzz_ok(rel) is not False


def _failed(rows: list[dict[str, Any]], what: str) -> list[str]:
    lines = [f"- FAILED {what} {r['transport']}: {why}" for r in rows for why in r["failures"][:3]]
    return ["", *lines] if lines else []


def reliability_run(data: dict[str, Any]) -> list[str]:
    rel = data["reliability"]
    load = (f", load average {rel['load_avg_at_start']:.1f} at the start" if rel.get("load_avg_at_start") is not None
            else "")
    return [f"Measured by `.venv/bin/python {rel['command']}` ({rel['date']}, {rel['cores']} CPUs{load}). Its record "
            "is docs/reliability.json" + (" (transcribed from the tables that run wrote)" if rel.get("transcribed")
                                         else "")
            + ", from which the tables and figures below are rendered (`python scripts/doc_tables.py`). Each figure "
            "names the test that asserts it in CI."]


def reliability_soak(data: dict[str, Any]) -> list[str]:
    rows = data["reliability"]["soak"]
    out = ["| transport | requests | in flight | ok | failed | bytes moved | checksums verified | releases (twice) "
           "| RSS first→last quarter | fds first→last | fds before→after | seconds |", "|" + "---|" * 12]
    out += [f"| {r['transport']} | {r['requests']} | {r['in_flight']} | {r['ok']} | {r['failed']} | "
            f"{r['bytes_mib']:.1f} MiB | {r['checksums_verified']} | {r['releases']} ({r['released_twice']}) | "
            f"{r['rss_mib_first_quarter']:.1f} MiB → {r['rss_mib_last_quarter']:.1f} MiB | "
            f"{r['fds_first_quarter']} → {r['fds_last_quarter']} | {r['fds_before']} → {r['fds_after']} | "
            f"{r['seconds']:.1f} |" for r in rows]
    return out + _failed(rows, "in-process")


def reliability_multiprocess_soak(data: dict[str, Any]) -> list[str]:
    rows = data["reliability"]["multiprocess_soak"]
    out = ["| transport | processes | requests | in flight | ok | failed | bytes moved | checksums verified "
           "| releases (twice, never) | /dev/shm segments in run → after | seconds |", "|" + "---|" * 11]
    out += [f"| {r['transport']} | {r['processes']} + parent | {r['requests']} | {r['in_flight']} | {r['ok']} | "
            f"{r['failed']} | {r['bytes_mib']:.1f} MiB | {r['checksums_verified']} | {r['releases']} "
            f"({r['released_twice']}, {r['never_released']}) | {'/'.join(map(str, r['shm_in_run']))} → "
            f"{r['shm_after']} | {r['seconds']:.1f} |" for r in rows]
    out += ["", "| transport | process | RSS per quarter (MiB) | open fds per quarter |", "|---|---|---|---|"]
    out += [f"| {r['transport']} | {p['process']} | {' / '.join(f'{x:.1f}' for x in p['rss_mib'])} | "
            f"{' / '.join(map(str, p['fds']))} |" for r in rows for p in r["per_process"]]
    return out + _failed(rows, "multi-process")


def reliability_bad_inputs(data: dict[str, Any]) -> list[str]:
    rel = data["reliability"]
    g, fz = rel["garbage_frames"], rel["fuzz"]
    out = [f"- {g['sent']} hostile frames into a live prefill rank ("
           + ", ".join(f"{k}: {v}" for k, v in g["kinds"].items()) + f"): {g['refused']} refused, "
           f"{g['aborts_counted']} acted on; a real request afterwards "
           f"{'succeeded' if g['after_ok'] else 'FAILED: ' + g['after_reason']}. "
           "Reproduce: `pytest tests/connector/test_connector_reliability_report.py`."]
    if fz.get("not_run"):
        return out + [f"- atheris fuzzing of the side-channel decoder: not run here ({fz['not_run']})."]
    verdict = ("no crash, no hang" if fuzz_ok(rel)
               else f"FAILED (exit {fz['rc']}, hung {fz['hung']}, artifacts {fz['crashes']})")
    return out + [
        "- atheris (libFuzzer, coverage-guided) on the side channel's decode path (`side_channel._decode_parts` on "
        "the server and client, with and without the HMAC secret, and `messages.decode` of transport "
        "notifications), arbitrary bytes and mutations of valid frames of every message type: "
        f"{fz['runs']} inputs in {fz['seconds']} s of fuzzing ({fz['wall_seconds']:.0f} s with the child's start-up), "
        f"{verdict}; only `ProtocolError`s, every decoded message re-encodes to itself, every signed frame replayed "
        f"is refused. Reproduce: `KVBRIDGE_FUZZ_RUNS={fz['runs_bound']} KVBRIDGE_FUZZ_SECONDS={fz['seconds_bound']} "
        ".venv/bin/python -m pytest tests/fuzz/test_fuzz_messages.py` (longer: `KVBRIDGE_FUZZ_RUNS=0 "
        "KVBRIDGE_FUZZ_SECONDS=600`; or run `tests/fuzz/fuzz_messages.py` with libFuzzer flags); the same contract "
        "under hypothesis: 800 examples of arbitrary and mutated frames in that file."]


def reliability_attacker(data: dict[str, Any]) -> list[str]:
    fp = data["reliability"]["forged_peer"]
    rows = [f"| {what} | {outcome} |" for what, outcome in fp["rows"]] if fp["rows"] \
        else [f"| forged-peer test | FAILED: {fp['failed']} |"]
    return ["| attempt | outcome |", "|---|---|", *rows]


def reliability_cli(data: dict[str, Any]) -> list[str]:
    return ["| command | exit | seconds | output |", "|---|---|---|---|",
            *(f"| `{r['command']}` | {r['exit']} | {r['seconds']:.1f} | {r['output']} |"
              for r in data["reliability"]["cli_bounds"])]


def reliability_lost(data: dict[str, Any]) -> list[str]:
    rel = data["reliability"]
    lost, ok = _lost(rel), fuzz_ok(rel)
    if lost == 0 and ok is not False:
        return ["Nothing: every soak request (in one process and through multi-process engines) completed and "
                f"verified;{' the fuzzer found no crash or hang;' if ok else ''} every failure in the tests above is "
                "the intended one and carries its request id and reason."]
    fuzz = "; the fuzzer found a crash or hang" if ok is False else ""
    return [f"{lost} soak requests failed or did not complete{fuzz}: see above."]


# -- transcribed records of one-off runs -----------------------------------------------------------

def _cell(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        raise ValueError(f"a table cell is a number or text, not {v!r}")
    return v if isinstance(v, str) else repr(v) if isinstance(v, float) else str(v)


def table(record: dict[str, Any]) -> list[str]:
    """A transcribed table: `columns`, then `rows` (numbers as JSON keeps them, other cells as the
    doc wrote them)."""
    cols = record["columns"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in record["rows"]:
        if len(row) != len(cols):
            raise ValueError(f"row {row!r} has {len(row)} cells for {len(cols)} columns")
        out.append("|" + "".join(f" {_cell(v)} |" if v != "" else " |" for v in row))
    return out


def security_checksum(data: dict[str, Any]) -> list[str]:
    """What the end-to-end checksum costs beside the transfer it checks: rows as
    `kvbridge.bench.checksum.bench_checksum(...).to_dict()` gives them."""
    out = ["| tokens | bytes | transfer | checksums (prefill share + decode) | overhead |", "|---|---|---|---|---|"]
    out += [f"| {r['num_tokens']} | {r['bytes'] / 2**20:.0f} MiB | {r['transfer_seconds'] * 1000:.1f} ms | "
            f"{r['source_checksum_seconds']:.2f} s + {r['destination_checksum_seconds']:.2f} s | {r['overhead']:.0f}x |"
            for r in data["security"]["checksum"]["rows"]]
    return out


TRANSCRIBED = {
    "transports_results": ("transports", "results"), "transports_before": ("transports", "before"),
    "security_forged_peer": ("security", "forged_peer"),
    "vllm_pd": ("vllm", "pd"), "vllm_beside_nixl": ("vllm", "beside_nixl"),
    "gpu_h100": ("gpu", "h100"), "gpu_h200": ("gpu", "h200"),
    "pool_transfer_by_block": ("pool-bench", "transfer_by_block"), "pool_phases": ("pool-bench", "phases"),
    "pool_serve_repeated": ("pool-bench", "serve_repeated"), "pool_serve_distinct": ("pool-bench", "serve_distinct"),
    "pool_serve_random": ("pool-bench", "serve_random"), "pool_serve_async": ("pool-bench", "serve_async"),
}
"""Block name: (JSON, key of the record in it)."""


def _transcribed(source: str, key: str):
    return lambda data: table(data[source][key])


RENDER: dict[str, doc_blocks.Renderer] = {
    "reliability_run": reliability_run, "reliability_soak": reliability_soak,
    "reliability_multiprocess_soak": reliability_multiprocess_soak, "reliability_bad_inputs": reliability_bad_inputs,
    "reliability_attacker": reliability_attacker, "reliability_cli": reliability_cli,
    "reliability_lost": reliability_lost, "security_checksum": security_checksum,
    **{name: _transcribed(*where) for name, where in TRANSCRIBED.items()}}


def load(json_dir: Path = DOCS_DIR) -> dict[str, Any]:
    """Every source JSON, by name."""
    return {name: json.loads((json_dir / f"{name}.json").read_text()) for name in SOURCES}


def render(text: str, data: dict[str, Any]) -> str:
    return doc_blocks.render(text, BLOCK, RENDER, data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-dir", type=Path, default=DOCS_DIR, help="where the source JSON files are (default docs/)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a doc's generated block differs")
    args = ap.parse_args(argv)
    data = load(args.json_dir)
    return doc_blocks.refresh(DOCS, BLOCK, RENDER, data, {f"{n}.json": data[n] for n in SOURCES}, args.check,
                              "scripts/doc_tables.py")


if __name__ == "__main__":
    sys.exit(main())
