"""`KVBridgeConnector`: kvbridge as a vLLM 0.32 V1 KV connector (prefill <-> decode).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.integrations.vllm",
                           "kv_role": "kv_producer",            # or kv_consumer / kv_both
                           "kv_connector_extra_config": {"side_channel_port": 5570}}'

The request flow is NixlConnector's (same `kv_transfer_params`, so a NIXL proxy drives it):

* prefill (P): the proxy sends the request with `{"do_remote_decode": true}` and max_tokens=1.
  When it finishes, `request_finished` keeps its blocks (returns True) and returns the params
  for the decode engine: P's engine id, request id, block ids, token count and side-channel
  address. The next engine step carries the request to every P worker, whose kvbridge
  `Producer` leases the blocks and announces them to the decode ranks that read them; the
  lease ends (`finished_sending`, vLLM frees the blocks) when all of them read it, or at lease
  expiry / abort.
* decode (D): the proxy sends the request with those params. `get_num_new_matched_tokens`
  claims the prompt's tokens as loaded asynchronously; `update_state_after_alloc` records D's
  block ids; every D worker's kvbridge `Consumer` handshakes with P (once per P engine), plans
  its reads with kvbridge's topology and planner (any TP pair kvbridge can shard, any block
  sizes on either side) and pulls them through the transport; `finished_recving` (plus
  `failed_recving` on failure) tells the scheduler. vLLM then recomputes the last prompt token
  and decodes.

Worker memory and the sidecar: vLLM allocates its KV cache itself, on CPU or CUDA; the
connector takes the tensors `register_kv_caches` hands it, with no allocator of its own. Each
worker rank starts a kvbridge *sidecar process* (`sidecar.py`) and hands it a handle to the
memory behind those tensors (`cache_handles.py`: a CUDA IPC handle on GPU; on CPU a kvbridge
shared-memory segment the empty cache moves into once, at registration, the tensors re-pointed
in place). The sidecar maps it, adopts every layer's bytes as a `RankCache` region (vLLM's own
cache, no copy; layout `layout.VllmCpuLayout`), and runs the rank's Producer/Consumer and
transport (`shm` by default; `nixl`/`mooncake` selectable; NIXL registers the regions as DRAM or
VRAM as they are). The worker only forwards commands and collects events over a pipe, never
blocking an engine step; the sidecar is not starved by the engine thread's GIL (measured: a
thread in the worker was, for 10 s).

Hybrid models (attention + Mamba-style state, e.g. Nemotron-H): the connector declares
`SupportsHMA`, so vLLM keeps its hybrid allocator (without it vLLM turns the allocator off and
cannot lay out a hybrid cache at all). Each vLLM KV-cache group is one kvbridge group with its own
block ids and block size; the geometry comes from the model's config through transformers
(`spec_from_hf_config`, the engine view), the conv state in vLLM's row order (`vllm_conv_rows`),
every layer on one unified, padded page, and each tensor vLLM registers is checked against it.
The prefill side holds back the last prompt token of a hybrid request (as vLLM's NixlConnector
does), so the decode side receives the state after N-1 tokens and computes the last one once.

Limits (each refused with a message, none silently wrong): no MLA (vLLM CPU's MLA cache is
described, `registration._mla_spec_and_layout`, and served by the pool connector, but no MLA
prefill/decode pair has been tested through vLLM), a hybrid grouping
other than one vLLM group per layer kind (start vLLM with `--disable-hybrid-kv-cache-manager`), no
prefix caching of recurrent state (`mamba_cache_mode` other than "none"), one decode engine per
prefill request (the proxy can name it with `"remote_decode_engine_id"` in the prefill params
when several decode engines are connected). Untested through vLLM, because vLLM CPU 0.32 does not
run them with a tiny float32 model: gated delta net (bfloat16 only there) and Mamba1 (no
selective scan in the CPU build); their state pages are checked against vLLM's shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults, SupportsHMA)
from vllm.logger import init_logger

from kvbridge.connector.once import OnceEach
from kvbridge.errors import ConfigError, IncompatibleEngines
from kvbridge.integrations.vllm.kv_identity import vllm_kv_identity
from kvbridge.integrations.vllm.cache_handles import share_tensors
from kvbridge.integrations.vllm.idle_wake import IdleWait
from kvbridge.integrations.vllm.registration import check_cpu_kv_layout, group_order, pd_window_note, spec_and_layout
from kvbridge.integrations.vllm.settings import Settings
from kvbridge.integrations.vllm.sidecar import SidecarClient
from kvbridge.integrations.vllm.sidecar_protocol import Abandon, Expect, Fatal, Init, Received, Recv, Released, Send
from kvbridge.integrations.vllm.step_profile import StepProfile

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # vLLM configures the "vllm" logger tree only

BlockIds = tuple[tuple[int, ...], ...]


# ------------------------------------------------------------------------------------------------
# Scheduler -> worker metadata
# ------------------------------------------------------------------------------------------------

@dataclass
class RecvReq:
    """Decode side: load `remote_request_id` of engine `remote_engine_id` into these blocks."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    remote_address: str
    block_ids: BlockIds
    num_tokens: int
    num_cached_tokens: int
    report: bool = True  # False: a full local prefix hit, only release the prefill blocks


@dataclass
class SendReq:
    """Prefill side: the request's KV is complete in these blocks; lease them to the reader."""

    request_id: str
    block_ids: BlockIds
    num_tokens: int
    to_engine: str | None = None


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    recv: list[RecvReq] = field(default_factory=list)
    send: list[SendReq] = field(default_factory=list)
    expect: list[tuple[str, str, str]] = field(default_factory=list)  # (remote engine, address, remote id)
    abandon: list[tuple[str, str, str]] = field(default_factory=list)


def _role_flags(vllm_config: VllmConfig) -> tuple[bool, bool]:
    role = vllm_config.kv_transfer_config.kv_role
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigError(f"KVBridgeConnector kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
    return role in ("kv_producer", "kv_both"), role in ("kv_consumer", "kv_both")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------------
# The connector
# ------------------------------------------------------------------------------------------------

class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbridge topology + planner + transport behind vLLM's KVConnectorBase_V1 (see module doc).

    `SupportsHMA`: the request's blocks come per KV-cache group (`request_finished_all_groups`),
    so hybrid models (attention + Mamba state) keep vLLM's hybrid allocator."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        self.settings = Settings.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.produces, self.consumes = _role_flags(vllm_config)
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            raise ConfigError("KVBridgeConnector in vLLM moves K/V attention caches; MLA is not supported yet")
        self.profile = StepProfile()  # KVBRIDGE_STEP_PROFILE=DIR: time the calls on a step's path (issue 31)
        self._scheduler = _Scheduler(self) if role == KVConnectorRole.SCHEDULER else None
        self._idle = IdleWait(self.engine_id) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _Worker(self) if role == KVConnectorRole.WORKER else None

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        tokens = scheduler_output.total_num_scheduled_tokens
        with self.profile.span("schedule") as span:
            if not tokens:
                # An idle step: the engine loops only because a transfer is pending (a request waits
                # for its KV, or finished blocks wait for their release). Pause it until a sidecar
                # reports a transfer's end, so that the loop does not take the CPU that the transfer
                # and the peer engine need (`idle_wake` says what a fixed 2 ms pace cost).
                self._idle.wait()
            meta = self._scheduler.build_connector_meta()
            span.note(tokens, len(scheduler_output.num_scheduled_tokens), len(meta.recv), len(meta.send))
        return meta

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, (tuple(block_ids),))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, tuple(tuple(g) for g in block_ids))

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVBridgeMetadata):
            with self.profile.span("start_load_kv") as span:
                self._worker.submit(meta)
                span.note(len(meta.recv), len(meta.send), len(meta.expect), len(meta.abandon))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole requests load asynchronously before they are scheduled; nothing per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """The decode side reads the prefill engine's own cache; nothing is saved per layer."""

    def wait_for_save(self):
        """CPU forward passes are synchronous: a finished request's KV is in its blocks."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending, res.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        with self.profile.span("get_finished") as span:
            res = self._worker.results()
            span.note(len(res.finished_recving), len(res.finished_sending))
        return res

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
        if self._idle is not None:
            self._idle.close()


# ------------------------------------------------------------------------------------------------
# Scheduler side
# ------------------------------------------------------------------------------------------------

class _Scheduler:
    def __init__(self, conn: KVBridgeConnector):
        cfg = conn._vllm_config
        self.conn = conn
        self.block_size = cfg.cache_config.block_size
        self.tp_size = cfg.parallel_config.tensor_parallel_size
        kvc = conn._kv_cache_config
        # vLLM's groups in kvbridge's order (by first layer) and their block sizes; recurrent state
        # (Mamba) needs h(N-1) on the decode side, which derives h(N) from the last prompt token.
        self.group_order, self.group_block_sizes = group_order(kvc, self.block_size)
        self.has_state = bool(getattr(kvc, "has_mamba_layers", False))
        s = conn.settings
        self.address = (s.side_channel_host, s.side_channel_port)
        self._meta = KVBridgeMetadata()

    @staticmethod
    def _remote_tokens(request: Request, params: dict[str, Any]) -> int:
        n = len(request.prompt_token_ids or [])
        remote = params.get("remote_num_tokens")
        return min(n, int(remote)) if remote else n

    @staticmethod
    def _complete(params: dict[str, Any]) -> bool:
        return bool(params.get("remote_block_ids")) and all(
            params.get(k) is not None for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port"))

    def on_new_request(self, request: Request) -> None:
        p = request.kv_transfer_params
        if self.has_state and self.conn.produces and p and p.get("do_remote_decode"):
            _hold_back_last_token(request)
        if self.conn.consumes and p and p.get("do_remote_prefill") and self._complete(p):
            # Heartbeat the prefill lease while the request waits in our queue.
            self._meta.expect.append((p["remote_engine_id"], _address(p), p["remote_request_id"]))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if self.conn.consumes and p and p.get("do_remote_prefill") and self._complete(p):
            count = self._remote_tokens(request, p) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        p = request.kv_transfer_params
        if not (self.conn.consumes and p and p.get("do_remote_prefill")):
            return
        p["do_remote_prefill"] = False  # one transfer per request (a second call follows the load)
        if not self._complete(p):
            logger.warning("KVBridgeConnector: request %s has incomplete kv_transfer_params %s; it is computed "
                           "locally", request.request_id, p)
            return
        n = self._remote_tokens(request, p)
        ids = self._ids(blocks.get_block_ids(), n)
        self._meta.recv.append(RecvReq(
            request.request_id, str(p["remote_request_id"]), str(p["remote_engine_id"]), _address(p), ids, n,
            num_cached_tokens=n - num_external_tokens, report=num_external_tokens > 0))

    def _ids(self, groups, n: int) -> BlockIds:
        """vLLM's per-group block ids of a request of `n` tokens, in kvbridge's group order."""
        groups = tuple(groups)
        if len(groups) != len(self.group_order):
            raise IncompatibleEngines(f"{len(groups)} block-id groups where the KV cache has {len(self.group_order)}")
        return tuple(tuple(int(b) for b in groups[g][: _cdiv(n, self.group_block_sizes[g])]) for g in self.group_order)

    def build_connector_meta(self) -> KVBridgeMetadata:
        meta, self._meta = self._meta, KVBridgeMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        p = request.kv_transfer_params
        if not p:
            return False, None
        if p.get("do_remote_prefill"):
            # Finished (aborted) before its blocks were allocated: tell the prefill side to release.
            p["do_remote_prefill"] = False
            if self.conn.consumes and self._complete(p):
                self._meta.abandon.append((p["remote_engine_id"], _address(p), p["remote_request_id"]))
            return False, None
        if not (self.conn.produces and p.get("do_remote_decode")):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted: nothing was announced, vLLM frees the blocks now
        n = int(request.num_computed_tokens)
        ids = self._ids(block_ids, n)
        if n <= 0 or not any(ids):
            return False, None
        self._meta.send.append(SendReq(request.request_id, ids, n, p.get("remote_decode_engine_id")))
        host, port = self.address
        return True, dict(
            do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[list(g) for g in ids],
            remote_engine_id=self.conn.engine_id, remote_request_id=request.request_id, remote_host=host,
            remote_port=port, remote_num_tokens=n, tp_size=self.tp_size, transfer_mode=self.conn.settings.mode,
            kv_connector="KVBridgeConnector")


def _hold_back_last_token(request: Request) -> None:
    """Prefill side of a model with recurrent state: compute all prompt tokens but the last, so
    that the state handed over is h(N-1) and the decode engine, which always computes the last
    prompt token itself, derives h(N) once (vLLM's NixlConnector does the same)."""
    p = request.kv_transfer_params
    if p.get("_kvbridge_held_back") or request.num_prompt_tokens < 2 or request.prompt_token_ids is None:
        return
    del request.prompt_token_ids[-1:]
    del request._all_token_ids[-1:]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    p["_kvbridge_held_back"] = True


def _address(params: dict[str, Any]) -> str:
    host = str(params["remote_host"])
    return f"[{host}]:{int(params['remote_port'])}" if ":" in host else f"{host}:{int(params['remote_port'])}"


# ------------------------------------------------------------------------------------------------
# Worker side
# ------------------------------------------------------------------------------------------------

class _Worker:
    """One engine rank: a thin handle on its kvbridge sidecar process (see sidecar.py)."""

    def __init__(self, conn: KVBridgeConnector):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        cfg = conn._vllm_config
        self.conn = conn
        self.settings = conn.settings
        self.tp_size = cfg.parallel_config.tensor_parallel_size
        self.rank = get_tensor_model_parallel_rank()
        self.sidecar: SidecarClient | None = None
        self._keep: list[torch.Tensor] = []
        self._res = KVConnectorTransferResults()
        self._recv_reported = OnceEach()  # a load's end is told to vLLM once (see `connector.once`)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        spec, layout, names = spec_and_layout(self.conn._vllm_config, self.conn._kv_cache_config, kv_caches,
                                              self.tp_size)
        name_of = dict(zip((i for i, layer in enumerate(spec.layers) if not layer.is_stateless), names))
        li = next((i for i in name_of if spec.layers[i].is_attention), None)
        isa = "none (no attention layers)" if li is None else check_cpu_kv_layout(
            kv_caches[name_of[li]].dtype, layout.group_kernel_size(spec.layer_group[li]), spec.layers[li].key_dim,
            self.conn._vllm_config.cache_config.cache_dtype)
        if self.rank == 0 and (note := pd_window_note(self.conn._kv_cache_config)):
            logger.info("KVBridgeConnector %s: %s", self.conn.engine_id, note)
        self._keep = [kv_caches[n] for n in names]
        t0 = time.perf_counter()
        storages, regions = share_tensors(self._keep, f"vllm-{self.conn.engine_id[:24]}-r{self.rank}")
        shared_s = time.perf_counter() - t0
        init = Init(self.conn.engine_id, self.rank, self.conn.produces, self.conn.consumes, spec,
                    layout.plain(), storages, regions, self.settings, vllm_kv_identity(self.conn._vllm_config))
        self.sidecar = SidecarClient(init)
        logger.info("KVBridgeConnector %s rank %d: %s%s; %s; %s (ISA %s) over %s (sidecar pid %d; cache of %d B "
                    "handed over in %.3f s%s)",
                    self.conn.engine_id, self.rank, "producer" if self.conn.produces else "",
                    "consumer" if self.conn.consumes else "", spec.describe(), layout.describe(), isa,
                    self.settings.transport, self.sidecar.ready.pid, sum(r.nbytes for r in regions), shared_s,
                    f", side channel {self.sidecar.ready.address}" if self.sidecar.ready.address else "")

    def submit(self, meta: KVBridgeMetadata) -> None:
        if self.sidecar is None:
            return
        cmds: list[Any] = [Send(r.request_id, r.block_ids, r.num_tokens, r.to_engine) for r in meta.send]
        cmds += [Expect(engine, address, rid) for engine, address, rid in meta.expect]
        cmds += [Abandon(engine, rid) for engine, _address, rid in meta.abandon]
        cmds += [Recv(r.request_id, r.remote_request_id, r.remote_engine_id, r.remote_address, r.block_ids,
                      r.num_tokens, r.num_cached_tokens, r.report) for r in meta.recv]
        self.sidecar.send_all(cmds)  # one write; never waits for the sidecar (issue 31)

    def results(self) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults()
        if self.sidecar is None:
            return res
        for ev in self.sidecar.events():
            if isinstance(ev, Released):
                res.finished_sending.add(ev.request_id)
            elif isinstance(ev, Received):
                if not self._recv_reported.first(ev.request_id):
                    logger.debug("KVBridgeConnector rank %d: %s's load was reported already", self.rank, ev.request_id)
                    continue
                res.finished_recving.add(ev.request_id)
                if not ev.ok:
                    res.failed_recving.add(ev.request_id)
            elif isinstance(ev, Fatal):
                logger.error("KVBridgeConnector rank %d: sidecar failed: %s", self.rank, ev.error)
        return res

    def close(self) -> None:
        if self.sidecar is not None:
            self.sidecar.close()


__all__ = ["KVBridgeConnector", "KVBridgeMetadata", "RecvReq", "SendReq", "Settings", "spec_and_layout"]
