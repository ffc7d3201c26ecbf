"""The serving tables of docs/serving.md and docs/reliability.md, rendered from `make serve-check`'s
one JSON (docs/serve-check.json), the scale bench's (docs/fleet-scale.json) and the pool transfer
bench's (docs/pool-transfer.json), so that a figure in the docs is a figure of a committed run and
its counts add up (issue 28 point 6).

Each generated block sits between `<!-- serve-check: NAME -->` and `<!-- /serve-check -->` in a
doc; `python scripts/serve_tables.py` rewrites every block from the JSON, `--check` exits 1 naming
the blocks that differ (tests/test_serve_tables.py runs it), and nothing outside the markers is
touched. The JSON keeps no machine paths or names (`make serve-check` writes it so, with
`strip_paths`); the check refuses JSON that does. The marker machinery is scripts/doc_blocks.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_blocks  # noqa: E402  (scripts/ is not a package)
from doc_blocks import strip_paths  # noqa: E402,F401  (scripts/serve_check.py imports it from here)

from kvbridge.bench.serving import round_cells  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "docs" / "serve-check.json"
SCALE_JSON = ROOT / "docs" / "fleet-scale.json"
TRANSFER_JSON = ROOT / "docs" / "pool-transfer.json"
ROUTING_JSON = ROOT / "docs" / "routing.json"
DOCS = (ROOT / "docs" / "serving.md", ROOT / "docs" / "reliability.md", ROOT / "docs" / "pool.md")
BLOCK = doc_blocks.block_pattern("serve-check")
FAULT_COLS = ("phase", "requests", "completed", "equal", "wrong", "errors", "kv_loads", "recomputed", "seconds")


def _num(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def fault_totals(faults: dict[str, Any]) -> dict[str, int]:
    rows = faults["rows"]
    return {k: sum(r[k] or 0 for r in rows) for k in ("requests", "completed", "equal", "wrong", "errors",
                                                          "recomputed")}


def faults_table(report: dict[str, Any]) -> list[str]:
    faults = report["faults"]
    out = [f"Measured {faults['date']} on a {faults['cores']}-core host (`make serve-check`).", "",
           "| " + " | ".join(FAULT_COLS) + " |", "|" + "---|" * len(FAULT_COLS)]
    out += ["| " + " | ".join(_num(r.get(c)) for c in FAULT_COLS) + " |" for r in faults["rows"]]
    t = fault_totals(faults)
    out.append(f"| all phases | {t['requests']} | {t['completed']} | {t['equal']} | {t['wrong']} | {t['errors']} "
               f"| | {t['recomputed']} | |")
    samples = sorted({e for r in faults["rows"] for e in r.get("error_samples") or []})
    if samples:
        out += ["", "What clients saw as errors: " + "; ".join(f"`{e}`" for e in samples[:4])]
    leaks = faults["leaks"]
    out += ["", f"After the fleet stopped: {leaks['processes_left']} processes, {leaks['segments_left']} of "
                f"{leaks['segments_tracked']} tracked segments and {leaks['ports_left']} ports left."]
    return out


def faults_summary(report: dict[str, Any]) -> list[str]:
    faults = report["faults"]
    t = fault_totals(faults)
    killed = [r for r in faults["rows"] if "killed" in r["phase"]]
    calm = [r for r in faults["rows"] if r not in killed]
    leaks = faults["leaks"]
    return [f"On {faults['date']} (docs/serve-check.json; the table is in docs/reliability.md, \"Serving "
            f"fleets\"): {t['wrong']} wrong answers in {t['requests']} requests; every request equal to the "
            "plain instance except those in flight on an instance that was killed ("
            + " and ".join(f"{r['errors']} of {r['requests']}" for r in killed)
            + "), which vLLM's router answered with HTTP 500 or a cut stream (it does not retry a request whose "
            f"instance died under it); starvation, restarts and the join: {sum(r['errors'] for r in calm)} errors, "
            f"{sum(r['recomputed'] or 0 for r in calm)} recomputed; after stop, {leaks['processes_left']} "
            f"processes, {leaks['segments_left']} of {leaks['segments_tracked']} tracked segments and "
            f"{leaks['ports_left']} ports left."]


def rotation(report: dict[str, Any]) -> list[str]:
    """Out of rotation after a kill (requests and errors by the second each was sent, from the
    kill) and a starved member kept (the router's health gauge sampled each second)."""
    out: list[str] = []
    for r in report["faults"].get("rotation", []):
        if "by_second" in r:
            secs = r["by_second"]
            out += [f"{r['member']} SIGKILLed under a load of {r['clients']} clients (`make serve-check`, "
                    f"{report['faults']['date']}): {r['errors']} of {r['requests']} requests failed, the last one "
                    f"sent {_num(r['last_error_sent_s'], 2)} s after the kill.", "",
                    "| second sent (from the kill) | " + " | ".join(str(b["second"]) for b in secs) + " |",
                    "|---|" + "---|" * len(secs),
                    "| failed / sent | " + " | ".join(f"{b['errors']} / {b['sent']}" for b in secs) + " |", ""]
        else:
            out += [f"{r['member']} stopped (SIGSTOP of its session) for {r['stopped_s']:.0f} s under load "
                    f"(`make serve-check`, {report['faults']['date']}): marked unhealthy by the router in "
                    f"{r['unhealthy_samples']} of {r['health_samples']} samples, {r['errors']} of {r['requests']} "
                    f"requests failed, the slowest took {r['slowest_request_s']} s.", ""]
    return out[:-1] if out else ["(this run of `make serve-check` measured no rotation)"]


BENCH_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_max_ms",
              "output_throughput")


def _host_line(bench: dict[str, Any]) -> str:
    hosts = [h for row in bench["table"] for c in ("kvbridge", "nixl") for h in row.get(c, {}).get("host", [])]
    if not hosts:
        return ""
    load = [h["load_avg_1m"][0] for h in hosts]
    return (f"The host's 1-minute load average at the runs' starts: {min(load):.1f} to {max(load):.1f}; other "
            f"programs used {sum(h['others_cpu_s'] for h in hosts):.0f} of the "
            f"{sum(h['host_cpu_s'] for h in hosts):.0f} CPU-seconds the host spent during the runs.")


STEP_CALLS = (("schedule", "scheduler: `build_connector_meta`, steps with tokens"), ("start_load_kv", "workers: `start_load_kv`"),
              ("get_finished", "workers: `get_finished`"))


def _step_path(bench: dict[str, Any]) -> list[str]:
    """kvbridge's calls on its decode instance's step path in the measured rounds (`step_path`)."""
    rows = [(row["dataset"].replace("_", " "), row["kvbridge"]["step_path"]) for row in bench["table"]
            if "step_path" in row.get("kvbridge", {})]
    if not rows:
        return []
    out = ["", "kvbridge's connector on its decode instance's step path in the measured rounds "
               "(`KVBRIDGE_STEP_PROFILE`; the sidecars' rounds run beside the step, not on it):", "",
           "| dataset | seconds | call | calls | p50 ms | p99 ms | max ms | all calls |", "|---|---|---|---|---|---|---|---|"]
    for ds, prof in rows:
        secs = _num(prof["seconds"])
        for kind, label in STEP_CALLS + (("sidecar", "sidecar rounds that used CPU (CPU ms)"),):
            c = prof["calls"].get(kind)
            if c is None:
                continue
            if kind == "sidecar":  # CPU: a round's wall time includes the idle fleet's SIGSTOP
                cells = [_num(c.get("p50_cpu_ms"), 3), _num(c.get("p99_cpu_ms"), 3), f"{c['max_cpu_ms']:.1f}",
                         f"{c['cpu_ms']:,.0f} ms"]
            else:
                cells = [f"{c['p50_ms']:.3f}", f"{c['p99_ms']:.3f}", f"{c['max_ms']:.1f}", f"{c['total_ms']:,.1f} ms"]
            out.append(f"| {ds} | {secs} | {label} | {c['calls']:,} | " + " | ".join(cells) + " |")
            ds = secs = ""
    return out


def _rounds(bench: dict[str, Any]) -> list[str]:
    """Round by round, kvbridge / NIXL, and in how many rounds kvbridge was at or ahead (issue 46.2;
    runs before 2026-11-29 kept medians only and render nothing here)."""
    rows = [r for r in bench["table"] if r.get("rounds_ahead")]
    if not rows:
        return []
    out = ["", "| dataset | figure | per round: kvbridge / NIXL | kvbridge spread | NIXL spread | at or ahead |",
           "|---|---|---|---|---|---:|"]
    for row in rows:
        out += [f"| {row['dataset']} | " + " | ".join(cells) + " |" for cells in round_cells(row, _num, " / ")]
    return out


def bench_tables(report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for bench in report.get("bench", []):
        warm = bench.get("warmup_seconds") or {}
        out += [f"P {bench['prefill']} -> D {bench['decode']}: {bench['prompts']} prompts, {bench['concurrency']} "
                f"in flight, {bench['rounds']} rounds, measured {bench['date']} ({bench.get('cores')} cores)"
                + (f"; fleets healthy after {bench['startup_seconds']:.0f} s, then an unmeasured warm-up ("
                   + ", ".join(f"{c} {s:.0f} s" for c, s in warm.items()) + ")" if warm else "") + ".", "",
                "| dataset | connector | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p90 ms "
                "| ITL p99 ms | ITL max ms | out tok/s | completed | failed |", "|" + "---|" * 12]
        steps = ["", "The decode instance's steps (vLLM's iteration log, all rounds; count per bucket of step time):",
                 ""]
        buckets: list[str] | None = None
        for row in bench["table"]:
            ds = row["dataset"].replace("_", " ")
            for c, label in (("kvbridge", "kvbridge"), ("nixl", "NixlConnector")):
                v = row.get(c)
                if v is None:
                    continue
                if "refused" in v:
                    out.append(f"| {ds} | {label} | refused: {v['refused']} |" + " |" * 9)
                    ds = ""
                    continue
                out.append(f"| {ds} | {label} | " + " | ".join(_num(v.get(k)) for k in BENCH_KEYS)
                           + f" | {v['completed']} | {v['failed']} |")
                h = v["decode_steps"]
                if buckets is None:
                    buckets = list(h["buckets"])
                    steps += ["| dataset | connector | steps | p50 ms | p99 ms | max ms | " + " | ".join(buckets)
                              + " |", "|" + "---|" * (6 + len(buckets))]
                steps.append(f"| {ds} | {label} | {h['steps']} | " + " | ".join(
                    _num(h[k]) for k in ("p50_ms", "p99_ms", "max_ms")) + " | "
                    + " | ".join(str(h["buckets"][b]) for b in buckets) + " |")
                ds = ""
            if row.get("ratios"):
                r = row["ratios"]
                out.append("| | ratio (NIXL / kvbridge; tok/s kvbridge / NIXL) | "
                           + " | ".join("-" if r.get(k) is None else f"**{r[k]:.2f}**" if k == "itl_p99_ms"
                                        else f"{r[k]:.2f}" for k in BENCH_KEYS) + " | | |")
        out += steps if buckets else []
        out += _rounds(bench)
        out += _step_path(bench)
        line = _host_line(bench)
        out += ["", line, ""] if line else [""]
    return out[:-1] if out and out[-1] == "" else out


def supervision(report: dict[str, Any]) -> list[str]:
    """Each kind of member SIGKILLed under load in a supervised fleet (`kill_and_recover`)."""
    sup = report.get("supervision")
    if not sup:
        return ["(this run of `make serve-check` measured no supervision)"]
    out = [f"Measured {sup['date']} on a {sup['cores']}-core host (`make serve-check`; load average "
           f"{' / '.join(str(x) for x in sup['load_avg_at_start'])} at the start; the fleet started in "
           f"{sup['start_s']:.0f} s).", "",
           "| SIGKILLed | requests | failed | failures sent at (s from the kill) | sent 10 s or more after: failed / "
           "sent | back (s) | full strength (s) | routed to (s) | left of the old session |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in sup["rows"]:
        at = "-" if r["first_error_sent_s"] is None else f"{r['first_error_sent_s']} .. {r['last_error_sent_s']}"
        out.append(f"| {r['member']} | {r['requests']} | {r['errors']} | {at} | {r['failed_10s_after_kill']} / "
                   f"{r['sent_10s_after_kill']} | {_num(r['back_after_s'])} | {_num(r['full_strength_after_s'])} | "
                   f"{_num(r['served_by_new_incarnation_after_s'])} | {len(r['old_session_left'])} processes |")
    return out


def scale(report: dict[str, Any]) -> list[str]:
    """What one rank holds as the fleet around it grows (docs/fleet-scale.json, `decode` and `prefill`)."""
    sc = report["fleet_scale"]
    out = [f"| remote engines (TP {sc['tp']}) | decode rank 0: fds | TCP | ZMQ sockets | RSS KiB | handshake ms "
           "| prefill rank 0: fds | TCP | ZMQ sockets | peers | RSS KiB |", "|" + "---:|" * 11]
    for d, p in zip(sc["decode"]["rows"], sc["prefill"]["rows"]):
        dc, pc = d["counts"], p["counts"]
        out.append(f"| {d['engines']} | {_num(dc['fds'])} | {_num(dc['tcp_established'])} | {_num(dc['eventfds'])} "
                   f"| {_num(dc['rss_kib'])} | {d['handshake_ms_median']:.0f} | {_num(pc['fds'])} "
                   f"| {_num(pc['tcp_established'])} | {_num(pc['eventfds'])} | {_num(p['transport_peers'])} "
                   f"| {_num(pc['rss_kib'])} |")
    return out


def scale_storm(report: dict[str, Any]) -> list[str]:
    """Every decode rank of the crowd at a restarted prefill engine at once (docs/fleet-scale.json, `prefill.storm`)."""
    st = report["fleet_scale"]["prefill"].get("storm")
    if not st:
        return ["(this run has no storm)"]
    return ["| decode ranks at once | handshake timeout | failed | connect median | connect max | all done |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {_num(st['decode_ranks'])} | {st['handshake_timeout_s']:.0f} s | {_num(st['failed'])} "
            f"| {st['connect_ms_median']:,.0f} ms | {st['connect_ms_max']:,.0f} ms | {st['all_done_s']:.1f} s |"]


def scale_pool(report: dict[str, Any]) -> list[str]:
    """Lookups against one master (docs/fleet-scale.json, `pool`)."""
    out = ["| clients | keys per call | calls/s | keys/s |", "|---:|---:|---:|---:|"]
    out += [f"| {r['clients']} | {_num(r['batch_keys'])} | {_num(r['calls_per_s'])} | {_num(r['keys_per_s'])} |"
            for r in report["fleet_scale"]["pool"]["rows"]]
    return out


def pool(report: dict[str, Any]) -> list[str]:
    """The pool part: store and load beside a copy, then instance B (another shape) after A on
    repeated prefixes, with and without the pool (`kvbridge.bench.pool`)."""
    p = report.get("pool")
    if not p:
        return ["(this run of `make serve-check` measured no pool)"]
    t, sv = p["transfer"], p["serve"]
    out = [f"Measured {p['date']} on a {p['cores']}-core host (`make serve-check`, docs/serve-check.json `pool`).", "",
           f"Transfer: {t['tokens']:,} tokens of `{t['spec']}` ({t['bytes'] / 2**20:.0f} MiB), stored by "
           f"{t['store_engine']}, loaded by {t['load_engine']}, median of {t['rounds']}: store "
           f"{t['store_gb_s']:.2f} GB/s ({t['store_vs_copy']:.3f} of a copy), load {t['load_gb_s']:.2f} GB/s "
           f"({t['load_vs_copy']:.3f} of a copy)"
           + (f", reload by the writer {t['reload_gb_s']:.2f} GB/s ({t['reload_vs_copy']:.3f} of a copy)"
              if "reload_gb_s" in t else "") + f", copy {t['copy_gb_s']:.1f} GB/s.", "",
           f"Serving (`{sv['model']}`; `vllm bench serve {' '.join(sv['workload'])}`, {sv['prompts']} prompts, "
           f"{sv['concurrency']} in flight, sent to A (TP 1, block 64), then to B (TP 2, block 32)"
           + (f"; each instance warmed up with {sv['warmup']} prompts of its own, A's figures the medians of "
              f"{sv['rounds']} rounds of new prompts, B given A's first round" if sv.get("rounds") else "")
           + ("; the setups' instances running side by side, their A instances taking turns within each round"
              if sv.get("side_by_side") else "") + "):", "",
           "| setup | A's TTFT p50 ms | A's ITL p50 ms | A's out tok/s | A against prefix cache only: TTFT p50 / "
           "ITL p50 / tok/s | B's TTFT p50 ms | B's TTFT p99 ms | B's out tok/s | failed | "
           "B's hits: local / external |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sv["rows"]:
        if "error" in r:
            out.append(f"| {r['setup']} | {r['error']} |" + " |" * 8)
            continue
        a, b, h = r["a"], r["b"], r["b_hit_rate"]
        hits = " / ".join("-" if h[k] is None else f"{h[k]:.0%}" for k in ("local", "external"))
        vs = r.get("a_vs_prefix_cache_only")
        against = " / ".join(f"{vs[k]:.2f}x" for k in ("median_ttft_ms", "median_itl_ms", "output_throughput")
                             if k in vs) if vs and r["setup"] != "prefix cache only" else "-"
        out.append(f"| {r['setup']} | {_num(a['median_ttft_ms'])} | {_num(a.get('median_itl_ms'))} | "
                   f"{_num(a.get('output_throughput'))} | {against} | {_num(b['median_ttft_ms'])} | "
                   f"{_num(b['p99_ttft_ms'])} | {_num(b['output_throughput'])} | {a['failed'] + b['failed']} | {hits} |")
    if any(r.get("a_vs_prefix_cache_only") for r in sv["rows"]):
        out += ["", "A against prefix cache only: A's figure with the setup over A's figure without the pool "
                "(TTFT and ITL: above 1 is slower; tok/s: above 1 is fewer tokens per second)."]
    return out


def pool_transfer(report: dict[str, Any]) -> list[str]:
    """The pool's host tier and Mooncake against a copy, and AES-GCM alone against a copy, in one
    run (docs/pool-transfer.json: `kvbridge bench --pool --json`)."""
    t = report["pool_transfer"]
    h, m = t["host_tier"], t["mooncake"]
    out = [f"Measured {t['date']} on a {t['cores']}-core host, one run of `{t['command']}` (docs/pool-transfer.json; "
           f"{h['model']}; stored by {h['store_engine']}, loaded by {h['load_engine']}; each side beside a `torch` "
           "copy of the same bytes in its own process, median of the rounds; sealing and checking included). The "
           "last column, of the same run, is AES-GCM alone (`cryptography`, the tier's own seal threads) over the "
           "same bytes in objects of the same size, memory to memory, against a copy: every store and every load "
           "makes one such pass, so it is the most of a copy either can reach on this host.", "",
           "| path | pool block | store GB/s | store vs copy | load GB/s | load vs copy | AES-GCM alone vs copy |",
           "|---|---|---|---|---|---|---|"]
    for r in h["rows"]:
        out.append(f"| host tier | {r['pool_block_tokens']:,} tokens ({r['seal_object_bytes'] // 1024} KiB objects) "
                   f"| {r['store_gb_s']:.2f} | {r['store_vs_copy']:.3f} | {r['load_gb_s']:.2f} | {r['load_vs_copy']:.3f} "
                   f"| {r['seal_only_vs_copy']:.3f} ({r['seal_threads']} threads) |")
    out.append(f"| Mooncake (TCP, another client) | {m['block_tokens']} tokens "
               f"| {m['store_gb_s']:.2f} | {m['store_vs_copy']:.3f} | {m['load_gb_s']:.2f} | {m['load_vs_copy']:.3f} | |")
    return out


def routing(report: dict[str, Any]) -> list[str]:
    """Routing policies side by side (docs/routing.json: `kvbridge bench --routing --json`)."""
    t = report["routing"]
    out = [f"Measured {t['date']} on a {t['cores']}-core host, one run of `kvbridge bench --routing` "
           f"(docs/routing.json): prefill {' and '.join(t['prefill'])}, decode {' '.join(t['decode'])}; each policy "
           f"its own fleet, in turn, the same prompts: {t['prompts']} shared-prefix prompts and a multi-turn chat per "
           f"round, {t['concurrency']} at once, {t['rounds']} rounds (medians over rounds). Prefix hits: the prefill "
           "instances' prefix-cache hits over queried tokens. Answers: equal to a plain instance's, same prompts, "
           "greedy.", "",
           "| workload | policy | prefix hits | TTFT p50 ms | TTFT p99 ms | output tok/s | failed | answers = plain |",
           "|---|---|---|---|---|---|---|---|"]
    for r in t["rows"]:
        if "error" in r:
            out.append(f"| {r['workload']} | {r['policy']} | error | | | | | |")
            continue
        out.append(f"| {r['workload']} | {r['policy']} | {100 * (r.get('hit_rate') or 0):.1f}% | "
                   f"{_num(r['median_ttft_ms'])} | {_num(r['p99_ttft_ms'])} | {_num(r['output_throughput'])} | "
                   f"{r['failed']} | {r['answers_equal']}/{r['answers']} |")
    return out


RENDER: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "faults_table": faults_table, "faults_summary": faults_summary, "rotation": rotation, "bench": bench_tables,
    "supervision": supervision, "scale": scale, "scale_storm": scale_storm, "scale_pool": scale_pool, "pool": pool,
    "pool_transfer": pool_transfer, "routing": routing}


def load_report(path: Path = JSON) -> dict[str, Any]:
    """The serve-check JSON at `path`, with the scale bench's (docs/fleet-scale.json) as `fleet_scale`."""
    report = json.loads(path.read_text())
    report["fleet_scale"] = json.loads(SCALE_JSON.read_text())
    report["pool_transfer"] = json.loads(TRANSFER_JSON.read_text())
    report["routing"] = json.loads(ROUTING_JSON.read_text()) if ROUTING_JSON.exists() else None
    return report


def render(text: str, report: dict[str, Any]) -> str:
    """`text` with every generated block rewritten from `report`."""
    return doc_blocks.render(text, BLOCK, RENDER, report)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=JSON)
    ap.add_argument("--check", action="store_true", help="exit 1 if a doc's generated block differs")
    args = ap.parse_args(argv)
    report = load_report(args.json)
    sources = {args.json.name: {k: v for k, v in report.items() if k not in ("fleet_scale", "pool_transfer",
                                                                              "routing")},
               SCALE_JSON.name: report["fleet_scale"], TRANSFER_JSON.name: report["pool_transfer"],
               ROUTING_JSON.name: report["routing"]}
    return doc_blocks.refresh(DOCS, BLOCK, RENDER, report, sources, args.check, "scripts/serve_tables.py")


if __name__ == "__main__":
    sys.exit(main())
