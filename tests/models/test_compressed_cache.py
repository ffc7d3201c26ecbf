"""DeepSeek-V4's compressed attention caches: rows per several tokens in the planner, the spec
transformers' cache layers give, and the proof (every compressed tensor and greedy tokens)."""

from __future__ import annotations

import copy
import hashlib
import random
import tempfile

import msgspec
import numpy as np
import pytest
import torch

from kvbridge.core.layout import EngineLayout
from kvbridge.core.plan import Request, plan_request
from kvbridge.core.spec import Component, LayerSpec, ModelSpec
from kvbridge.errors import ConfigError, IncompatibleEngines
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.verify import check_case, random_request

_STATE = LayerSpec("recurrent", state=(Component("compressor_buffer_kv", 1, 32), Component("compressor_buffer_gate", 1, 32)),
                   recurrent_type="compressed")


def _rate_spec(dtype: str = "float32") -> ModelSpec:
    """Windows, rows per 4 and 8 tokens of two widths, and open-window state, like DSV4's layers."""
    return ModelSpec((LayerSpec("mla", 1, 8, window=8), LayerSpec("mla", 1, 8, tokens_per_row=4),
                      LayerSpec("mla", 1, 16, tokens_per_row=4), _STATE, LayerSpec("mla", 1, 8, window=8),
                      LayerSpec("mla", 1, 8, tokens_per_row=8), _STATE), dtype)


def _no_overlap(plan) -> bool:
    """No destination byte is written twice."""
    key = plan.dst_rank * (1 << 50) + plan.dst_region * (1 << 44) + plan.dst_offset
    order = np.argsort(key, kind="stable")
    k, n = key[order], plan.length[order]
    return not np.any(k[1:] < k[:-1] + n[:-1])


@pytest.mark.parametrize("seed", range(3))
def test_rows_per_several_tokens_move_exactly(seed: int) -> None:
    """Every destination row comes from its source row (all other bytes untouched), once, over TP
    pairs that do not divide each other, block sizes, orders, PP and prefix hits."""
    spec, rng = _rate_spec(), random.Random(seed)
    for case in range(25):
        def layout() -> EngineLayout:
            return EngineLayout(tp_size=rng.choice([1, 2, 3, 4]), block_size=rng.choice([8, 16, 24, 32]), num_blocks=24,
                                kv_order=rng.choice(["NHD", "HND"]), kv_placement=rng.choice(["kv_first", "blocks_first"]),
                                pp_size=rng.choice([1, 1, 2]))
        src, dst = layout(), layout()
        n = rng.randint(1, 150)
        request = random_request(spec, src, dst, n, rng.choice([0, 0, rng.randint(0, n)]), rng)
        result = check_case(spec, src, dst, request, seed=case, checksum=True)  # the connector's checksums too
        assert result.ok, (src.describe(), dst.describe(), n, result.mismatches[:2])
        assert _no_overlap(result.plan)
        slow = plan_request(spec, src, dst, request, templates=False)
        assert all(np.array_equal(a, b) for a, b in zip(result.plan.runs().values(), slow.runs().values()))


def test_rows_are_complete_windows_only() -> None:
    """43 tokens at 4 per row: 10 rows move, in blocks of 16 tokens = 4 rows (3 ids)."""
    spec = ModelSpec((LayerSpec("mla", 1, 8, tokens_per_row=4),), "float32")
    src, dst = EngineLayout(block_size=16, num_blocks=8), EngineLayout(tp_size=2, block_size=8, num_blocks=16)
    plan = plan_request(spec, src, dst, Request(((0, 1, 2),), ((0, 1, 2, 3, 4, 5),), 43))
    assert plan.nbytes == 2 * 10 * 8 * 4  # two replicas of 10 rows of 8 float32
    assert plan_request(spec, src, dst, Request(((0, 1, 2),), ((0, 1, 2, 3, 4, 5),), 43, 16)).nbytes == 2 * 6 * 32


def test_refusals_name_the_rate() -> None:
    spec = _rate_spec()
    with pytest.raises(IncompatibleEngines, match="block size 12 of group .* not a multiple of its 8 tokens per row"):
        EngineLayout(block_size=12).addressing(spec, 0)
    for cp in (EngineLayout(tp_size=2, dcp_size=2, block_size=16), EngineLayout(pcp_size=2, block_size=16)):
        with pytest.raises(IncompatibleEngines, match="context parallel"):
            cp.addressing(spec, 0)
    with pytest.raises(IncompatibleEngines, match="kernel block size"):
        EngineLayout(block_size=16, kernel_block_size=8).addressing(spec, 0)
    with pytest.raises(ConfigError, match="only an MLA layer without a window"):
        LayerSpec("mla", 1, 8, window=8, tokens_per_row=4)


def test_digest_of_one_row_per_token_is_unchanged_and_rate_is_compared() -> None:
    spec = ModelSpec.uniform(2, 1, 8, kinds=("mla",))
    old = [{k: v for k, v in msgspec.structs.asdict(x).items() if k not in ("conv_states", "tokens_per_row")}
           for x in spec.layers]
    assert spec.fingerprint() == hashlib.sha256(msgspec.json.encode((old, spec.dtype))).hexdigest()[:16]
    other = ModelSpec((LayerSpec("mla", 1, 8), LayerSpec("mla", 1, 8, tokens_per_row=4)))
    assert other.fingerprint() != spec.fingerprint()
    with pytest.raises(IncompatibleEngines, match="tokens_per_row"):
        spec.check_compatible(other)


def _tiny_dsv4():
    from transformers import AutoModelForCausalLM

    from kvbridge.proofs.model_sweep import tiny_config
    config = tiny_config("deepseek_v4")
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_spec_from_transformers_cache_layers() -> None:
    from kvbridge.models import spec_from_hf_config
    config, _ = _tiny_dsv4()
    spec = spec_from_hf_config(config.to_dict(), view="transformers", dtype="float32", warn=False)
    rates = config.compress_rates
    csa = spec.layers[-4:]  # the sparse layer: window, compressor, indexer, open window
    assert [x.tokens_per_row for x in csa[:3]] == [1] + [rates["compressed_sparse_attention"]] * 2
    assert (csa[0].window, csa[1].key_dim, csa[2].key_dim) == (config.sliding_window, config.head_dim,
                                                               config.index_head_dim)
    assert [c.name for c in csa[3].state][:4] == ["compressor_buffer_kv", "compressor_buffer_gate",
                                                  "compressor_overlap_kv", "compressor_overlap_gate"]
    assert csa[3].state[0].dim == 4 * 2 * config.head_dim  # C rows of Ca | Cb
    hca = spec.layers[:3]
    assert hca[1].tokens_per_row == rates["heavily_compressed_attention"] and len(hca[2].state) == 2


def test_cache_compare_sees_every_compressed_tensor() -> None:
    """The proof's verdict covers buffers, overlaps, compressed rows and entry counts."""
    from kvbridge.proofs.cache_compare import cache_differences
    _, model = _tiny_dsv4()
    with torch.no_grad():
        cache = model(torch.randint(0, 256, (1, 43)), use_cache=True).past_key_values
    for part in ("buffer_kv", "overlap_gate", "compressed_kv"):
        other = copy.deepcopy(cache)
        getattr(other.layers[-1], part)["indexer"].view(-1)[0] += 1
        assert any(f"{part}.indexer" in d for d in cache_differences(cache, other)), part
    other = copy.deepcopy(cache)
    other.layers[0].entry_count["compressor"] += 1
    assert any("entry_count.compressor" in d for d in cache_differences(cache, other))


@pytest.mark.parametrize("prompt_len", [43, 6])
def test_dsv4_moves_bit_exactly_on_both_sweep_pairs(prompt_len: int) -> None:
    """Open windows with n mod C rows (43: 3 of 4 and of 8; 6: no complete HCA window, no overlap yet)."""
    from kvbridge.proofs.local_demo import run_demo
    from kvbridge.proofs.model_sweep import PAIRS
    _, model = _tiny_dsv4()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        for name, prefill, decode in PAIRS:
            result = run_demo(d, prompt_len=prompt_len, new_tokens=4, prefill=prefill, decode=decode)
            assert result.ok and result.cache_equal and result.match, (name, result.cache_differences[:3])


def test_sweep_row_moved() -> None:
    from kvbridge.proofs.model_sweep import sweep_one
    row = sweep_one("deepseek_v4")
    assert row.status == "moved", row.detail


@pytest.mark.parametrize("rate", [0, -4, "4", 4.0, 10 ** 9])
def test_a_compress_rate_that_is_no_bounded_positive_integer_is_refused_in_one_line(rate):
    from kvbridge.proofs.model_sweep import tiny_config
    raw = tiny_config("deepseek_v4").to_dict()
    raw["compress_rates"] = {"compressed_sparse_attention": rate, "heavily_compressed_attention": 8}
    with pytest.raises(ConfigError, match=r"compress rate .*; needs an integer in \[1, 65536\]") as e:
        spec_from_hf_config(raw, warn=False)
    assert "\n" not in str(e.value)


def test_no_default_block_size_beyond_the_bound_for_rates_with_a_huge_common_multiple():
    from kvbridge.cli.shapes import default_block_size
    spec = ModelSpec((LayerSpec("mla", 1, 8, tokens_per_row=48000), LayerSpec("mla", 1, 8, tokens_per_row=65536)))
    with pytest.raises(ConfigError, match="above kvbridge's bound"):
        default_block_size(spec)
    assert default_block_size(ModelSpec((LayerSpec("mla", 1, 8, tokens_per_row=128),))) == 128
