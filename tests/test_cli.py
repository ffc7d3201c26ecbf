"""The `kvbridge` command as a user runs it: JSON output, exit codes, one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvbridge.cli import app

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_plan_json_names_sources_and_slices_for_gather():
    r = run("plan", "llama-3-8b", "--prefill-tp", "4", "--decode-tp", "2", "--tokens", "64", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [x["source_ranks"] for x in out["ranks"]] == [[0, 1], [2, 3]]
    assert out["ranks"][1]["head_slices"] == [{"src_rank": 2, "heads": [4, 6]}, {"src_rank": 3, "heads": [6, 8]}]
    assert out["ranks"][0]["tp_ratio"] == -2
    # 32 layers x K,V x 4 heads x 128 dims x 2 bytes per decode rank and token
    assert out["ranks"][0]["bytes_per_token"] == 32 * 2 * 4 * 128 * 2
    assert out["bytes_total"] == 64 * 32 * 2 * 8 * 128 * 2


def test_plan_non_divisible_pair_has_no_tp_ratio_but_plans():
    r = run("plan", "tiny-llama-6kv", "--prefill-tp", "3", "--decode-tp", "2", "--tokens", "40", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["ranks"][0]["tp_ratio"] is None
    assert out["ranks"][0]["source_ranks"] == [0, 1]
    assert out["ranks"][1]["source_ranks"] == [1, 2]


def test_plan_warns_about_tiny_runs_for_nhd_to_hnd():
    r = run("plan", "llama-3-8b", "--prefill-layout", "NHD", "--tokens", "32", "--json")
    assert r.exit_code == 0, r.output
    assert any("runs average" in w for w in json.loads(r.stdout)["ranks"][0]["warnings"])


def test_plan_illegal_tp_exits_2_with_one_line():
    r = run("plan", "llama-3-8b", "--prefill-tp", "3")
    assert r.exit_code == 2
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot shard 8 KV heads over TP=3" in lines[0]
    assert "Traceback" not in r.output


def test_unknown_model_exits_2():
    r = run("plan", "no-such-model")
    assert r.exit_code == 2 and "unknown model" in r.output


def test_a_preset_name_given_to_a_command_that_runs_a_model_says_why_it_is_refused():
    # `kvbridge plan llama-3-8b` plans it; demo and prefill-server run a model, and said only
    # "unknown model" (issue 43, a new user's first hour)
    assert run("plan", "llama-3-8b").exit_code == 0
    for args in (("demo", "--model", "llama-3-8b"), ("demo", "--engine", "vllm", "--model", "llama-3-8b")):
        r = run(*args)
        lines = [line for line in r.output.splitlines() if line.strip()]
        assert r.exit_code == 2 and len(lines) == 1, r.output
        assert "--model llama-3-8b: a preset geometry that `kvbridge plan` and `bench` take (no weights)" in lines[0]
        assert "tiny-llama" in lines[0]


def test_verify_json_reports_zero_failures():
    r = run("verify", "--cases", "25", "--seed", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["cases"] == 25 and out["failed"] == 0 and out["bytes_moved"] > 0


def test_bench_json_reports_ratio_and_planning_fraction():
    r = run("bench", "--tokens", "128", "--repeats", "2", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["bytes"] == 128 * 32 * 2 * 8 * 128 * 2
    assert out["ratio"] > 0 and out["plan_fraction"] > 0
    assert out["num_runs"] > 0
    # Planning beside the bytes' time on the link (default 400 Gbit/s = 50 GB/s per decode rank: the
    # busiest of the two TP ranks moves half the bytes), cold and warm.
    assert out["link_gbps"] == 400 and out["link_seconds"] == pytest.approx(out["bytes"] / 2 / 50e9)
    assert out["plan_warm_seconds"] > 0 and out["plan_cold_seconds"] > 0 and out["plan_reference_seconds"] > 0
    assert out["plan_link_percent"] == pytest.approx(100 * out["plan_warm_seconds"] / out["link_seconds"])


def test_bench_link_speed_sets_the_transfer_time():
    r = run("bench", "--tokens", "64", "--repeats", "1", "--link-gbps", "100", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["link_gbps"] == 100 and out["link_seconds"] == pytest.approx(out["bytes"] / 2 / 12.5e9)
    r = run("bench", "--tokens", "64", "--repeats", "1", "--link-gbps", "0")
    assert r.exit_code == 2


def test_plan_hybrid_names_attention_and_state_sources():
    r = run("plan", "qwen3-next-80b", "--prefill-tp", "4", "--decode-tp", "1", "--tokens", "64", "--json")
    assert r.exit_code == 0, r.output
    rank = json.loads(r.stdout)["ranks"][0]
    # 2 KV heads at P TP=4: heads replicated on P, one reader per distinct head (vLLM's GQA dedup);
    # the GDN state is sharded over all four P ranks, so every one of them is read.
    assert rank["attention_source_ranks"] == [0, 2]
    assert rank["recurrent_source_ranks"] == [0, 1, 2, 3]
    assert rank["state_bytes_per_request"] > 0


def test_demo_json_matches_for_non_divisible_pair(tmp_path):
    dump = tmp_path / "cache.safetensors"
    r = run("demo", "--model", "tiny-llama-6kv", "--prefill-tp", "3", "--decode-tp", "2", "--prompt-len", "20",
            "--new-tokens", "4", "--prefill-layout", "NHD", "--decode-block-size", "8", "--json",
            "--dump-decode-cache", str(dump))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["match"] is True and out["tokens_reference"] == out["tokens_disaggregated"]
    assert out["bytes_moved"] > 0 and out["num_runs"] > 0 and out["transfer_seconds"] >= 0
    from safetensors.torch import load_file
    tensors = load_file(str(dump))
    assert tensors["layers.0.keys"].shape[1] == 6  # all KV heads gathered from both decode ranks


def test_demo_bad_prompt_ids_exit_2():
    r = run("demo", "--prompt-ids", "1,x,3")
    assert r.exit_code == 2 and "prompt-ids" in r.output


# ---- what a newcomer trips on (issue 15 item 5) and bounds (issue 13 item 4) -------------------------
def _one_error_line(r) -> str:
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


def test_prefill_without_role_decode_is_refused():
    assert "--role decode" in _one_error_line(run("demo", "--prefill", "127.0.0.1:5600"))


def test_option_of_another_runner_is_refused_naming_the_runner():
    line = _one_error_line(run("demo", "--num-cached-tokens", "16", "--transport", "shm"))
    assert "--num-cached-tokens" in line and "--transport local" in line
    line = _one_error_line(run("demo", "--offload", "--prefill-block-size", "32"))
    assert "--prefill-block-size" in line and "--offload" in line


def test_offload_keeps_the_given_model(monkeypatch):
    from kvbridge.cli import demo_configs
    seen = {}
    monkeypatch.setattr(demo_configs.OffloadDemo, "run", lambda self: seen.setdefault("model", self.model) and 1/0)
    run("demo", "--offload", "--model", "tiny-llama")
    assert seen["model"] == "tiny-llama"


def test_prompt_beyond_the_model_context_fails_up_front():
    line = _one_error_line(run("demo", "--prompt-len", "1000000"))
    assert "bound" in line or "max_position_embeddings" in line
    line = _one_error_line(run("demo", "--prompt-len", "8000"))
    assert "max_position_embeddings" in line


def test_layout_names_any_case():
    r = run("plan", "llama-3-8b", "--prefill-layout", "nhd", "--decode-layout", "Hnd", "--tokens", "32", "--json")
    assert r.exit_code == 0, r.output
    assert "NHD" in json.loads(r.stdout)["prefill"]


def test_a_local_directory_wins_over_a_preset_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama-3-8b").mkdir()
    (tmp_path / "llama-3-8b" / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128}))
    r = run("plan", "llama-3-8b", "--tokens", "16", "--json")
    assert r.exit_code == 0, r.output
    assert "2 layers" in json.loads(r.stdout)["model"]


def test_absurd_numbers_exit_2_naming_the_bound():
    for args in (("plan", "llama-3-8b", "--decode-tp", "1000000"), ("plan", "llama-3-8b", "--tokens", "100000000"),
                 ("verify", "--cases", "100000000"), ("demo", "--transport", "shm", "--requests", "100000")):
        assert "bound" in _one_error_line(run(*args))


def test_decode_half_defaults_to_the_prefill_servers_transport():
    from kvbridge.cli.demo import _config
    from kvbridge.cli.app import Mode, Transport
    from kvbridge.cli.shapes import SideShape
    shapes = {side: SideShape(side=side, tp=tp) for side, tp in (("prefill", 1), ("decode", 2))}
    cfg = _config("decode", "tiny-llama", None, 8, 2, 0, shapes, None, None, 0, Transport.local, Mode.pull, 1, 5.0,
                  "127.0.0.1:1", None, True, None)
    assert cfg.transport == "shm"


def test_both_halves_of_the_two_host_demo_say_how_to_authenticate():
    assert "--secret-file" in _one_error_line(run("demo", "--role", "decode", "--prefill", "127.0.0.1:1"))
    assert "--secret-file" in _one_error_line(run("prefill-server", "--listen", "127.0.0.1:1"))


def test_bench_staged_reports_each_pairs_path_and_refuses_other_runners():
    r = run("bench", "--staged", "--tokens", "32", "--repeats", "1", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["default_choice"] == "2 staged / 0 direct" and out["staged_over_contiguous"] > 0
    assert "--staged" in _one_error_line(run("bench", "--staged", "--transport", "shm"))


# ---- `kvbridge demo --model DIR` on the directory `kvbridge plan DIR` takes: config.json alone --------
def _config_dir(path, **sizes):
    path.mkdir()
    config = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256, **sizes}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_demo_of_a_config_only_directory_draws_weights_and_matches(tmp_path):
    d = _config_dir(tmp_path / "m")
    r = run("demo", "--model", str(d), "--prompt-len", "12", "--new-tokens", "3", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["match"] is True


def test_demo_of_a_model_too_large_for_the_cpu_proof_exits_2_naming_its_size(tmp_path):
    d = _config_dir(tmp_path / "big", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256)
    line = _one_error_line(run("demo", "--model", str(d)))
    assert "GiB in float32" in line and "KVBRIDGE_DEMO_MAX_GIB" in line


def test_demo_of_damaged_weights_exits_2_with_one_line(tmp_path):
    d = _config_dir(tmp_path / "bad")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "cannot load its weights" in _one_error_line(run("demo", "--model", str(d)))


def test_demo_checks_the_directorys_config_before_transformers_reads_it(tmp_path):
    """kvbridge's untrusted-config checks run first: transformers would raise a traceback on these."""
    for i, bad in enumerate(({"num_key_value_heads": [2]}, {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 2},
                             {"model_type": "../../etc"})):
        d = _config_dir(tmp_path / f"m{i}", **bad)
        assert "Traceback" not in _one_error_line(run("demo", "--model", str(d)))


def test_default_block_size_holds_whole_rows_of_a_compressed_layer(tmp_path):
    """DeepSeek-V4 keeps one row per 128 tokens in its heavily compressed layers: with no block size
    on the command line, plan and demo take the smallest multiple of 16 holding whole rows (128)."""
    from transformers import DeepseekV4Config

    from kvbridge.cli.shapes import SideShape, default_block_size
    from kvbridge.models import spec_from_hf_config
    from kvbridge.proofs.model_sweep import tiny_config
    DeepseekV4Config().save_pretrained(tmp_path / "full")
    spec = spec_from_hf_config(tmp_path / "full" / "config.json", warn=False)
    assert default_block_size(spec) == 128 and SideShape(side="decode").layout_for(spec, 256).block_size == 128
    r = run("plan", str(tmp_path / "full"), "--decode-tp", "4", "--tokens", "1024", "--json")
    assert r.exit_code == 0, r.output
    assert "not a multiple" in _one_error_line(run("plan", str(tmp_path / "full"), "--decode-block-size", "64"))
    config = tiny_config("deepseek_v4")
    config.compress_rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    config.save_pretrained(tmp_path / "tiny")
    r = run("demo", "--model", str(tmp_path / "tiny"), "--prompt-len", "260", "--new-tokens", "3", "--prefill-tp", "2",
            "--decode-tp", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["match"] is True and out["cache_equal"] is True


def test_demo_of_a_config_transformers_accepts_but_cannot_run_exits_2_with_one_line(tmp_path):
    """DeepSeek-V4 with an indexer narrower than its rope part: transformers' config class takes it,
    its forward fails; the demo says so in one line instead of a traceback from inside the model."""
    from kvbridge.proofs.model_sweep import tiny_config
    config = tiny_config("deepseek_v4")
    config.head_dim, config.index_head_dim = 1024, 256
    config.save_pretrained(tmp_path)
    line = _one_error_line(run("demo", "--model", str(tmp_path), "--prompt-len", "8", "--new-tokens", "2"))
    assert "transformers cannot run DeepseekV4ForCausalLM" in line


def test_kv_dtype_conversion_of_a_compressed_layer_is_checked_row_by_row(tmp_path):
    """A DeepSeek-V4 move to a float16 cache: every moved row (one per compress-rate tokens) is the
    conversion of its source row (the check read token positions as rows and failed with an IndexError)."""
    from kvbridge.proofs.model_sweep import tiny_config
    tiny_config("deepseek_v4").save_pretrained(tmp_path)
    r = run("demo", "--model", str(tmp_path), "--decode-kv-dtype", "float16", "--prompt-len", "18", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["elements_checked"] > 0 and not out.get("conversion_mismatches")


def test_demo_counts_buffers_in_the_size_bound(tmp_path):
    """GPT-Neo registers a max_positions x max_positions causal mask per layer: 2 tiny layers at 200,000
    positions take 74 GiB of buffers with a few MiB of parameters."""
    tmp_path.joinpath("neo").mkdir()
    (tmp_path / "neo" / "config.json").write_text(json.dumps({
        "model_type": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4, "vocab_size": 256,
        "attention_types": [[["global"], 2]], "max_position_embeddings": 200000}))
    line = _one_error_line(run("demo", "--model", str(tmp_path / "neo")))
    assert "GiB in float32" in line


def test_output_piped_into_a_reader_that_stops_early_ends_without_a_traceback():
    """`kvbridge serve ... --dry-run | head -1`: the closed pipe ended in an AttributeError traceback
    (the one-line error wrapper named an exception typer's vendored click does not have)."""
    import subprocess
    import sys
    from pathlib import Path
    cli = str(Path(sys.executable).parent / "kvbridge")
    proc = subprocess.Popen([cli, "verify", "--cases", "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(120)
    assert "Traceback" not in err, err[-2000:]
