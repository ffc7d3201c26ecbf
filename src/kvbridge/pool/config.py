"""What every engine sharing one pool agrees on (`PoolConfig`), and how its objects are cut from
staging and its jobs into chunks (`object_layout`, `job_chunks`): shared by the tier, the index and
the integrations, so none of them imports another for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from kvbridge.core.layout import EngineLayout
from kvbridge.core.spec import ModelSpec
from kvbridge.offload.errors import NotCanonicalizable, SpecMismatch
from kvbridge.offload.keys import OffloadKey
from kvbridge.offload.pool import CPUPool
from kvbridge.offload.spec import GPULoadStoreSpec, split_groups
from kvbridge.pool.host_tier import MAX_HOST_BYTES, MIN_HOST_BYTES
from kvbridge.pool.objects import ObjectLayout, pool_namespace

MAX_STAGING_BLOCKS = 1 << 16
MAX_BYTE_ORDER = 200


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every engine sharing one pool must agree on, and this engine's staging size.

    `block_tokens` is the pool's block (the key granularity): every engine's block size must
    divide it. `model_id` names the weights (see `pool_namespace`). `secret` keys the seals and
    the object names (`kvbridge.core.secrets` rules: at least 16 bytes); no secret is refused
    unless `insecure` says so by name (then seals are checksums and names are predictable).
    `byte_order` names an order of bytes inside an engine's blocks that its layout does not describe
    (vLLM CPU's AMX attention kernels, `integrations.vllm.registration.cpu_byte_order`): it joins the
    namespace, so such an engine shares objects only with engines of the same order, between which
    the copies are exact (the same misdescription both ways); empty for engines the layout describes.
    """

    model_id: str
    block_tokens: int
    staging_blocks: int = 32
    secret: bytes = b""
    insecure: bool = False
    byte_order: str = ""
    kv_identity: str = ""
    """The digest of what the engine's KV means beyond its geometry (`core.kv_identity`): part of the
    namespace, so engines whose weights, RoPE, overrides or dtypes differ share no object."""
    host_bytes: int = 0
    """Shared memory of this host's tier (`pool.host_arena`), split over the model's groups; 0: none,
    every object goes through the store. Every engine of the host maps the same arenas."""
    host_dir: str = ""
    """Where the host tier's arenas are (default: this user's private `/dev/shm/kvbridge-UID/pool`)."""

    def __post_init__(self) -> None:
        from kvbridge.core.secrets import check_secret
        from kvbridge.errors import ConfigError

        if self.secret:
            check_secret(self.secret, "the pool's secret")
            if self.insecure:
                raise ConfigError("the pool got a secret and insecure: true; drop one")
        elif not self.insecure:
            raise ConfigError("the pool needs a secret (at least 16 bytes, the same on every engine) to seal and name "
                              "its objects, or insecure: true to run with checksums and predictable names")
        if not 1 <= self.block_tokens <= 1 << 20:
            raise ConfigError(f"pool block_tokens must be in [1, 2^20], got {self.block_tokens}")
        if len(self.byte_order) > MAX_BYTE_ORDER or not self.byte_order.isascii() or not (
                self.byte_order.isprintable()):
            raise ConfigError(f"pool byte_order must be at most {MAX_BYTE_ORDER} printable ASCII characters, got "
                              f"{self.byte_order[:80]!r}")
        if len(self.kv_identity) > 128 or not self.kv_identity.isascii():
            raise ConfigError(f"pool kv_identity must be an ASCII digest of at most 128 characters, got "
                              f"{self.kv_identity[:80]!r}")
        if self.host_bytes and not MIN_HOST_BYTES <= self.host_bytes <= MAX_HOST_BYTES:
            raise ConfigError(f"pool host_bytes must be 0 (no host tier) or in [{MIN_HOST_BYTES}, {MAX_HOST_BYTES}], got "
                              f"{self.host_bytes}")
        if self.host_dir and (len(self.host_dir) > 1024 or not self.host_dir.startswith("/") or "\0" in self.host_dir):
            raise ConfigError(f"pool host_dir must be an absolute path of at most 1024 characters, got "
                              f"{self.host_dir[:80]!r}")
        if not 1 <= self.staging_blocks <= MAX_STAGING_BLOCKS:
            raise ConfigError(f"pool staging_blocks must be in [1, {MAX_STAGING_BLOCKS}], got {self.staging_blocks}")


StagingLayout = Callable[[int, int], EngineLayout]
"""(block tokens, slots) -> the layout objects are cut from; every engine of a pool must use the same."""


def object_layout(spec: ModelSpec, config: PoolConfig, slots: int = 1,
                  staging: StagingLayout | None = None) -> ObjectLayout:
    """Objects of `spec` cut from canonical staging (per head: each head's K then its V, so an
    object's bytes are one run, sealed and opened in place), or from `staging`'s layout when given.

    An integration whose layer classes keep a head's components apart in the canonical layout
    (vLLM CPU's K, one component per dimension: 34 runs per object) passes its own layout, in
    which a head's bytes are one run. The layout is part of the namespace: its objects differ."""
    if staging is None:  # a head's components back to back: an object is one run, sealed where it lies
        pool = CPUPool.canonical(spec, config.block_tokens, slots, pin_memory=False, kv_placement="per_head")
    else:
        pool = CPUPool.allocate(spec, staging(config.block_tokens, slots), "canonical", pin_memory=False)
        if pool.layout.tp_size != 1 or pool.layout.world_size != 1:
            raise NotCanonicalizable(f"a pool's staging layout must hold every head once (TP 1, no PP/CP), got "
                                     f"{pool.layout.describe()}")
    lay = pool.layout
    tag = f"{type(lay).__name__}/{lay.kv_order}/{lay.kv_placement}/{lay.layer_placement}/{lay.kernel_size}"
    if config.byte_order:
        tag += f"/order {config.byte_order}"
    namespace = pool_namespace(spec, config.model_id, config.block_tokens, tag, config.kv_identity)
    return ObjectLayout(spec, pool, namespace, config.secret)


def job_chunks(gpu: GPULoadStoreSpec, keys: Sequence[OffloadKey], layout: ObjectLayout, factor: int,
               capacity: int) -> list[tuple[GPULoadStoreSpec, list[OffloadKey]]]:
    """The job as chunks of at most `capacity` pool blocks, each inside one group.

    Key j of a group (skip s = first index mod factor) covers the group's device blocks
    `[max(0, j*factor - s), min(n, (j+1)*factor - s))`; a chunk that starts at key j0 > 0 starts on
    a pool-block boundary, so its own skip is 0. Key j of a recurrent group is its device block j
    (one checkpoint each).
    """
    groups = len(layout.group_objects)
    slices = split_groups(gpu, np.arange(len(keys), dtype=np.int64), factor, groups, layout.spec.recurrent_groups())
    out = []
    for s in slices:
        n = len(s.device_ids)
        per_key = 1 if s.state else factor  # a state group: one checkpoint block per key
        for j0 in range(0, len(s.cpu_ids), capacity):
            j1 = min(len(s.cpu_ids), j0 + capacity)
            p0, p1 = max(0, j0 * per_key - s.skip), min(n, j1 * per_key - s.skip)
            chunk_keys = [keys[int(c)] for c in s.cpu_ids[j0:j1]]
            for k in chunk_keys:
                if layout.group_of(k) != s.group:
                    raise SpecMismatch(f"offload key of group {layout.group_of(k)} where the job's group {s.group} "
                                       f"blocks are")
            sizes, first = [0] * groups, [0] * groups
            sizes[s.group], first[s.group] = p1 - p0, s.first_index + p0
            out.append((GPULoadStoreSpec(s.device_ids[p0:p1], sizes, first), chunk_keys))
    return out


__all__ = ["MAX_BYTE_ORDER", "MAX_STAGING_BLOCKS", "PoolConfig", "StagingLayout", "job_chunks", "object_layout"]
