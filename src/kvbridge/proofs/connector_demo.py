"""The multi-process proof: every prefill rank and every decode rank is its own process.

`run_multiprocess_demo` keeps `local_demo.run_demo`'s proof (`proof.prove_cache`) and changes
everything around it into what a deployment has:

1. The parent loads the model, runs each request's prefill once (the engine's forward pass)
   and writes the resulting KV cache into each prefill rank's paged layout (`hf_cache.export_cache`,
   one head shard per rank). Each prefill rank *process* owns its registered cache and
   receives its shard over a pipe, as a TP worker would compute it.
2. Each decode rank process handshakes with the prefill engine over the ZMQ side channel
   (one bootstrap address; rank 0 lists the others), then receives the request through the
   real transport: it reads from every source rank (pull) or the prefill ranks write into it
   (push). Each prefill rank releases each request exactly once.
3. Decode rank 0 gathers the other ranks' caches, rebuilds a transformers `DynamicCache`,
   compares it bit for bit with a monolithic forward and continues greedy decoding; the
   tokens must equal a monolithic `generate`.

The two-host form splits the same steps: `run_prefill_server(listen=...)` runs steps 1 and the
prefill half of 2 and returns when every request is released; `run_decode_client(prefill=...)`
runs the decode half of 2 and step 3. Both derive the prompts and request ids from the same
arguments (model, prompt, seed, number of requests), as a proxy would send both engines the
same prompt.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbridge.connector import processes as rp
from kvbridge.connector.config import ConnectorConfig
from kvbridge.connector.processes import process_context
from kvbridge.connector.rank_host import random_fill
from kvbridge.connector.side_channel import parse_address
from kvbridge.core.secrets import generate_secret
from kvbridge.errors import ConfigError, InvalidRequest
from kvbridge.core.layout import EngineLayout
from kvbridge.transport.cache import RankCache
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.spec import ModelSpec
from kvbridge.proofs.rank_engines import DecodeEngine, PrefillEngine
from kvbridge.proofs.results import DisaggregationResult
from kvbridge.proofs.workload import Workload, block_tables, sized_layout, workload

Mode = str  # "pull" | "push"

MODEL_PRELOAD = ("kvbridge.proofs.hf_cache", "kvbridge.proofs.decode_job")
"""What the fork server imports for a host whose rank 0 will run the model (transformers takes
seconds to import)."""


# -------------------------------------------------------------------------------------------------
# Results
# -------------------------------------------------------------------------------------------------
@dataclass
class MultiProcessDemoResult(DisaggregationResult):
    """Outcome of a multi-process run: a disaggregation proof of every request (`bytes_moved`: every
    request, every rank pair; `transfer_seconds`: the slowest request, first transfer posted -> last
    byte landed on one decode rank) plus the lifecycle's."""

    transport: str = "shm"
    mode: str = "pull"
    num_requests: int = 1
    requests_ok: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)  # per request: id, ok, reason, match ...
    bytes_measured: int = 0  # bytes the posting side reported (pull: decode ranks; push: prefill ranks)
    releases: dict[str, dict[str, int]] = field(default_factory=dict)  # prefill rank -> reason -> count
    released_exactly_once: bool = True
    processes: int = 0
    wall_seconds: float = 0.0
    receive_seconds: float = 0.0  # parent's view: requests started -> every decode rank reported

    @property
    def ok(self) -> bool:
        return super().ok and self.requests_ok == self.num_requests and self.released_exactly_once

    def describe(self) -> str:
        return (f"{self.model} prefill [{self.prefill}] -> decode [{self.decode}] over {self.transport} "
                f"({self.mode}), {self.processes} processes, {self.requests_ok}/{self.num_requests} requests; "
                f"{self.verdicts()}; {self.bytes_moved} B in {self.num_runs} runs (slowest transfer "
                f"{self.transfer_seconds * 1e3:.2f} ms)")


@dataclass
class PrefillServerResult:
    """What the prefill half of the two-host demo saw."""

    listen: str
    engine_id: str
    transport: str
    mode: str
    num_requests: int
    decode_engines: list[str]
    releases: dict[str, dict[str, int]]  # prefill rank -> reason -> count
    released_exactly_once: bool
    all_done: bool  # every release was a completion ("done ...")
    wall_seconds: float
    processes: int

    @property
    def ok(self) -> bool:
        return self.released_exactly_once and self.all_done

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# -------------------------------------------------------------------------------------------------
# Shared pieces
# -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Same thread count as the rank processes: float results are then bit-comparable."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def local_address_towards(address: str) -> str:
    """This host's address on the route to `address` (a UDP connect sends no packet)."""
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port or 9))
            return s.getsockname()[0]
        except OSError:
            return "::1" if family == socket.AF_INET6 else "127.0.0.1"


def _releases_summary(releases: dict[int, list[tuple[str, str]]], ids: list[str]) -> tuple[dict, bool, bool]:
    summary: dict[str, dict[str, int]] = {}
    once = True
    all_done = True
    for rank, events in sorted(releases.items()):
        per: dict[str, int] = {}
        seen: dict[str, int] = {}
        for rid, reason in events:
            key = reason.split(":")[0]
            per[key] = per.get(key, 0) + 1
            seen[rid] = seen.get(rid, 0) + 1
            all_done &= reason.startswith("done")
        once &= all(seen.get(rid, 0) == 1 for rid in ids) and set(seen) <= set(ids)
        summary[str(rank)] = per
    return summary, once, all_done


# -------------------------------------------------------------------------------------------------
# Prefill work in the parent
# -------------------------------------------------------------------------------------------------
@torch.inference_mode()
def _prefill(model_name: str, seed: int, work: Workload, layout: EngineLayout,
             tables: list[tuple[tuple[int, ...], ...]], fill_seed: int) -> tuple[list[int], list[list[np.ndarray]]]:
    """Run every request's prefill; returns first tokens and each prefill rank's region bytes."""
    from kvbridge.proofs.hf_cache import export_cache
    from kvbridge.proofs.tiny_models import load_model
    with _torch_threads(1):
        model, _ = load_model(model_name, seed)
        staging = RankCache.allocate_engine(work.spec, layout, fill=None)
        for r, c in enumerate(staging):
            random_fill([c], fill_seed + r)  # the same bytes the rank process starts with
        firsts = []
        for ids, table in zip(work.prompts, tables):
            input_ids = torch.tensor([ids], dtype=torch.long)
            out = model(input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True)
            firsts.append(int(out.logits[0, -1].argmax()))
            export_cache(out.past_key_values, work.spec, staging, table, len(ids))
    return firsts, [[r.numpy().copy() for r in c.byte_regions()] for c in staging]


def _plan_totals(spec: ModelSpec, prefill: EngineLayout, decode: EngineLayout, lengths: list[int],
                 src: list, dst: list) -> tuple[int, int, float, list[str]]:
    nbytes = nruns = 0
    seconds = 0.0
    warnings: list[str] = []
    for n, s, d in zip(lengths, src, dst):
        plan = plan_request(spec, prefill, decode, Request(s, d, n))
        nbytes += plan.nbytes
        nruns += len(plan)
        seconds += plan.stats.plan_seconds
        warnings = warnings or list(plan.stats.warnings)
    return nbytes, nruns, seconds, warnings


def _demo_result(work: Workload, prefill: EngineLayout, decode: EngineLayout, new_tokens: int, transport: str,
                 mode: Mode, results: dict[int, dict[str, dict[str, Any]]], decoded: dict[str, Any],
                 src_tables: list | None, dst_tables: list, firsts: list[int | None]) -> MultiProcessDemoResult:
    requests = []
    for i, rid in enumerate(work.ids):
        per_rank = [results[r].get(rid) for r in sorted(results)]
        ok = all(res is not None and res["ok"] for res in per_rank)
        reasons = sorted({f"decode rank {r}: {res['reason']}" if res else f"decode rank {r}: no result"
                          for r, res in zip(sorted(results), per_rank) if not (res and res["ok"])})
        d = decoded.get(rid, {})
        match = bool(d) and ok and d["tokens_reference"] == d["tokens_disaggregated"]
        requests.append({"id": rid, "ok": ok, "reason": "; ".join(reasons), "match": match,
                         "cache_equal": bool(d) and not d["cache_differences"],
                         "replicas_equal": bool(d) and not d["replica_mismatches"],
                         "first_token": firsts[i] if i < len(firsts) else None,
                         "transfer_seconds": max((res["transfer_seconds"] for res in per_rank if res), default=0.0),
                         "tokens_reference": d.get("tokens_reference", []),
                         "tokens_disaggregated": d.get("tokens_disaggregated", [])})
    head = decoded.get(work.ids[0], {})
    nbytes = nruns = 0
    plan_seconds = 0.0
    warnings: list[str] = []
    if src_tables is not None:
        nbytes, nruns, plan_seconds, warnings = _plan_totals(work.spec, prefill, decode, work.lengths, src_tables,
                                                             dst_tables)
    measured = sum(res["nbytes"] for rr in results.values() for res in rr.values())
    differences = [f"{r['id']}: {x}" for r in requests for x in decoded.get(r["id"], {}).get("cache_differences", [])]
    differences += [f"{r['id']}: {x}" for r in requests
                    for x in decoded.get(r["id"], {}).get("replica_mismatches", [])]
    return MultiProcessDemoResult(
        model=work.model, spec=work.spec.describe(), prefill=prefill.describe(), decode=decode.describe(),
        prompt_len=work.lengths[0], new_tokens=new_tokens,
        tokens_reference=head.get("tokens_reference", []), tokens_disaggregated=head.get("tokens_disaggregated", []),
        match=all(r["match"] for r in requests), cache_equal=all(r["cache_equal"] for r in requests),
        replicas_equal=all(r["replicas_equal"] for r in requests), bytes_moved=nbytes, num_runs=nruns,
        transfer_seconds=max((r["transfer_seconds"] for r in requests), default=0.0), plan_seconds=plan_seconds,
        cache_differences=differences[:50], warnings=warnings, transport=transport, mode=mode,
        num_requests=len(work.ids), requests_ok=sum(r["ok"] for r in requests), requests=requests,
        bytes_measured=measured)


def _decode_job(work: Workload, model: str, seed: int, new_tokens: int, dst_tables: list, firsts: list,
                ok_ids: set[str], dump: str | Path | None) -> dict[str, Any]:
    reqs = [{"id": rid, "prompt_ids": p, "block_ids": t, "first_token": f}
            for rid, p, t, f in zip(work.ids, work.prompts, dst_tables, firsts) if rid in ok_ids]
    return {"model": model, "seed": seed, "new_tokens": new_tokens, "requests": reqs,
            "dump": str(dump) if dump is not None and reqs and reqs[0]["id"] == work.ids[0] else None}


def _leases(work: Workload, tables: list, firsts: list[int | None]) -> list[rp.Lease]:
    return [rp.Lease(rid, t, n, f) for rid, t, n, f in zip(work.ids, tables, work.lengths, firsts)]


def _incoming(work: Workload, tables: list, config: ConnectorConfig) -> list[rp.Incoming]:
    return [rp.Incoming(rid, t, n, config.transfer_timeout) for rid, t, n in zip(work.ids, tables, work.lengths)]


def _ok_ids(results: dict[int, dict[str, dict[str, Any]]], ids: list[str]) -> set[str]:
    return {rid for rid in ids if all(rid in rr and rr[rid]["ok"] for rr in results.values())}


def _first_tokens(results: dict[int, dict[str, dict[str, Any]]], ids: list[str]) -> list[int | None]:
    out = []
    for rid in ids:
        firsts = {rr[rid]["first_token"] for rr in results.values() if rid in rr and rr[rid]["ok"]}
        firsts.discard(None)
        out.append(firsts.pop() if len(firsts) == 1 else None)
    return out


# -------------------------------------------------------------------------------------------------
# Entry points
# -------------------------------------------------------------------------------------------------
def _demo_config(config: ConnectorConfig | None, timeout: float, secret: bytes | str | None,
                 secret_file: str | Path | None, insecure: bool) -> ConnectorConfig:
    """The demo's connector config: `config` as given, or timeouts from `timeout` and the secret."""
    if config is not None:
        if secret is not None or secret_file is not None or insecure:
            raise InvalidRequest("give the secret in `config` or as secret/secret_file/insecure, not both")
        return config
    # Every deadline is `timeout` (the CLI's "deadline for every wait"): with the library's 5 s
    # handshake and 60 s transfer deadlines a starved host (CI) failed the demo's one request.
    # transport_notify=False, as the vLLM connector runs: completion goes over the side channel
    # only, after the decode rank counted its read done. With the transport's copy, the prefill
    # server could release on it, exit and close its side channel before the decode rank had
    # polled its own read as done, which then failed as "side channel lost" (CI, twice).
    return ConnectorConfig(transfer_timeout=timeout, lease_seconds=timeout, handshake_timeout=timeout,
                           transport_notify=False,
                           secret=secret.encode() if isinstance(secret, str) else secret,
                           secret_file=None if secret_file is None else str(secret_file), insecure=insecure)


def run_multiprocess_demo(transport: str = "shm", model: str = "tiny-llama", prompt: Sequence[int] | int | None = None,
                          new_tokens: int = 8, seed: int = 0, prefill: EngineLayout | None = None,
                          decode: EngineLayout | None = None, mode: Mode = "pull",
                          dump_decode_cache: str | Path | None = None, *, prompt_ids: Sequence[int] | None = None,
                          prompt_len: int | None = None, num_requests: int = 1, config: ConnectorConfig | None = None,
                          timeout: float = 120.0, secret: bytes | str | None = None,
                          insecure: bool = False) -> MultiProcessDemoResult:
    """Prefill on P rank processes, move the KV cache with `transport` to D decode rank processes,
    decode there; compare with monolithic `generate` (see the module docstring).

    `prompt` / `prompt_ids` / `prompt_len` as in `local_demo.run_demo` (request i > 0 draws its random
    prompt from `seed + i`). All `num_requests` requests are in flight at once. Every wait is
    bounded by `timeout` seconds; a rank process that fails raises `RankProcessError` with its
    traceback, while a request that fails is reported in the result (`requests`, `ok`). Both
    engines share `secret` (a fresh one per run when neither it, `config` nor `insecure` is given).
    """
    if mode not in ("pull", "push"):
        raise InvalidRequest(f"mode must be 'pull' or 'push', got {mode!r}")
    if new_tokens < 1:
        raise InvalidRequest(f"new_tokens must be >= 1, got {new_tokens}")
    t0 = time.monotonic()
    work = workload(model, prompt, prompt_ids, prompt_len, seed, num_requests)
    prefill = sized_layout(prefill, work.spec, work.lengths, 1, "prefill")
    decode = sized_layout(decode, work.spec, work.lengths, 2, "decode")
    if secret is None and not insecure:
        secret = generate_secret()  # both halves are ours: hand the per-run secret to each
    config = _demo_config(config, timeout, secret, None, insecure)
    _check_transport(transport)
    rng = random.Random(seed)
    src_tables = block_tables(work.spec, prefill, work.lengths, rng)
    dst_tables = block_tables(work.spec, decode, work.lengths, rng)
    ctx = process_context(MODEL_PRELOAD)
    pre: PrefillEngine | None = None
    dec: DecodeEngine | None = None
    try:
        life = 4 * timeout + 60  # rank processes end themselves even if this parent is stuck
        pre = PrefillEngine(ctx, transport, "prefill", work.spec, prefill, mode, "127.0.0.1:0", config,
                            max_lifetime=life)
        dec = DecodeEngine(ctx, transport, "decode", work.spec, decode, mode, "127.0.0.1", config, max_lifetime=life)
        firsts, shards = _prefill(model, seed, work, prefill, src_tables, fill_seed=1)
        address = pre.start(timeout)
        pre.load(shards, timeout)
        dec.start(timeout)
        dec.connect(address, config.handshake_timeout)
        dec.receive(_incoming(work, dst_tables, config), timeout)
        t_start = time.monotonic()
        pre.add(_leases(work, src_tables, firsts), timeout)
        dec.wait_results(work.ids, config.transfer_timeout + config.abort_timeout + 5)
        receive_seconds = time.monotonic() - t_start
        pre.wait_released(work.ids, config.lease_seconds + 5)
        ok_ids = _ok_ids(dec.results, work.ids)
        job = _decode_job(work, model, seed, new_tokens, dst_tables, _first_tokens(dec.results, work.ids), ok_ids,
                          dump_decode_cache)
        decoded = dec.decode(job, timeout) if ok_ids else {}
        results = dec.results
    finally:
        if dec is not None:
            dec.stop()
        stats = pre.stop() if pre is not None else {}
    result = _demo_result(work, prefill, decode, new_tokens, transport, mode, results, decoded, src_tables, dst_tables,
                          firsts)
    result.releases, result.released_exactly_once, _ = _releases_summary(pre.releases, work.ids)
    if mode == "push":
        result.bytes_measured = sum(s.get("bytes_written", 0) for s in stats.values())
    result.processes = prefill.world_size + decode.world_size
    result.receive_seconds = receive_seconds
    result.wall_seconds = time.monotonic() - t0
    return result


def run_prefill_server(listen: str = "127.0.0.1:5600", *, transport: str = "shm", model: str = "tiny-llama",
                       prompt: Sequence[int] | int | None = None, prompt_ids: Sequence[int] | None = None,
                       prompt_len: int | None = None, seed: int = 0, prefill: EngineLayout | None = None,
                       mode: Mode = "pull", num_requests: int = 1, config: ConnectorConfig | None = None,
                       timeout: float = 120.0, on_listening: Any = None, secret: bytes | str | None = None,
                       secret_file: str | Path | None = None, insecure: bool = False) -> PrefillServerResult:
    """The prefill half of the two-host demo: P rank processes, rank 0 listening on `listen`.

    Runs every request's prefill, leases the blocks, waits (at most `timeout` s) for a decode
    engine to connect, lets it receive every request, and returns once each rank released each
    request (or the leases expired). `on_listening(address)` is called once rank 0 listens.
    The decode side must use the same model, prompt arguments, seed and `num_requests`, and the
    same `secret` / `secret_file` content (or both `insecure=True`; one of the three is required).
    """
    if mode not in ("pull", "push"):
        raise InvalidRequest(f"mode must be 'pull' or 'push', got {mode!r}")
    t0 = time.monotonic()
    host, _ = parse_address(listen)
    if host in ("0.0.0.0", "::", "*"):
        raise InvalidRequest(f"listen on a concrete address (peers connect to what rank 0 advertises), got {listen!r}")
    work = workload(model, prompt, prompt_ids, prompt_len, seed, num_requests)
    prefill = sized_layout(prefill, work.spec, work.lengths, 1, "prefill")
    config = _demo_config(config, timeout, secret, secret_file, insecure)
    _check_transport(transport)
    src_tables = block_tables(work.spec, prefill, work.lengths, random.Random(seed))
    pre = PrefillEngine(process_context(), transport, "prefill", work.spec, prefill, mode, listen, config,
                        max_lifetime=4 * timeout + 60)
    try:
        firsts, shards = _prefill(model, seed, work, prefill, src_tables, fill_seed=1)
        address = pre.start(timeout)
        pre.load(shards, timeout)
        if on_listening is not None:
            on_listening(address)
        pre.wait_handshake(timeout)
        pre.add(_leases(work, src_tables, firsts), timeout)
        pre.wait_released(work.ids, config.lease_seconds + config.transfer_timeout + 5)
    finally:
        pre.stop()
    releases, once, all_done = _releases_summary(pre.releases, work.ids)
    return PrefillServerResult(listen=pre.address or listen, engine_id=pre.engine_id, transport=transport, mode=mode,
                               num_requests=num_requests, decode_engines=sorted(pre.decode_engines),
                               releases=releases, released_exactly_once=once, all_done=all_done,
                               wall_seconds=time.monotonic() - t0, processes=prefill.world_size)


def run_decode_client(prefill: str = "127.0.0.1:5600", *, transport: str = "shm", model: str = "tiny-llama",
                      prompt: Sequence[int] | int | None = None, prompt_ids: Sequence[int] | None = None,
                      prompt_len: int | None = None, new_tokens: int = 8, seed: int = 0,
                      decode: EngineLayout | None = None, mode: Mode = "pull", num_requests: int = 1,
                      dump_decode_cache: str | Path | None = None, config: ConnectorConfig | None = None,
                      host: str | None = None, timeout: float = 120.0, secret: bytes | str | None = None,
                      secret_file: str | Path | None = None, insecure: bool = False) -> MultiProcessDemoResult:
    """The decode half of the two-host demo: D rank processes that connect to `prefill`
    (host:port of the prefill server's rank 0), receive every request and prove it by decoding.

    `host` is this side's transport address (default: the local address on the route to the
    prefill host). The handshake waits up to `timeout` s for the server to come up. The secret
    arguments are those of `run_prefill_server`, and must match the server's.
    """
    if mode not in ("pull", "push"):
        raise InvalidRequest(f"mode must be 'pull' or 'push', got {mode!r}")
    t0 = time.monotonic()
    work = workload(model, prompt, prompt_ids, prompt_len, seed, num_requests)
    decode = sized_layout(decode, work.spec, work.lengths, 2, "decode")
    config = _demo_config(config, timeout, secret, secret_file, insecure)
    _check_transport(transport)
    dst_tables = block_tables(work.spec, decode, work.lengths, random.Random(seed + 7919))
    host = host or local_address_towards(prefill)
    dec = DecodeEngine(process_context(MODEL_PRELOAD), transport, "decode", work.spec, decode, mode, host, config,
                       max_lifetime=4 * timeout + 60)
    try:
        dec.start(timeout)
        dec.connect(prefill, timeout)
        t_start = time.monotonic()
        dec.receive(_incoming(work, dst_tables, config), timeout)
        dec.wait_results(work.ids, config.transfer_timeout + config.abort_timeout + 5)
        receive_seconds = time.monotonic() - t_start
        ok_ids = _ok_ids(dec.results, work.ids)
        firsts = _first_tokens(dec.results, work.ids)
        decoded = dec.decode(_decode_job(work, model, seed, new_tokens, dst_tables, firsts, ok_ids, dump_decode_cache),
                             timeout) if ok_ids else {}
    finally:
        dec.stop()
    remote = next(iter(dec.prefill_layouts.values()), None)
    result = _demo_result(work, decode, decode, new_tokens, transport, mode, dec.results, decoded, None, dst_tables,
                          firsts)
    result.prefill = remote.describe() if remote is not None else f"remote prefill engine at {prefill}"
    if remote is not None:  # what the plans move depends on the layouts and token counts, not on block ids
        src_tables = block_tables(work.spec, remote, work.lengths, random.Random(seed))
        result.bytes_moved, result.num_runs, result.plan_seconds, result.warnings = _plan_totals(
            work.spec, remote, decode, work.lengths, src_tables, dst_tables)
    result.processes = decode.world_size
    result.receive_seconds = receive_seconds
    result.wall_seconds = time.monotonic() - t0
    return result


def _check_transport(transport: str) -> None:
    from kvbridge.connector.transports import TRANSPORTS, unavailable_reason
    if transport not in TRANSPORTS:
        raise ConfigError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    why = unavailable_reason(transport)
    if why is not None:
        raise ConfigError(f"transport {transport!r} is not available here: {why}")


__all__ = ["DecodeEngine", "MultiProcessDemoResult", "PrefillEngine", "PrefillServerResult", "local_address_towards",
           "run_decode_client", "run_multiprocess_demo", "run_prefill_server"]
