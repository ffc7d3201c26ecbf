"""Which vLLM CPU attention kernels keep a block's bytes as kvbridge describes them, and what the
pool makes of the others (`registration.cpu_byte_order`, `PoolConfig.byte_order`).

vLLM 0.32 CPU picks its AMX kernel for bfloat16 in blocks of 32 or more on CPUs with AMX tiles;
that kernel packs K by pairs of dimensions per 16-token tile and V by pairs of tokens per
16-dimension tile, not K transposed and V by rows. Before `cpu_byte_order`, two pool instances of
different block sizes exchanged such blocks as if they were transposed K: tokens wrong, no seal
failure. Now such an engine's objects live in a namespace of its kernel, block and head size.
`vllm_cpu_order_probe.py` runs vLLM's own cache-write kernel in .venv-vllm; this checks its
answers, so a vLLM whose kernels change is caught here rather than by a wrong answer."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def probe(run_probe) -> dict:
    return run_probe("vllm_cpu_order_probe.py")


def test_every_kernel_that_is_not_described_gets_a_byte_order_of_its_own(probe):
    for k in probe["kernels"]:
        amx = probe["amx"] and k["dtype"] == "torch.bfloat16" and k["block"] % 32 == 0
        assert k["isa"] == "amx" if amx else k["isa"] != "amx", k
        assert k["ok"] == (not amx), k  # the vec kernels store K transposed and V by rows; AMX does not
    for key, order in probe["orders"].items():
        dtype, block = key.split()
        amx = probe["amx"] and dtype == "torch.bfloat16" and int(block) % 32 == 0
        # both groups (full and sliding) have one kernel: one order, named by block and head size
        assert order == (f"vllm-cpu amx block {block} head 64" if amx else ""), (key, order)


def test_an_fp8_cache_gets_an_order_of_its_own_instead_of_failing_the_start(probe):
    # kvbridge describes no fp8 CPU kernel's bytes: such instances share only among themselves
    assert probe["fp8"].startswith("vllm-cpu ") and "block 64 head 64" in probe["fp8"], probe["fp8"]


def test_the_pd_connector_says_in_one_line_that_it_moves_a_sliding_only_models_whole_prompt(probe):
    # it describes one SlidingWindowSpec group as full attention (issue 43, noted and left):
    # correct, more bytes than the window; said at start rather than left unsaid
    notes = probe["pd_notes"]
    assert notes["full"] == "" and notes["full and sliding"] == ""
    assert notes["every layer slides"].startswith("every layer slides (window 128 tokens): this connector moves "
                                                  "every prompt token's K/V"), notes
    assert "\n" not in notes["every layer slides"]


def test_only_a_sliding_group_is_described_as_sliding(probe):
    # a full group whose layers vLLM promoted from sliding (hybrid allocator off) keeps every block
    assert probe["windows"] == {"full": None, "promoted": None, "sliding": 128}
