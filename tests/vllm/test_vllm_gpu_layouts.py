"""kvbridge's `VllmGpuLayout` against vLLM 0.32's own KV cache layout code, element by element.

`vllm_gpu_layouts_probe.py` runs in .venv-vllm and reports, from vLLM's code, which GPU attention
backends import without CUDA and the layouts they declare, and for 5184 combos (blocks, block
size, KV heads, head size, dtype, layers, padded page, `KVCacheLayout`) plus 384 MLA combos
(latent 320/576, one replicated head) the byte strides of the
logical [L, B, H, N, C] cache (`compute_layout_strides`). Here every K and V element
(layer, block, token, head, dim) must sit at the same byte offset in kvbridge's addressing.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core.spec import DTYPE_SIZES, ModelSpec
from kvbridge.errors import InvalidRequest
from kvbridge.integrations.vllm.gpu_layouts import BACKEND_LAYOUTS, gpu_layout

pytestmark = pytest.mark.vllm
ELEMENTWISE_MAX = 1 << 16  # combos up to this many elements are compared element by element


@pytest.fixture(scope="module")
def probe(run_probe) -> dict:
    return run_probe("vllm_gpu_layouts_probe.py")


@pytest.mark.parametrize("backend", sorted(BACKEND_LAYOUTS))
def test_backend_declares_the_layouts_kvbridge_knows(probe, backend):
    assert probe["vllm_version"].startswith("0.32")
    got = probe["backends"][backend]
    if not got["imported"]:
        pytest.skip(f"vLLM backend {backend} does not import without CUDA here: {got['error']}")
    assert tuple(got["layouts"] or probe["default_preference"]) == BACKEND_LAYOUTS[backend]


def test_backends_not_checked_are_refused(probe):
    """Backends whose declared layouts cannot be read here are refused, not guessed."""
    for name in ("CUTLASS_MLA", "FLASHINFER_MLA"):
        assert name in probe["backends"]
        with pytest.raises(InvalidRequest, match="unknown vLLM GPU attention backend"):
            gpu_layout(name, 16, 4)


def _vllm_offsets(row: dict, strides, itemsize: int, idx) -> np.ndarray:
    sL, sB, sH, sN, _ = strides
    l, b, t, h, d, kv = idx
    return l * sL + b * sB + h * sH + t * sN + (kv * row["head_size"] + d) * itemsize  # C: K then V


def _kvbridge_offsets(addr, itemsize: int, idx) -> np.ndarray:
    l, b, t, h, d, kv = idx
    return (addr.base[l, kv] + b * addr.block_stride[l, kv] + t * addr.token_stride[l, kv]
            + (h - addr.first_head[l, kv]) * addr.head_stride[l, kv] + d * itemsize)


def test_every_element_at_vllms_byte_offset(probe):
    checked = elementwise = refused = mla_rows = 0
    for row in probe["rows"]:
        mla = row.get("mla", False)
        backend = ("TRITON_MLA" if mla else "FLEX_ATTENTION") if row["layout"] == "LBNHC" else (
            "FLASHMLA" if mla else "FLASH_ATTN")
        spec = ModelSpec.uniform(row["layers"], row["heads"], row["head_size"], row["dtype"],
                                 kinds=("mla",) if mla else None)
        itemsize = DTYPE_SIZES[spec.dtype]
        layout = gpu_layout(backend, row["block_size"], row["num_blocks"], row["dtype"], cache_layout=row["layout"],
                            page_size_padded=row["page_size_padded"])
        if isinstance(row["strides"], str):  # vLLM refuses a padded page in this layout: so must kvbridge
            with pytest.raises(InvalidRequest, match="padded page"):
                layout.addressing(spec, 0)
            refused += 1
            continue
        addr = layout.addressing(spec, 0)
        dims = (row["layers"], row["num_blocks"], row["block_size"], row["heads"], row["head_size"], 1 if mla else 2)
        mla_rows += mla
        if int(np.prod(dims)) <= ELEMENTWISE_MAX:
            idx = np.indices(dims).reshape(6, -1)
            elementwise += 1
        else:  # offsets are affine in the indices: every axis's first, second and last index
            idx = np.stack(np.meshgrid(*[np.unique([0, min(1, n - 1), n - 1]) for n in dims],
                                       indexing="ij")).reshape(6, -1)
        want = _vllm_offsets(row, row["strides"], itemsize, idx)
        np.testing.assert_array_equal(_kvbridge_offsets(addr, itemsize, idx), want, err_msg=str(row))
        assert want.max() + itemsize <= addr.region_nbytes[0], row
        checked += 1
    assert refused == 576 and mla_rows == 384 and checked == 5184 + 384 - 576 and elementwise > 1000, (
        checked, elementwise, refused, mla_rows)


def test_auto_cache_dtype_is_the_models():
    assert gpu_layout("FLASH_ATTN", 16, 4, "auto").kv_dtype is None


def test_refuses_unknown_backend_and_layout_in_one_line():
    with pytest.raises(InvalidRequest, match="unknown vLLM GPU attention backend 'NOPE'"):
        gpu_layout("NOPE", 16, 4)
    with pytest.raises(InvalidRequest, match="packs scales"):
        gpu_layout("FLASHMLA", 64, 4, "fp8_ds_mla")
    with pytest.raises(InvalidRequest, match="does not take KV cache layout LBHNC"):
        gpu_layout("FLEX_ATTENTION", 16, 4, cache_layout="LBHNC")
