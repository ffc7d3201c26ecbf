"""NIXL transport: the NIXL Python package with its UCX backend.

One `nixl_agent` per transport. Regions are registered as DRAM (CPU tensors) or VRAM (CUDA
tensors, with their device ordinal); the metadata carries `get_agent_metadata()` taken when it
is exported, so register before exporting. `connect` is `add_remote_agent`. A batch of runs
becomes two Nx3 descriptor arrays (address, length, device) built with numpy and one
`initialize_xfer("READ"|"WRITE", ...)` + `transfer`, polled with `check_xfer_state`;
handles are released after completion or on abort (NIXL cancels what it can). Notifications
use NIXL's own: a direct transfer carries its notification (NIXL delivers it after the data),
`send_notification` is `send_notif`, and `notifications` drains `get_new_notifs`.

Runs go direct by default. The staging path of `agent.py` (windows of `slot_bytes` gathered
into a registered staging buffer, moved as `desc_bytes` descriptors, scattered on arrival) is
available with `stage_below`/`staging_bytes`; on loopback here it measured slower than direct
(see `__init__`). Staging is CPU-only; CUDA regions always go direct.

The package: `nixl-cu12` (module `nixl_cu12`) installs on CPU hosts next to CPU torch; the
`nixl` meta package (module `nixl`) requires both the cu12 and cu13 wheels. Either is used.
VRAM registration needs a GPU and is untested here.

**No progress thread by default.** NIXL's own progress thread takes the UCX worker's lock for
every round, and each post wakes it: a posting thread then spends a quarter of its time spinning
on that lock. Measured on a 2-core loopback host, 4096 descriptors of 16 KiB read with the
thread on took 11.9 us each, without it 6.3 us (and one contiguous 128 MiB read 45 ms against
25 ms, since NIXL's thread also spins a core). So agents are built without it
(`progress_thread=False`): posting and polling progress the engine themselves, and the service
thread progresses it every `service_period_ms` for what arrives unasked (connection wire-up,
notifications), keeping notifications it drains for `notifications`.

Every call into the agent is serialized by a lock: worker threads, the caller's thread
(`notifications`) and the service thread all use it.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from kvbridge.errors import InvalidRequest
from kvbridge.transport.agent import Agent, AgentMeta, RegionInfo, TransferFailed
from kvbridge.transport.base import Op

_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _no_rdma_devices() -> bool:
    try:
        return not os.listdir("/sys/class/infiniband")
    except OSError:
        return True


def import_nixl():
    """The NIXL API module (`nixl_agent`, `nixl_agent_config`); raises ImportError naming each attempt.

    On a host without RDMA devices, UCX's InfiniBand modules are not loaded (`UCX_MODULES=^ib`,
    unless the environment already sets UCX_MODULES): they pull the system's libibverbs and
    libnl next to the copies bundled in the wheel (present when libibverbs1 is installed, as
    Mooncake needs), and the bundled libnl-route's destructor then segfaults at process exit
    (`rtnl_tc_unregister` in `_dl_fini`), turning every clean exit into status 139.
    """
    if _no_rdma_devices():
        os.environ.setdefault("UCX_MODULES", "^ib")
    # NIXL's Python logger prints INFO lines to stdout, which would corrupt `--json` output;
    # keep its warnings and errors, on stderr (NIXL_LOG_LEVEL still overrides the level).
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    errors = []
    for mod in _MODULES:
        try:
            module = importlib.import_module(mod)
            for handler in logging.getLogger("nixl").handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                    handler.setStream(sys.stderr)
            return module
        except Exception as e:  # ImportError, or a broken native library
            errors.append(f"{mod}: {type(e).__name__}: {e}")
    raise ImportError("NIXL is not importable (pip install 'kvbridge[nixl]'): " + "; ".join(errors))


_CONFIG_LOCK = threading.Lock()


def _make_agent(api, name: str, config, progress_delay_us: int):
    """`nixl_agent(name, config)` with its progress thread pausing `progress_delay_us` between rounds.

    The Python `nixl_agent` hardcodes `pthrDelay = 0`: its progress thread spins and keeps one core
    busy per agent even when idle (measured: 0.9 core), which starves everything else on a small
    host. The binding's config field is honoured; only the wrapper does not expose it, so the
    config class is swapped, while this agent is built, for one whose `pthrDelay` has a floor.
    Transfers still progress whenever this transport polls them.
    """
    if progress_delay_us <= 0:
        return api.nixl_agent(name, config)
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):
        pthrDelay = property(lambda s: base.pthrDelay.__get__(s),
                             lambda s, v: base.pthrDelay.__set__(s, max(int(v), progress_delay_us)))

    with _CONFIG_LOCK:
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


class NixlTransport(Agent):
    """Transport over NIXL (see the module docstring)."""

    backend = "nixl"
    supports_staging = True
    attaches_notify = True
    desc_bytes = 1 << 20

    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",), num_threads: int = 0,
                 progress_thread: bool = False, progress_delay_us: int = 100, **kwargs: Any):
        api = import_nixl()
        self._api = api
        self._nlock = threading.Lock()
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends),
                                       num_threads=num_threads)
        self._agent = _make_agent(api, name, config, progress_delay_us)
        self.progress_thread = progress_thread
        if not progress_thread:
            # The service thread progresses the engine instead (connection wire-up, incoming
            # notifications); posting and polling progress it too.
            self.service_period_ms = 5
        if not self._agent.backends:
            raise InvalidRequest(f"NIXL agent {name!r}: none of the backends {list(backends)} is available "
                                 f"(plugins: {self._agent.get_plugin_list()})")
        self._reg: list[Any] = []
        self._held_notes: list[tuple[str, bytes]] = []  # taken by the service thread's progress
        self._remote_names: dict[str, str] = {}
        # Staging is off by default: on this project's loopback hosts UCX moves DRAM with one
        # kernel copy (CMA), so gathering and scattering (two more copies) lost to sending the
        # 16 KiB runs direct (bench: 0.86x). Turn it on (stage_below=256 << 10,
        # staging_bytes=64 << 20) where the wire, not memory, is the bottleneck.
        kwargs.setdefault("stage_below", 0)
        kwargs.setdefault("staging_bytes", 0)
        super().__init__(name, **kwargs)

    def _engine_register(self, info: RegionInfo) -> None:
        mem = "DRAM" if info.device < 0 else "VRAM"
        with self._nlock:
            descs = self._agent.get_reg_descs([(info.addr, info.nbytes, max(info.device, 0), "")], mem)
            self._agent.register_memory(descs)
        self._reg.append(descs)

    def _engine_metadata(self) -> bytes:
        with self._nlock:
            return bytes(self._agent.get_agent_metadata())

    def _engine_connect(self, peer: str, meta: AgentMeta) -> np.ndarray:
        with self._nlock:
            if peer in self._remote_names:
                self._agent.remove_remote_agent(self._remote_names.pop(peer))
            got = self._agent.add_remote_agent(meta.engine)
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != peer:
            raise InvalidRequest(f"{self.name}: NIXL metadata names agent {got!r}, expected {peer!r}")
        self._remote_names[peer] = got
        return np.array([r.addr for r in meta.regions], np.int64)

    def _engine_disconnect(self, peer: str) -> None:
        name = self._remote_names.pop(peer, None)
        if name is not None:
            with self._nlock:
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:
                    pass

    def _mem(self, infos: list[RegionInfo]) -> tuple[str, int]:
        devs = {r.device for r in infos}
        if len(devs) > 1 and any(d >= 0 for d in devs):
            raise InvalidRequest(f"{self.name}: regions mix CPU and CUDA memory; NIXL needs one memory type per side")
        dev = devs.pop() if devs else -1
        return ("DRAM", 0) if dev < 0 else ("VRAM", dev)

    def _engine_post(self, peer: str, op: Op, local: np.ndarray, remote: np.ndarray, length: np.ndarray,
                     notify: bytes | None) -> Any:
        lmem, ldev = self._mem(self._regions)
        rmem, rdev = self._mem(self._peers[peer].meta.regions)
        n = len(length)
        ld = np.empty((n, 3), np.uint64)
        ld[:, 0], ld[:, 1], ld[:, 2] = local, length, ldev
        rd = np.empty((n, 3), np.uint64)
        rd[:, 0], rd[:, 1], rd[:, 2] = remote, length, rdev
        with self._nlock:
            handle = self._agent.initialize_xfer("READ" if op == "read" else "WRITE",
                                                 self._agent.get_xfer_descs(ld, lmem),
                                                 self._agent.get_xfer_descs(rd, rmem),
                                                 self._remote_names[peer], notify or b"")
            try:
                state = self._agent.transfer(handle)
            except Exception as e:
                self._release_handle(handle)
                raise TransferFailed(f"NIXL transfer failed to start: {type(e).__name__}: {e}") from None
        if state == "ERR":
            with self._nlock:
                self._release_handle(handle)
            raise TransferFailed("NIXL transfer returned ERR when posted")
        return [handle, state == "DONE"]

    def _engine_check(self, token: Any) -> bool:
        handle, done = token
        if done:
            return True
        with self._nlock:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:
                raise TransferFailed(f"NIXL check_xfer_state failed: {type(e).__name__}: {e}") from None
        if state == "ERR":
            raise TransferFailed("NIXL reported the transfer failed (ERR)")
        token[1] = state == "DONE"
        return token[1]

    def _release_handle(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            pass

    def _engine_release(self, token: Any) -> None:
        handle = token[0]
        if handle is None:
            return
        with self._nlock:
            try:
                self._agent.release_xfer_handle(handle)
                token[0] = None
                return
            except Exception:
                pass  # not cancellable while in flight: wait for it to end, then release
        end = time.monotonic() + self.timeout_s
        while time.monotonic() < end:
            with self._nlock:
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception:
                    state = "ERR"
                if state != "PROC":
                    self._release_handle(handle)
                    token[0] = None
                    return
            time.sleep(0.001)

    def _engine_notify(self, peer: str, message: bytes) -> None:
        with self._nlock:
            try:
                self._agent.send_notif(self._remote_names[peer], message)
            except Exception as e:
                raise TransferFailed(f"NIXL send_notif to {peer!r} failed: {type(e).__name__}: {e}") from None

    def _engine_progress(self) -> None:
        if self.progress_thread or not self._nlock.acquire(blocking=False):
            return  # a thread inside the engine progresses it anyway
        try:
            if self._agent is not None:
                self._held_notes.extend(self._decode_notes(self._agent.get_new_notifs()))
        finally:
            self._nlock.release()

    def _engine_notifications(self) -> list[tuple[str, bytes]]:
        with self._nlock:  # the held ones first: they arrived earlier
            out = list(self._held_notes)
            self._held_notes.clear()
            out.extend(self._decode_notes(self._agent.get_new_notifs()))
        return out

    @staticmethod
    def _decode_notes(notes: dict) -> list[tuple[str, bytes]]:
        return [(k.decode() if isinstance(k, bytes) else str(k), bytes(m)) for k, msgs in notes.items() for m in msgs]

    def _engine_close(self) -> None:
        with self._nlock:
            for descs in self._reg:
                try:
                    self._agent.deregister_memory(descs)
                except Exception:
                    pass
            self._reg.clear()
        self._agent = None  # the agent is destroyed with its last reference
