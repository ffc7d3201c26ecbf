"""What a shared pool stores: one object per (block, layer, KV head), in kvbridge's canonical form.

An offloaded block of a KV-cache group (its `block_tokens` tokens, keyed by the chained hash of
the prefix and the group) is cut into objects by layer and head (of a recurrent group, the
state checkpoint at the block's end, by layer, state component and unit): object (block, layer l, head h)
holds head h of every component of layer l (K then V; MLA's latent alone), each as the
canonical pool lays it out (TP 1, head-major, K/V-first). Nothing in an object depends on the TP,
PP or block size of the engine that wrote it, so any engine can read it, and one engine rank
holds every byte of it: rank r *writes* the objects whose bytes the planner reads from r when it
fills a canonical copy (`source_slices`, so replicated heads are written once), and *reads* the
objects of the heads and layers it holds. No rank gathers another's bytes; no rank reads an
object it does not need.

Keys are `kvb2/<block name>/<layer>/<head>` (state: `<layer>/s<component>.<chunk>`). The block
name is a MAC, under the fleet's secret, of the namespace, the block's chained hash and its
group: fleets with different secrets never share (or collide on) a name, and nobody without the
secret can predict one, so nobody can squat a prefix before it is stored. The namespace digests
the format version, the model id the fleet agreed on (weights and revision), the spec fingerprint
(geometry and KV dtype), the layer classes and the canonical block shape, so engines that could
misread each other's bytes never share a key. Without a secret (`insecure`) names are plain digests: anyone can compute them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import source_slices
from kvbridge.core.spec import ModelSpec
from kvbridge.offload.errors import NotCanonicalizable
from kvbridge.offload.keys import OffloadKey, split_offload_key
from kvbridge.offload.pool import CPUPool
from kvbridge.pool.seal import mac_key

KEY_PREFIX = "kvb2"
FORMAT_VERSION = 5
"""Bumped whenever the bytes of an object or the key derivation change: older objects become misses."""
MAX_MODEL_ID = 256


STATE_SPLITS = 2**5 * 3 * 5 * 7
"""A state component of U units is cut into gcd(U, STATE_SPLITS) objects of whole units: every TP
size dividing both U and STATE_SPLITS (1-8, 10, 12, 14-16, 20, 21, 24, 28, 30, 32, ...) holds whole
objects (a rank writes and reads only its own), and a short conv of thousands of channels is tens of objects, not thousands. A TP
size beyond that (64 ranks over 128 channels) reads a neighbour's units too and cannot write alone:
`written_by` refuses it in one line."""


def state_chunk(units: int) -> int:
    """Units per object of a state component of `units` units."""
    return units // math.gcd(units, STATE_SPLITS)


class ObjectId(NamedTuple):
    """One object of an offloaded block: a layer and a (global) KV head of the block's group; of a
    recurrent layer, one chunk of units (`head`: its index, `state_chunk` units each) of one state
    component (`comp`)."""

    layer: int
    head: int
    comp: int = -1  # -1: every component of the head (attention)

    @property
    def suffix(self) -> str:
        return f"{self.layer}/{self.head}" if self.comp < 0 else f"{self.layer}/s{self.comp}.{self.head}"


def block_name(secret: bytes, namespace: str, block_key: OffloadKey) -> str:
    """The store name of one offloaded block (its objects add layer and head): see the module."""
    h = hashlib.blake2b(digest_size=20, key=mac_key(secret) if secret else b"", person=b"kvbridge-name")
    h.update(namespace.encode())
    h.update(bytes(block_key))
    return h.hexdigest()


def pool_namespace(spec: ModelSpec, model_id: str, block_tokens: int, layout_tag: str | int,
                   kv_identity: str = "") -> str:
    """The digest that keeps engines apart which must not read each other's objects.

    `model_id` names the weights (a path, a hub id with revision): two models of one geometry
    write different KV for the same tokens, and the geometry alone cannot tell them apart.
    `kv_identity` (`core.kv_identity`'s digest) says the rest: weights' digest, RoPE, overrides, dtypes.
    """
    if not isinstance(model_id, str) or not 0 < len(model_id) <= MAX_MODEL_ID:
        raise NotCanonicalizable(f"the pool's model id must be 1..{MAX_MODEL_ID} characters, got "
                                 f"{str(model_id)[:80]!r}")
    # The layer classes too: a subclass may address components differently (vLLM CPU's K rows)
    # under the same geometry fingerprint, and its canonical bytes then differ.
    classes = ",".join(sorted({type(layer).__name__ for layer in spec.layers}))
    payload = "\0".join((f"format {FORMAT_VERSION}", model_id, spec.fingerprint(), classes, str(block_tokens),
                         str(layout_tag), kv_identity))
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


class ObjectLayout:
    """Objects of one model in one canonical pool, and which of them one device rank writes and reads.

    A recurrent layer's objects are per state component, each a chunk of its units (`state_chunk`):
    a TP rank holds units of each component on their own (a Mamba2 conv's B and C by group, its x
    and SSM state by head), so only then does each object have one writer and each reader read only
    units it holds.
    A block's state objects hold the checkpoint at the block's end (`offload.spec`).

    Refused in one line (`NotCanonicalizable`): a context-
    parallel device (a block's tokens live on several ranks, so no rank could write an object
    alone), and whatever `CPUPool.factor_for` refuses (a device block size that does not divide
    the pool's block, another geometry).
    """

    def __init__(self, spec: ModelSpec, pool: CPUPool, namespace: str, secret: bytes = b""):
        if pool.format != "canonical":
            raise NotCanonicalizable(f"a shared pool stages blocks in the canonical format, got a {pool.format} pool")
        self.spec, self.pool, self.namespace, self._secret = spec, pool, namespace, secret
        self.addr = pool.caches[0].addr
        self.kernel_per_block = pool.layout.kernel_blocks_per_block
        self._nbytes: dict[ObjectId, int] = {}
        self.group_objects: list[list[ObjectId]] = []
        for g, layers in enumerate(spec.groups):
            objs = []
            for li in layers:
                layer = spec.layers[li]
                if layer.is_recurrent:
                    objs += [ObjectId(li, k, ci) for ci, c in enumerate(layer.state)
                             for k in range(c.heads // state_chunk(c.heads))]
                else:
                    objs += [ObjectId(li, h) for h in range(max((c.heads for c in layer.components), default=0))]
            self.group_objects.append(objs)
        a = self.addr
        for li in range(spec.num_layers):
            if spec.layers[li].is_recurrent:
                continue  # a state unit is one row of its slot
            for ci in range(int(a.num_components[li])):
                if int(a.token_stride[li, ci]) != int(a.row_bytes[li, ci]):
                    raise NotCanonicalizable(
                        f"staging layout {pool.layout.describe()} interleaves tokens of layer {li}'s component {ci} "
                        f"with other heads; pool objects need a head's tokens back to back (a head-major layout)")

    def check_device(self, device: EngineLayout) -> int:
        """Device blocks per pool block for `device`, or the one-line reason it cannot use this pool."""
        if device.cp_size > 1:
            raise NotCanonicalizable(
                f"device {device.describe()} is context-parallel: a block's tokens live on several ranks, and each "
                f"pool object must be written by one rank")
        return self.pool.factor_for(self.spec, device)

    # -- keys -----------------------------------------------------------------------------------------
    def key(self, block_key: OffloadKey, obj: ObjectId) -> str:
        return f"{KEY_PREFIX}/{block_name(self._secret, self.namespace, block_key)}/{obj.suffix}"

    def block(self, block_key: OffloadKey) -> str:
        """The block's name (40 hex digits), which its objects' keys extend."""
        return block_name(self._secret, self.namespace, block_key)

    def keys(self, block_key: OffloadKey, objs: Sequence[ObjectId] | None = None) -> list[str]:
        """Keys of `objs` (default: every object) of one offloaded block."""
        _, group = split_offload_key(block_key)
        name = block_name(self._secret, self.namespace, block_key)
        return [f"{KEY_PREFIX}/{name}/{o.suffix}" for o in (self.group_objects[group] if objs is None else objs)]

    def group_of(self, block_key: OffloadKey) -> int:
        _, group = split_offload_key(block_key)
        if not 0 <= group < len(self.group_objects):
            raise NotCanonicalizable(f"offload key names KV-cache group {group}; the model has "
                                     f"{len(self.group_objects)}")
        return group

    # -- bytes ----------------------------------------------------------------------------------------
    def pieces(self, slot: int, obj: ObjectId) -> list[tuple[int, int, int]]:
        """(region, byte offset, length) runs of `obj` in canonical slot `slot`, in object order."""
        a, out = self.addr, []
        li = obj.layer
        if obj.comp >= 0:  # a chunk of units of a state component: rows back to back in the slot's state
            ci = obj.comp
            n = state_chunk(int(a.heads[li, ci]))
            return [(int(a.region[li, ci]), int(a.base[li, ci]) + slot * int(a.block_stride[li, ci])
                     + obj.head * n * int(a.head_stride[li, ci]), n * int(a.row_bytes[li, ci]))]
        for ci in range(int(a.num_components[li])):
            if obj.head >= int(a.heads[li, ci]):
                continue
            row = int(a.row_bytes[li, ci])
            kernel_tokens = self.pool.layout.kernel_size
            for k in range(self.kernel_per_block):
                start = (int(a.base[li, ci]) + (slot * self.kernel_per_block + k) * int(a.block_stride[li, ci])
                         + obj.head * int(a.head_stride[li, ci]))
                out.append((int(a.region[li, ci]), start, kernel_tokens * row))
        return out

    def nbytes(self, obj: ObjectId) -> int:
        """Payload bytes of `obj` (asked per object of every call: kept once computed)."""
        known = self._nbytes.get(obj)
        if known is None:
            known = self._nbytes[obj] = sum(n for _, _, n in self.pieces(0, obj))
        return known

    # -- which rank writes and reads what -----------------------------------------------------------------
    def written_by(self, device: EngineLayout, rank: int) -> list[set[ObjectId]]:
        """Per group, the objects device rank `rank` writes: those whose bytes the planner takes from it."""
        self.check_device(device)
        owner: dict[ObjectId, set[int]] = {}
        for s in source_slices(self.spec, device, self.pool.layout, 0, 0):
            for h in range(s.start, s.stop):
                owner.setdefault(self._object(s.layer, h, s.comp), set()).add(s.src_rank)
        split = [o for o, ranks in owner.items() if len(ranks) > 1]
        if split and split[0].comp >= 0:
            o = split[0]
            raise NotCanonicalizable(
                f"device {device.describe()} splits layer {o.layer}'s state component {o.comp} inside one pool object "
                f"({state_chunk(self.spec.layers[o.layer].state[o.comp].heads)} units each, ranks "
                f"{sorted(owner[o])}); the pool serves TP sizes of whole objects")
        split = [o for o, ranks in owner.items() if len(ranks) > 1]
        if split:
            raise NotCanonicalizable(f"object {split[0]} would be written by device ranks {sorted(owner[split[0]])}; "
                                     f"each pool object needs one writer")
        return [{o for o in objs if owner.get(o) == {rank}} for objs in self.group_objects]

    def read_by(self, device: EngineLayout, rank: int) -> list[set[ObjectId]]:
        """Per group, the objects device rank `rank` reads: the heads of the layers it holds."""
        self.check_device(device)
        need = {self._object(s.layer, h, s.comp) for s in source_slices(self.spec, self.pool.layout, device, rank, 0)
                for h in range(s.start, s.stop)}
        return [{o for o in objs if o in need} for objs in self.group_objects]

    def _object(self, layer: int, head: int, comp: int) -> ObjectId:
        """The object holding unit `head` of component `comp` of `layer` (all of a head's K/V are one)."""
        lspec = self.spec.layers[layer]
        if not lspec.is_recurrent:
            return ObjectId(layer, head, -1)
        return ObjectId(layer, head // state_chunk(lspec.state[comp].heads), comp)


def object_sizes(layout: ObjectLayout, group: int) -> np.ndarray:
    return np.array([layout.nbytes(o) for o in layout.group_objects[group]], dtype=np.int64)


__all__ = ["FORMAT_VERSION", "KEY_PREFIX", "STATE_SPLITS", "ObjectId", "ObjectLayout", "block_name", "object_sizes",
           "pool_namespace", "state_chunk"]
