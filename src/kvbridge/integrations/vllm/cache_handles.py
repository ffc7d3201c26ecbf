"""Handing the KV cache tensors vLLM registers to the sidecar process: one design for CPU and CUDA.

vLLM allocates its KV cache itself and hands the tensors to `register_kv_caches`; the connector
takes them where they are, with no allocator of its own. The transfer work runs in a sidecar
process (sidecar.py says why: a thread in the worker starves of the GIL), so the worker gives the
sidecar a *handle* to the memory behind each tensor, and the sidecar maps the same memory:

* CUDA: a CUDA IPC handle of the tensor's storage (torch's `_share_cuda_`, opened with
  `_new_shared_cuda`, as `torch.multiprocessing` does): no copy; the sidecar's NIXL or
  Mooncake agent registers that device memory as VRAM.
* CPU: an anonymous allocation cannot be mapped by another process, so the storage moves once,
  at registration, into a kvbridge shared-memory segment: its bytes are copied there (unless
  they are all zero, as a fresh cache is: a new segment reads as zeros) and the
  segment's mapping is swapped in as the storage's memory in place (`_swap_data_ptr_`), so every
  tensor and view vLLM made of it (the attention layers' kernel-block views included) reads and
  writes the segment from then on, and the original allocation is freed. The cache is empty at
  that moment; the cost is one copy of it (measured in docs/vllm.md). The segment is kvbridge's
  own, so the shm transport's peers may map it (they refuse any other file: docs/security.md).

The handles are typed msgspec structs: they cross the worker -> sidecar pipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import msgspec
import torch

from kvbridge.errors import IncompatibleEngines


class CpuSegment(msgspec.Struct, tag="cpu", frozen=True):
    """A kvbridge shared-memory segment (its /dev/shm path) of `nbytes`."""

    path: str
    nbytes: int


class CudaStorage(msgspec.Struct, tag="cuda", frozen=True):
    """torch's CUDA IPC description of one storage (the fields of `UntypedStorage._share_cuda_`)."""

    device: int
    handle: bytes
    nbytes: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


StorageHandle = Union[CpuSegment, CudaStorage]


class Region(msgspec.Struct, frozen=True, array_like=True):
    """One registered tensor's bytes: `nbytes` at `offset` of storage `storage`."""

    storage: int
    offset: int
    nbytes: int


def _blocks_apart(t: torch.Tensor) -> bool:
    """Contiguous blocks along dim 0 at a stride of at least a block (vLLM's padded pages:
    a Mamba state page, or an attention block of the hybrid allocator's unified page)."""
    return t.dim() > 0 and t[0].is_contiguous() and t.stride(0) >= t[0].numel()


def _footprint(t: torch.Tensor) -> int:
    """Bytes from the tensor's first byte to its last (its blocks and the pages between them)."""
    if t.numel() == 0:
        return 0
    return ((t.shape[0] - 1) * t.stride(0) + t[0].numel()) * t.element_size() if t.dim() else t.element_size()


def share_tensors(tensors: Sequence[torch.Tensor], prefix: str) -> tuple[list[StorageHandle], list[Region]]:
    """Handles of the storages behind `tensors` (contiguous, all on one device) and where each tensor lies.

    CPU storages that are not in a kvbridge segment yet move into one and the tensors are
    re-pointed in place (see the module docstring); the segments stay alive with this process.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise IncompatibleEngines(f"KV cache tensors on several devices: {sorted(map(str, devices))}")
    for t in tensors:
        if not (t.is_contiguous() or _blocks_apart(t)):
            raise IncompatibleEngines(f"a KV cache tensor {tuple(t.shape)} with strides {t.stride()} is neither "
                                      f"contiguous nor contiguous blocks a fixed stride apart")
    index: dict[int, int] = {}  # storage address -> its handle's index
    storages: list[torch.UntypedStorage] = []
    regions: list[Region] = []
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in index:
            index[s.data_ptr()] = len(storages)
            storages.append(s)
        regions.append(Region(index[s.data_ptr()], t.data_ptr() - s.data_ptr(), _footprint(t)))
    device = next(iter(devices))
    if device.type == "cuda":
        return [_cuda_handle(s, device.index or 0) for s in storages], regions
    if device.type != "cpu":
        raise IncompatibleEngines(f"KV cache on {device.type}: kvbridge's sidecar maps CPU and CUDA memory only")
    return [_cpu_segment(s, prefix) for s in storages], regions


def _cuda_handle(storage: torch.UntypedStorage, device: int) -> CudaStorage:
    (dev, handle, nbytes, offset, rc_handle, rc_offset, event, sync) = storage._share_cuda_()
    return CudaStorage(int(dev), bytes(handle), int(nbytes), int(offset), bytes(rc_handle), int(rc_offset),
                       bytes(event or b""), bool(sync))


def _cpu_segment(storage: torch.UntypedStorage, prefix: str) -> CpuSegment:
    """The kvbridge segment holding `storage`: itself if it is one, else a new segment the bytes are
    copied into, swapped in as the storage's memory in place (every tensor and view of it follows;
    the original allocation is freed)."""
    from kvbridge.transport.shm import new_segment, segment_at
    seg = segment_at(storage.data_ptr(), storage.nbytes())
    if seg is not None and seg.addr == storage.data_ptr():
        return CpuSegment(seg.path, seg.nbytes)
    seg = new_segment(storage.nbytes(), prefix)  # lives (and is unlinked at exit) with this process
    fresh = seg.view(0, seg.nbytes)  # a storage of its own over the segment's mapping
    old = torch.empty(0, dtype=torch.uint8).set_(storage)
    if bool(old.any()):  # a new segment reads as zeros: a fresh (zeroed) cache needs no copy, only a read
        fresh.copy_(old)
    storage._swap_data_ptr_(fresh.untyped_storage())
    del fresh  # now holds the original allocation
    if segment_at(storage.data_ptr(), storage.nbytes()) is not seg:  # pragma: no cover - torch changed
        raise IncompatibleEngines("could not move the KV cache storage into shared memory in place")
    return CpuSegment(seg.path, seg.nbytes)


def open_regions(handles: Sequence[StorageHandle], regions: Sequence[Region]) -> list[torch.Tensor]:
    """In the sidecar: each region as a flat uint8 tensor over the worker's own memory."""
    flats = [_open(h) for h in handles]
    out = []
    for r in regions:
        if not 0 <= r.storage < len(flats):
            raise IncompatibleEngines(f"region names storage {r.storage} of {len(flats)}")
        flat = flats[r.storage]
        if r.offset < 0 or r.nbytes < 0 or r.offset + r.nbytes > flat.numel():
            raise IncompatibleEngines(f"region [{r.offset}, {r.offset + r.nbytes}) outside the {flat.numel()}-byte "
                                      f"segment")
        out.append(flat[r.offset:r.offset + r.nbytes])
    return out


def _open(h: StorageHandle) -> torch.Tensor:
    if isinstance(h, CpuSegment):
        from kvbridge.transport.shm import adopt_segment
        return adopt_segment(h.path, h.nbytes).tensor
    storage = torch.UntypedStorage._new_shared_cuda(h.device, h.handle, h.nbytes, h.offset, h.ref_counter_handle,
                                                    h.ref_counter_offset, h.event_handle or None,
                                                    h.event_sync_required)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}").set_(storage)


__all__ = ["CpuSegment", "CudaStorage", "Region", "StorageHandle", "open_regions", "share_tensors"]
