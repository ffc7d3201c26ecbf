"""`kvbridge plan` on PP, CP, per-group block sizes, KV dtypes and cached prefixes (issue 12 item 7)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app
from kvbridge.cli.app import load_spec
from kvbridge.core.layout import EngineLayout
from kvbridge.integrations.vllm.compat import mooncake_verdict, nixl_verdict

runner = CliRunner()


def plan(*args: str) -> dict:
    r = runner.invoke(app, ["plan", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def one_line_error(*args: str) -> str:
    r = runner.invoke(app, list(args))
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


def test_pp_on_both_sides_names_stage_and_layers_of_every_read():
    out = plan("llama-3-8b", "--prefill-tp", "2", "--prefill-pp", "2", "--decode-tp", "1", "--decode-pp", "2",
               "--decode-layer-split", "20,12", "--tokens", "64")
    ranks = out["ranks"]
    assert [(r["tp"], r["pp"], r["cp"]) for r in ranks] == [(0, 0, 0), (0, 1, 0)]
    assert ranks[0]["layers"] == "0-19" and ranks[1]["layers"] == "20-31"
    # decode stage 0 holds layers 0-19: prefill stage 0 has 0-15, stage 1 has 16-31; TP 2 -> 1 gathers both TP ranks
    assert [(x["tp"], x["pp"], x["layers"]) for x in ranks[0]["reads"]] == [(0, 0, "0-15"), (1, 0, "0-15"),
                                                                            (0, 1, "16-19"), (1, 1, "16-19")]
    assert [(x["tp"], x["pp"], x["layers"]) for x in ranks[1]["reads"]] == [(0, 1, "20-31"), (1, 1, "20-31")]
    assert sum(r["bytes"] for r in ranks) == out["bytes_total"] == 64 * 32 * 2 * 8 * 128 * 2
    assert ranks[0]["bytes"] == 64 * 20 * 2 * 8 * 128 * 2


def test_dcp_splits_tokens_and_time_is_the_busiest_rank():
    out = plan("deepseek-v3", "--prefill-tp", "8", "--decode-tp", "4", "--decode-dcp", "4", "--tokens", "256",
               "--link-gbps", "400")
    ranks = out["ranks"]
    assert [r["cp"] for r in ranks] == [0, 1, 2, 3] and all(r["tokens"] == 64 for r in ranks)
    assert all(len(r["reads"]) == 1 for r in ranks)  # one replica of the latent per decode rank
    assert out["ms_per_request"] == pytest.approx(max(r["bytes"] for r in ranks) / (400e9 / 8) * 1e3)
    assert "own link" in out["link_assumption"]


def test_cached_prefix_and_windows_shrink_the_bytes():
    whole = plan("llama-3-8b", "--tokens", "1024")["bytes_total"]
    half = plan("llama-3-8b", "--tokens", "1024", "--num-cached-tokens", "512")["bytes_total"]
    assert half * 2 == whole
    # gpt-oss: every other layer keeps 128 tokens; doubling the request doubles only the full layers
    short, long = (plan("gpt-oss-20b", "--tokens", str(n))["bytes_total"] for n in (1024, 2048))
    assert short < long < 2 * short


def test_per_group_block_sizes_and_kernel_blocks_are_taken():
    out = plan("gpt-oss-20b", "--prefill-group-block-sizes", "16,32", "--decode-kernel-block-size", "8",
               "--tokens", "256")
    assert "blocks 16/32" in out["prefill"] and "kernel 8" in out["decode"]
    assert out["bytes_total"] > 0


def test_kv_dtype_pair_plans_the_conversion_and_vllm_refuses_it():
    out = plan("llama-3-8b", "--decode-kv-dtype", "fp8", "--tokens", "64")
    assert "float8_e4m3fn" in out["decode"]
    # on the wire: the source's bfloat16, two bytes per element; written: fp8, one per element
    assert out["ranks"][0]["bytes"] == 64 * 32 * 2 * 4 * 128 * 2
    assert out["ranks"][0]["dst_bytes"] == 64 * 32 * 2 * 4 * 128 * 1
    nixl, mooncake = out["vllm"]
    assert not nixl["accepts"] and any("KV dtype" in r for r in nixl["reasons"])
    assert not mooncake["accepts"]


def test_tp_ratio_in_words():
    assert "1/2 of one prefill rank's heads" in plan("llama-3-8b", "--tokens", "16")["tp_ratio_words"]
    assert "gathers whole shards from 4" in plan("llama-3-8b", "--prefill-tp", "4", "--decode-tp", "1",
                                                 "--tokens", "16")["tp_ratio_words"]
    assert "do not divide" in plan("tiny-llama-6kv", "--prefill-tp", "3", "--tokens", "16")["tp_ratio_words"]


@pytest.mark.parametrize("args, needle", [
    (("--prefill-layer-split", "10,10", "--prefill-pp", "2"), "layer split"),
    (("--prefill-layer-split", "16,16"), "names 2 stages"),
    (("--decode-layer-split", "a,b", "--decode-pp", "2"), "comma-separated"),
    (("--decode-dcp", "3"), "DCP size 3"),
    (("--decode-kv-dtype", "int3"), "unsupported KV dtype"),
    (("--decode-pp", "100"), "PP size 100"),
    (("--decode-pp", "100000"), "bound"),
    (("--num-cached-tokens", "2000", "--tokens", "1000"), "below --tokens"),
    (("--prefill-group-block-sizes", "16,16"), "group"),
])
def test_bad_shapes_exit_2_with_one_line(args, needle):
    assert needle in one_line_error("plan", "llama-3-8b", *args)


# -- the vLLM connectors' rules --------------------------------------------------------------------------------
def _verdicts(model: str, p: EngineLayout, d: EngineLayout):
    spec = load_spec(model)
    return nixl_verdict(spec, p, d), mooncake_verdict(spec, p, d)


def test_vllm_rules_accept_the_plain_pairs():
    nixl, mooncake = _verdicts("llama-3-8b", EngineLayout(tp_size=1), EngineLayout(tp_size=2))
    assert nixl.accepts and mooncake.accepts


@pytest.mark.parametrize("model, p, d, nixl_ok, mooncake_ok, needle", [
    ("tiny-llama-6kv", EngineLayout(tp_size=3), EngineLayout(tp_size=2), False, False, "divide"),
    ("llama-3-8b", EngineLayout(block_size=16), EngineLayout(tp_size=2, block_size=32), True, False, "block"),
    ("llama-3-8b", EngineLayout(block_size=32), EngineLayout(tp_size=2, block_size=16), False, False, "block"),
    ("qwen3-next-80b", EngineLayout(block_size=16), EngineLayout(block_size=32), False, False, "hybrid"),
    ("llama-3-8b", EngineLayout(pp_size=2), EngineLayout(tp_size=2), False, True, "PP"),
    ("llama-3-8b", EngineLayout(kv_order="NHD"), EngineLayout(tp_size=2), True, False, "NHD"),
    ("deepseek-v3", EngineLayout(tp_size=4), EngineLayout(tp_size=4, dcp_size=4), True, False, "context parallel"),
])
def test_vllm_rules_refuse_with_a_reason(model, p, d, nixl_ok, mooncake_ok, needle):
    nixl, mooncake = _verdicts(model, p, d)
    assert nixl.accepts is nixl_ok and mooncake.accepts is mooncake_ok
    refused = [v for v in (nixl, mooncake) if not v.accepts]
    assert all(v.reasons for v in refused) and any(needle in v.describe() for v in (nixl, mooncake))


def test_vllm_rules_say_they_do_not_cover_compressed_layers():
    from kvbridge.core.spec import LayerSpec, ModelSpec
    spec = ModelSpec((LayerSpec("mla", 1, 64, window=8), LayerSpec("mla", 1, 64, tokens_per_row=4)))
    for verdict in (nixl_verdict(spec, EngineLayout(tp_size=1), EngineLayout(tp_size=2)),
                    mooncake_verdict(spec, EngineLayout(tp_size=1), EngineLayout(tp_size=2))):
        assert verdict.accepts and "do not cover" in verdict.describe()
    plain = ModelSpec((LayerSpec("mla", 1, 64),))
    assert "do not cover" not in nixl_verdict(plain, EngineLayout(), EngineLayout(tp_size=2)).describe()


def test_human_output_explains_the_pair():
    r = runner.invoke(app, ["plan", "llama-3-8b", "--prefill-pp", "2", "--decode-tp", "4", "--decode-pcp", "2",
                            "--tokens", "128"])
    assert r.exit_code == 0, r.output
    for needle in ("D rank (tp,pp,cp)", "reads P rank", "ms/request", "NixlConnector", "MooncakeConnector", "TP:"):
        assert needle in r.output


def test_human_output_prints_the_state_components_rich_would_read_as_markup():
    """The model line holds `[conv_q:16x384 | ...]`; printed as rich markup it vanished."""
    r = runner.invoke(app, ["plan", "qwen3-next-80b"])
    assert r.exit_code == 0, r.output
    assert "gdn state [conv_q:16x384 | conv_k:16x384 |" in " ".join(r.output.split())
