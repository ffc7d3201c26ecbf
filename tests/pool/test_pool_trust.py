"""What keeps a shared pool trustworthy without a store (issue 27 points 2-4): object names that
say nothing without the fleet's secret, one way to read secrets, a breaker that stops calling a
dead store, and a background thread that never touches device memory after its caller gave up."""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvbridge.core.spec import ModelSpec
from kvbridge.errors import ConfigError
from kvbridge.offload.keys import chained_block_hashes, group_keys
from kvbridge.pool.background import PoolThread
from kvbridge.pool.breaker import CLOSED, OPEN, PROBING, Breaker
from kvbridge.pool.tier import PoolConfig, object_layout

SPEC = ModelSpec.uniform(2, 4, 8, "bfloat16")
SECRET = b"fleet-secret-0123456789"


def _names(secret: bytes = SECRET, insecure: bool = False, model_id: str = "m") -> list[str]:
    cfg = PoolConfig(model_id=model_id, block_tokens=8, secret=secret, insecure=insecure)
    layout = object_layout(SPEC, cfg)
    return [n for k in group_keys(chained_block_hashes(list(range(32)), 8), 0) for n in layout.keys(k)]


def test_object_names_depend_on_the_secret_and_reveal_neither_tokens_nor_namespace():
    mine, theirs, again = _names(), _names(b"another-fleet-secret"), _names()
    assert mine == again  # a restarted fleet with the same secret finds its objects
    assert not set(mine) & set(theirs)  # fleets with different secrets never collide
    layout = object_layout(SPEC, PoolConfig(model_id="m", block_tokens=8, secret=SECRET))
    hashes = [h.hex() for h in chained_block_hashes(list(range(32)), 8)]
    for name in mine:
        assert name.startswith("kvb2/") and layout.namespace not in name
        assert not any(h[:16] in name for h in hashes)
    assert len(set(mine)) == len(mine)
    assert _names(model_id="other") != mine


def test_without_a_secret_names_are_plain_digests_and_that_must_be_asked_for():
    assert _names(b"", insecure=True) == _names(b"", insecure=True)
    with pytest.raises(ConfigError, match="needs a secret"):
        PoolConfig(model_id="m", block_tokens=8)
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        PoolConfig(model_id="m", block_tokens=8, secret=b"short")
    with pytest.raises(ConfigError, match="drop one"):
        PoolConfig(model_id="m", block_tokens=8, secret=SECRET, insecure=True)


def test_a_secret_longer_than_blake2b_keys_is_digested_not_cut():
    a, b = b"x" * 64 + b"tail-one", b"x" * 64 + b"tail-two"
    assert set(_names(a)).isdisjoint(_names(b))


def test_breaker_opens_on_failure_probes_after_backoff_and_doubles_it():
    now = [0.0]
    seen: list[tuple[str, str]] = []
    br = Breaker(1.0, 8.0, on_change=lambda s, why: seen.append((s, why)), clock=lambda: now[0])
    assert br.allow() and br.state == CLOSED
    br.failure("refused")
    assert br.state == OPEN and not br.allow()
    now[0] = 1.0
    assert br.allow() and br.state == PROBING and not br.allow()  # one probe at a time
    br.failure("still refused")
    assert br.backoff == 2.0 and not br.allow()
    for _ in range(5):
        now[0] = br.retry_at
        assert br.allow()
        br.failure("down")
    assert br.backoff == 8.0  # capped
    now[0] = br.retry_at
    assert br.allow()
    br.success()
    assert br.state == CLOSED and br.allow()
    assert seen == [(OPEN, "refused"), (CLOSED, "")]  # said once each way, not per failure


def test_a_probe_that_never_reports_is_replaced():
    now = [0.0]
    br = Breaker(1.0, 4.0, clock=lambda: now[0])
    br.failure("x")
    now[0] = 1.0
    assert br.allow() and not br.allow()
    now[0] = 6.0
    assert br.allow()


def test_an_abandoned_call_never_touches_the_device_after_abandon_returns():
    """The store answers only after the caller gave up: the copy into the device must not happen."""
    thread = PoolThread("test-pool")
    release = threading.Event()
    touched: list[str] = []

    def load(call, name):
        release.wait(10)  # a stopped master
        with call.device_access() as ok:
            if ok:
                touched.append(name)
        return name

    try:
        late = thread.submit(load, "late")
        assert not late.wait(0.05)
        late.abandon()
        release.set()
        assert late.wait(10) and touched == []
        ok = thread.submit(load, "in time")
        assert ok.wait(10) and ok.result == "in time" and touched == ["in time"]
    finally:
        thread.close()


def test_abandon_waits_for_a_device_copy_in_progress():
    thread = PoolThread("test-pool")
    inside, leave = threading.Event(), threading.Event()
    log: list[str] = []

    def store(call):
        with call.device_access() as ok:
            assert ok
            inside.set()
            leave.wait(10)
            log.append("copied")

    try:
        call = thread.submit(store)
        assert inside.wait(10)
        threading.Timer(0.2, leave.set).start()
        t0 = time.monotonic()
        call.abandon()
        log.append("abandoned")
        assert log == ["copied", "abandoned"] and time.monotonic() - t0 >= 0.1
    finally:
        thread.close()


def test_a_full_queue_refuses_instead_of_growing_and_errors_come_back():
    thread = PoolThread("test-pool", max_queue=2)
    gate = threading.Event()
    try:
        first = thread.submit(lambda call: gate.wait(10))
        time.sleep(0.05)
        queued = [thread.submit(lambda call: 1) for _ in range(2)]
        assert all(queued) and thread.submit(lambda call: 1) is None
        assert thread.busy_for() > 0
        gate.set()
        assert first.wait(10) and all(c.wait(10) for c in queued)
        boom = thread.submit(lambda call: 1 / 0)
        assert boom.wait(10) and isinstance(boom.error, ZeroDivisionError)
    finally:
        thread.close()


def test_a_store_thread_steps_aside_alone_and_only_from_itself():
    """The store thread lowers its own priority (the engine's other threads keep theirs), and a
    thread it starts afterwards inherits it (Linux: the nice value is per thread)."""
    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = PoolThread("test-pool-store")

    def step_aside(call):
        thread.lower_priority(5)
        seen = {}
        child = threading.Thread(target=lambda: seen.update(
            child=os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        child.start()
        child.join()
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), seen["child"]

    try:
        with pytest.raises(RuntimeError, match="from the pool thread itself"):
            thread.lower_priority(5)
        call = thread.submit(step_aside)
        assert call.wait(10) and call.error is None
        assert call.result == (min(19, me + 5), min(19, me + 5))
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == me
    finally:
        thread.close()


def test_pool_secret_files_follow_the_side_channel_rules(tmp_path):
    from kvbridge.core.secrets import read_secret_file

    good = tmp_path / "key"
    good.write_bytes(os.urandom(16).hex().encode())
    good.chmod(0o600)
    assert len(read_secret_file(good)) == 32
    link = tmp_path / "link"
    link.symlink_to(good)
    loose = tmp_path / "loose"
    loose.write_bytes(b"x" * 32)
    loose.chmod(0o644)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    empty.chmod(0o600)
    for path, why in ((link, "symlink"), (loose, "chmod 600"), (empty, "at least 16 bytes")):
        with pytest.raises(ConfigError, match=why):
            read_secret_file(path)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    addr, port = cols[1].split(":")
                    out.add((addr, int(port, 16)))
    return out


def test_the_master_listens_only_on_the_fleets_interface(tmp_path):
    """Mooncake binds every interface by default (its metadata server whatever it is told): the
    master kvbridge starts opens its RPC and metrics ports on the host it was given, and no other."""
    pytest.importorskip("mooncake.store", reason="the pool needs the Mooncake wheel (installed by `make test`)")
    from kvbridge.pool.master import MooncakeMaster

    with MooncakeMaster.start(tmp_path / "master.log") as master:
        end = time.monotonic() + 30  # the metrics server starts beside the RPC one, a little later
        while True:
            listening = _listening(master.proc.pid)
            if set(master.ports) <= {p for _, p in listening}:
                break
            assert time.monotonic() < end, listening
            time.sleep(0.1)
    loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
    assert {p for _, p in listening} == set(master.ports), listening
    assert all(a == loopback for a, _ in listening), listening


def test_a_multimodal_model_is_refused_in_one_line_and_a_text_model_is_not():
    """Stand-in configs: vLLM CPU here cannot even inspect a multimodal architecture (its image
    stack is not installed: `make vllm-env` removes torchvision), so the refusal reads the one flag
    vLLM sets, `model_config.is_multimodal_model`, from a stand-in."""
    from types import SimpleNamespace

    from kvbridge.errors import IncompatibleEngines
    from kvbridge.integrations.vllm.pool_identity import pool_model_id, refuse_unkeyable

    def config(mm: bool, revision: str | None = None):
        return SimpleNamespace(model_config=SimpleNamespace(is_multimodal_model=mm, model="/m", revision=revision))

    refuse_unkeyable(config(False))
    with pytest.raises(IncompatibleEngines, match="multimodal") as e:
        refuse_unkeyable(config(True))
    assert "\n" not in str(e.value)
    assert pool_model_id(config(False)) == "/m" and pool_model_id(config(False, "v2")) == "/m@v2"
    assert pool_model_id(config(False, "v2"), "fleet-model") == "fleet-model@v2"
