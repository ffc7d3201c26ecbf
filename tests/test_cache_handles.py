"""Handing vLLM's registered KV cache tensors to the sidecar (integrations/vllm/cache_handles.py).

CPU: the storage moves into a kvbridge shared-memory segment in place, so every tensor and view
made before still aliases it, and a second mapping of the segment (what the sidecar makes) sees
the same bytes both ways. CUDA: IPC handles; that path needs a GPU and skips here, saying so.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvbridge.errors import IncompatibleEngines
from kvbridge.integrations.vllm.cache_handles import CpuSegment, Region, open_regions, share_tensors


def _vllm_like_cache(layers: int = 3, nbytes: int = 1 << 16, fill: bool = True):
    """One int8 buffer viewed per layer, plus other views made of it before registration (vLLM binds
    kernel-block views to its attention layers before `register_kv_caches`)."""
    raw = torch.zeros(layers * nbytes, dtype=torch.int8)
    per = [raw[i * nbytes:(i + 1) * nbytes].view(torch.float32).view(16, 2, 8, -1) for i in range(layers)]
    if fill:
        for i, t in enumerate(per):
            t.fill_(float(i + 1))
    other_views = [t[:, :, :4] for t in per]
    return raw, per, other_views


@pytest.mark.parametrize("fill", [True, False])
def test_cpu_storage_moves_in_place_and_every_view_follows(fill):
    raw, layers, views = _vllm_like_cache(fill=fill)
    handles, regions = share_tensors(layers, "test-handles")
    assert len(handles) == 1 and isinstance(handles[0], CpuSegment) and handles[0].path.startswith("/dev/shm/kvbridge-")
    assert [r.offset for r in regions] == [0, 1 << 16, 2 << 16] and all(r.nbytes == 1 << 16 for r in regions)
    assert all(float(t[0, 0, 0, 0]) == (i + 1 if fill else 0) for i, t in enumerate(layers))  # content kept
    sidecar = open_regions(handles, regions)  # a second mapping of the same segment
    sidecar[1].view(torch.float32)[3] = 42.0  # the sidecar writes: vLLM's tensors and views see it
    assert float(layers[1].flatten()[3]) == 42.0 and float(views[1].flatten()[3]) == 42.0
    assert float(raw.view(torch.float32)[(1 << 14) + 3]) == 42.0
    layers[2].fill_(-7.0)  # vLLM writes: the sidecar sees it
    assert torch.equal(sidecar[2].view(torch.float32), torch.full((1 << 14,), -7.0))


def test_a_second_registration_reuses_the_segment():
    _, layers, _ = _vllm_like_cache()
    first, _ = share_tensors(layers, "test-handles")
    again, _ = share_tensors(layers, "test-handles")
    assert first == again


def test_the_segment_maps_in_another_process():
    _, layers, _ = _vllm_like_cache()
    handles, regions = share_tensors(layers, "test-handles")
    code = ("import sys, torch, msgspec\n"
            "from kvbridge.integrations.vllm.cache_handles import CpuSegment, Region, open_regions\n"
            f"flat = open_regions([CpuSegment({handles[0].path!r}, {handles[0].nbytes})], [Region(0, 65536, 65536)])[0]\n"
            "print(float(flat.view(torch.float32)[0])); flat.view(torch.float32)[1] = 9.0\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0" and float(layers[1].flatten()[1]) == 9.0


def test_padded_pages_are_shared_from_first_block_to_last_state():
    """vLLM's hybrid allocator views a Mamba layer as `[blocks, ...]` with a block stride of the
    unified page, larger than the state: the region runs from the first page to the last state's end."""
    raw = torch.zeros(8 * 4096, dtype=torch.int8)
    state = raw.as_strided((8, 1, 1, 1000), (4096, 1000, 1000, 1), storage_offset=0)
    attention = raw.view(8, 4096)[:, :3072].view(8, 3, 1024)  # smaller blocks padded to the page
    handles, regions = share_tensors([state, attention], "test-handles")
    assert [(r.offset, r.nbytes) for r in regions] == [(0, 7 * 4096 + 1000), (0, 7 * 4096 + 3072)]
    state[7].fill_(5)
    assert int(open_regions(handles, regions)[0][7 * 4096 + 999]) == 5


def test_bad_inputs_are_refused():
    _, layers, _ = _vllm_like_cache()
    with pytest.raises(IncompatibleEngines, match="neither contiguous"):
        share_tensors([layers[0].transpose(0, 1)], "t")
    handles, regions = share_tensors(layers, "test-handles")
    with pytest.raises(IncompatibleEngines, match="outside"):
        open_regions(handles, [Region(0, handles[0].nbytes - 4, 8)])
    with pytest.raises(IncompatibleEngines, match="storage 1 of 1"):
        open_regions(handles, [Region(1, 0, 8)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC handles need a CUDA GPU; this host has none "
                    "(the CPU path above is what runs here)")
def test_cuda_storage_is_shared_by_ipc_handle():  # pragma: no cover - needs a GPU
    t = torch.arange(1 << 10, dtype=torch.float32, device="cuda")
    handles, regions = share_tensors([t[:512], t[512:]], "t")
    assert handles[0].__class__.__name__ == "CudaStorage" and regions[1].offset == 512 * 4
