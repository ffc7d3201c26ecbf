"""Two `vllm serve` instances of different shapes (X: TP 1, block 64; Y: TP 2, block 32) on one
Mooncake Store pool, as a shared fleet uses it (issues 23 and 27). The key file, the master and X
are started from docs/pool.md's standalone example as written (the test adds its ports, eager
mode, LoRA adapters and shorter deadlines), so the docs stay true:

1. the master is down when they start: they serve, say once that the pool is unavailable, and
   use it once it is up (Y loads what X stored, as external hits, answering as X computed);
2. tenants (`cache_salt`) never hit each other's prefix and each hits its own; a request for its
   prompt's log-probs (vLLM reads no cache for it) is never looked up;
3. LoRA adapters never share KV with each other or with the base model, and each hits its own;
4. a master stopped for 60 s under load costs requests no more than the pool's deadlines;
5. a master SIGKILLed under load costs no request and no engine, and a new master is used.

X loads at the start of the step that computes the rest of the prompt (the default), Y through
vLLM's asynchronous path (`load_async`), so both paths meet every case.

The tests share the instances (a vLLM CPU start costs a minute or two) and run in file order.
Every reference answer is the answer of an instance that computed the prompt itself (the store
did not hold it): a plain instance's answer.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvbridge.integrations.vllm.fleet import FleetConfig, InstanceShape, healthy, vllm_serve_member
from kvbridge.integrations.vllm.fleet_processes import Member
from kvbridge.pool.master import MooncakeMaster, master_binary
from kvbridge.proofs.vllm.cluster import free_ports
from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama, make_tiny_lora
from kvbridge.testing.members import running
from kvbridge.testing.serving import Answer, metric_total, prompt_text, request, tokenize

pytestmark = pytest.mark.vllm
START_S = 900.0
OBJECTS_PER_BLOCK = 4  # the tiny llama: 2 layers x 2 KV heads
BLOCKS = 4  # a 300-token prompt holds four 64-token pool blocks
HITS = "vllm:external_prefix_cache_hits_total"
STALL_S = 60.0
DEADLINE_BOUND_S = 25.0  # a request during an outage: the pool's deadlines (1 s lookup, 5 s load) plus compute


@dataclass
class Pool:
    master: MooncakeMaster
    x: Member
    y: Member

    def keys(self) -> float:
        return metric_total(self.master.metrics_url, "master_key_count")

    def wait_keys(self, at_least: float, timeout: float = 300.0) -> None:
        """Until the store holds `at_least` objects (a finished request is stored on the rank's pool
        thread, after its reply)."""
        end = time.monotonic() + timeout
        while self.keys() < at_least:
            assert time.monotonic() < end, f"the store holds {self.keys()} objects, expected {at_least}"
            time.sleep(0.5)


DOC = Path(__file__).resolve().parents[2] / "docs" / "pool.md"
MARK = "<!-- the standalone example: tests/vllm/test_vllm_pool.py"
FAST = {"staging_blocks": 16, "lookup_timeout_ms": 1000, "load_timeout_ms": 5000, "store_timeout_ms": 5000,
        "release_ms": 5000, "max_backoff_s": 5}  # deadlines of minutes' worth of outage tests, not of production


def _kv(master: MooncakeMaster, secret_file: Path) -> dict:
    return {"kv_connector": "KVBridgePoolConnector", "kv_connector_module_path": "kvbridge.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
                "master": master.address, "secret_file": str(secret_file), "block_tokens": 64, "segment_mib": 32,
                **FAST}}


def _doc_example() -> tuple[str, list[str], list[str]]:
    """docs/pool.md's standalone example: the key line, the master's and the instance's words."""
    block = DOC.read_text().split(MARK, 1)[1].split("```", 2)[1]
    lines, acc = [], ""
    for raw in block.splitlines():
        text = raw.strip()
        if text.endswith("\\"):  # a continued line
            acc += text[:-1] + " "
            continue
        acc += text
        if acc.count("'") % 2:  # inside a quoted word (the JSON): its newline is a space
            acc += " "
            continue
        if acc:
            lines.append(acc)
        acc = ""
    key, master, serve = lines
    return key, shlex.split(master.rstrip("& ")), shlex.split(serve)


def _from_doc(work: Path, model: Path, vllm: str, port: int, lora: list[str]) -> tuple[MooncakeMaster, Member]:
    """The example's key file, master (not launched: the first test launches it) and instance X."""
    key, master_words, serve_words = _doc_example()
    subprocess.run(["bash", "-c", key], cwd=work, check=True)
    rpc = free_ports(2, {port})
    swap = {"50051": str(rpc), "50052": str(rpc + 1)}
    argv = [master_binary(), *(w.split("=", 1)[0] + "=" + swap.get(w.split("=", 1)[1], w.split("=", 1)[1])
                               for w in master_words[1:])]
    master = MooncakeMaster("127.0.0.1", rpc, rpc + 1, work / "master.log", argv)
    env_words = list(itertools.takewhile(lambda w: "=" in w and w[0].isupper(), serve_words))
    words = serve_words[len(env_words):]
    assert words[:3] == ["vllm", "serve", "MODEL_DIR"], words[:3]
    # the name requests give ("model": "model", as a kvbridge serve fleet's): without it, a 404
    assert words[words.index("--served-model-name") + 1] == "model", words
    kv = json.loads(words[words.index("--kv-transfer-config") + 1])
    extra = kv["kv_connector_extra_config"]
    assert extra["master"] == "127.0.0.1:50051" and kv["kv_load_failure_policy"] == "recompute"
    extra.update(master=master.address, **FAST)
    words[words.index("--kv-transfer-config") + 1] = json.dumps(kv)
    argv = [vllm, "serve", str(model), *words[3:], "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", *lora]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-x"), **dict(w.split("=", 1) for w in env_words)}
    return master, Member("pool-x", argv, env, work / "pool-x.log", port, InstanceShape(tp=1, block=64))


@pytest.fixture(scope="module")
def pool(vllm_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-pool")
    model = add_byte_tokenizer(make_tiny_llama(work / "tiny-llama", seed=5))
    adapters = {name: make_tiny_lora(model, work / f"lora-{name}", seed=seed) for name, seed in (("a", 1), ("b", 2))}
    vllm = str(vllm_env.python.parent / "vllm")
    port_x = free_ports(1)
    # vLLM CPU's LoRA ops index adapter slots with -1 for "no adapter", which picks the last slot:
    # one slot more than adapters keeps it empty, so base requests batched with LoRA ones stay exact.
    lora = ["--enable-lora", "--max-loras", str(len(adapters) + 1), "--max-lora-rank", "8", "--lora-modules",
            *(f"{n}={p}" for n, p in adapters.items())]
    master, x = _from_doc(work, model, vllm, port_x, lora)  # the master is down at start: the first test launches it
    config = FleetConfig(model=model, prefill=[], decode=[], log_dir=work)
    port_y = free_ports(1, {port_x, *master.ports})
    kv_y = _kv(master, work / "pool.key")
    kv_y["kv_connector_extra_config"]["load_async"] = True  # X loads at its step's start, Y through vLLM's async path
    y = vllm_serve_member(config, vllm, "pool-y", InstanceShape(tp=2, block=32), port_y, work, kv=kv_y)
    y.argv += lora
    try:
        with running([x, y], work, START_S):
            yield Pool(master, x, y)
    finally:
        master.stop()


def _ok(answer: Answer) -> Answer:
    assert answer.ok, answer.error
    return answer


def _shared_prefix_loads(pool: Pool, seed: int, timeout: float = 240.0, who: dict | None = None,
                         others: tuple[dict, ...] = ()) -> tuple[Answer, list[Answer]]:
    """X answers a fresh prompt for `who` (a tenant's salt, an adapter) and stores it; Y then serves
    each of `others` without an external hit (their KV is not `who`'s), and `who` from the pool as
    external hits, answering as X did. Retried with fresh prompts while either side's breaker is
    open (the master just came back, or a starved host timed out a 1 s lookup: a breaker probes on
    its own backoff, up to 5 s here): a miss meanwhile is computed, never wrong, and is no store.
    Returns X's answer and the answers to `others` of the round that loaded."""
    who = who or {}
    end = time.monotonic() + timeout
    while True:
        assert time.monotonic() < end, ("X and Y never shared a prefix through the pool: X's "
                                        f"{_pool_figures(pool.x)}; Y's {_pool_figures(pool.y)}")
        text = prompt_text(seed, 300)
        seed += 1000
        before = pool.keys()
        reference = _ok(request(pool.x.url, text, 8, **who))
        try:
            pool.wait_keys(before + BLOCKS * OBJECTS_PER_BLOCK, timeout=15)
        except AssertionError:
            continue
        hits = metric_total(pool.y.url, HITS)
        answers = [_ok(request(pool.y.url, text, 8, **o)) for o in others]
        assert metric_total(pool.y.url, HITS) == hits, f"Y served {others} the prefix X stored for {who}"
        got = _ok(request(pool.y.url, text, 8, **who))
        assert got.token_ids == reference.token_ids
        if metric_total(pool.y.url, HITS) - hits >= BLOCKS * 64:
            return reference, answers
        time.sleep(1.0)


def _pool_figures(m: Member) -> str:
    names = ("stores", "stores_dropped", "timeouts", "lookup_timeouts", "breaker_opened", "breaker_closed")
    return ", ".join(f"{n} {metric_total(m.url, f'vllm:kvbridge_pool_{n}_total'):.0f}" for n in names)


def test_instances_serve_with_the_master_down_and_use_the_pool_once_it_is_up(pool):
    # Stays in CI: the module's instances start with the master down and this test launches it
    # (marked fleet once, the module's other tests found no master).
    for m in (pool.x, pool.y):
        _ok(request(m.url, prompt_text(10, 300), 8))
    for m, sides in ((pool.x, 2), (pool.y, 3)):  # the scheduler and each rank say it once, at most
        said = m.log_path.read_text(errors="replace").count("is unavailable")
        assert 1 <= said <= sides, m.log_tail(30)
    pool.master.launch()
    _shared_prefix_loads(pool, seed=11)
    # A prompt nobody stored: no external hit on Y, and Y computing it agrees with X.
    hits = metric_total(pool.y.url, HITS)
    fresh = prompt_text(12, 200)
    assert request(pool.y.url, fresh, 8).token_ids == request(pool.x.url, fresh, 8).token_ids
    assert metric_total(pool.y.url, HITS) == hits
    # The pool's own figures are in each instance's /metrics (vLLM's connector-stats path).
    pool_metric = lambda m, name: metric_total(m.url, f"vllm:kvbridge_pool_{name}_total")  # noqa: E731
    assert pool_metric(pool.x, "objects_put") >= BLOCKS * OBJECTS_PER_BLOCK and pool_metric(pool.x, "bytes_put") > 0
    assert pool_metric(pool.y, "hit_tokens") >= BLOCKS * 64 and pool_metric(pool.y, "loads") >= 1
    assert pool_metric(pool.y, "objects_got") >= BLOCKS * OBJECTS_PER_BLOCK and pool_metric(pool.y, "lookups") >= 2
    for m in (pool.x, pool.y):  # down at start, then back: each side that noticed counts it both ways
        assert pool_metric(m, "breaker_opened") >= 1 and pool_metric(m, "breaker_closed") >= 1
        assert pool_metric(m, "seal_failures") == 0


def test_tenants_never_share_a_prefix_and_each_hits_its_own(pool):
    salted = {t: {"extra": {"cache_salt": f"tenant-{t}"}} for t in "ab"}
    _shared_prefix_loads(pool, seed=20, who=salted["a"], others=(salted["b"], {}))  # no salt is a tenant too


def test_a_request_for_its_prompts_log_probs_is_never_looked_up(pool):
    """vLLM reads no prefix cache for a request that asks for its prompt's log-probs (each prompt
    token's must be computed) and drops any external hit for it: the pool must not spend a lookup
    on it or count a hit it will not load."""
    counted = lambda: {n: metric_total(pool.y.url, f"vllm:kvbridge_pool_{n}_total")  # noqa: E731
                       for n in ("lookups", "lookups_skipped", "hit_tokens")}  # the scheduler's own counts
    text = prompt_text(15, 300)
    before = pool.keys()
    _ok(request(pool.x.url, text, 8))  # in the pool (or not, if X's breaker is open: no lookup either way)
    try:
        pool.wait_keys(before + BLOCKS * OBJECTS_PER_BLOCK, timeout=30)
    except AssertionError:
        pass
    figures = counted()
    got = _ok(request(pool.y.url, text, 8, extra={"prompt_logprobs": 1}))
    assert counted() == figures
    assert got.token_ids == _ok(request(pool.x.url, text, 8)).token_ids


def test_lora_adapters_never_share_kv_with_each_other_or_the_base_model(pool):
    reference, (other, base) = _shared_prefix_loads(pool, seed=30, who={"model": "a"}, others=({"model": "b"}, {}))
    assert other.token_ids != reference.token_ids and base.token_ids != reference.token_ids  # the adapters matter


def test_a_long_decode_is_stored_as_its_blocks_fill_and_continued_elsewhere(pool):
    """X stores a request's pool blocks while it decodes (not only when it finishes): its scheduler
    queues more of them while the request runs than the prompt fills. That is X's scheduler's own
    count, so a store thread starved by the host (stores run at low priority and may land after the
    reply) cannot fail it. The blocks must then land, and Y, of another shape, continues from
    prompt + reply by loading them and answers as X does. An attempt during which X's breaker
    opened (a starved host timed out a store: stores are dropped then, by design) is retried with a
    fresh prompt; any other attempt counts."""
    queued = lambda: metric_total(pool.x.url, "vllm:kvbridge_pool_running_blocks_queued_total")  # noqa: E731
    breaker = lambda: metric_total(pool.x.url, "vllm:kvbridge_pool_breaker_opened_total")  # noqa: E731
    for attempt in range(3):
        text = prompt_text(60 + attempt, 70)  # one full pool block of prompt; the reply fills 13 more
        before, was_queued, opened = pool.keys(), queued(), breaker()
        answer = _ok(request(pool.x.url, text, 900, timeout=600))
        deadline = time.monotonic() + 60  # a step's counts reach /metrics with the outputs after it
        while queued() - was_queued < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        if queued() - was_queued < 4 and breaker() != opened and attempt < 2:
            continue  # the scheduler's breaker opened (a late lookup): it queues no stores meanwhile
        assert queued() - was_queued >= 4, (
            f"while X decoded 900 tokens it queued only {queued() - was_queued:.0f} pool blocks of the running "
            f"request: its blocks were not stored as they filled ({_pool_figures(pool.x)})")
        try:
            pool.wait_keys(before + 8 * OBJECTS_PER_BLOCK)
            break
        except AssertionError:
            if attempt == 2 or breaker() == opened:
                raise
    prompt = tokenize(pool.x.url, text) + answer.token_ids[:500]  # eight full pool blocks and more
    reference = _ok(request(pool.x.url, prompt, 8))
    hits = metric_total(pool.y.url, HITS)
    got = _ok(request(pool.y.url, prompt, 8))
    assert got.token_ids == reference.token_ids
    assert metric_total(pool.y.url, HITS) - hits >= 8 * 64, (
        f"Y loaded too little of X's decode ({_pool_figures(pool.y)})")


def _load(pool: Pool, seconds: float, seed: int) -> list[tuple[float, Answer]]:
    """Requests of fresh prompts to X and Y, two at a time, for `seconds`: (latency, answer) each."""
    out: list[tuple[float, Answer]] = []
    lock = threading.Lock()

    def one(url: str, s: int) -> None:
        t0 = time.monotonic()
        a = request(url, prompt_text(s, 300), 4, timeout=120)
        with lock:
            out.append((time.monotonic() - t0, a))

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        threads = [threading.Thread(target=one, args=(m.url, seed + i)) for i, m in enumerate((pool.x, pool.y))]
        seed += 2
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return out


@pytest.mark.fleet  # a minute of outage under load: `make fleet-tests`; CI keeps the killed master below
def test_a_master_stopped_for_a_minute_costs_requests_only_the_deadlines(pool):
    os.kill(pool.master.proc.pid, signal.SIGSTOP)
    try:
        answers = _load(pool, STALL_S, seed=40_000)
    finally:
        os.kill(pool.master.proc.pid, signal.SIGCONT)
    assert answers and all(a.ok for _, a in answers), [a.error for _, a in answers if not a.ok][:3]
    slowest = max(t for t, _ in answers)
    assert slowest < DEADLINE_BOUND_S, f"a request took {slowest:.1f} s while the master was stopped {STALL_S:.0f} s"
    gave_up = sum(metric_total(m.url, f"vllm:kvbridge_pool_{n}_total") for m in (pool.x, pool.y)
                  for n in ("lookup_timeouts", "timeouts", "lookups_skipped"))
    assert gave_up >= 1, "the outage left no trace in the pool's metrics"
    assert healthy(pool.x.url) and healthy(pool.y.url)
    _shared_prefix_loads(pool, seed=41)  # and the pool serves again once the master runs


def test_a_master_killed_under_load_costs_no_request_and_a_new_one_is_used(pool):
    killer = threading.Timer(3.0, pool.master.stop, kwargs={"kill": True})
    killer.start()
    answers = _load(pool, 15.0, seed=50_000)
    killer.join()
    assert not pool.master.alive()
    assert answers and all(a.ok for _, a in answers), [a.error for _, a in answers if not a.ok][:3]
    assert pool.x.proc.poll() is None and pool.y.proc.poll() is None and healthy(pool.x.url) and healthy(pool.y.url)
    pool.master.launch()  # a new, empty master on the same ports: the instances find it by themselves
    _shared_prefix_loads(pool, seed=51)
