"""`kvbridge bench --pool`: the pool's transfer benchmark from the command line."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvbridge.cli import app

runner = CliRunner()


def test_bench_pool_reports_gb_s_beside_a_copy():
    res = runner.invoke(app, ["bench", "--pool", "--tokens", "256", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    both = json.loads(res.output[res.output.index("{"):])
    host = both["host_tier"]["rows"]
    assert [r["pool_block_tokens"] for r in host] == [64]  # 1024-token blocks need 1024 tokens
    for k in ("store_gb_s", "load_gb_s", "store_vs_copy", "load_vs_copy", "copy_gb_s_store_side", "copy_gb_s_load_side"):
        assert host[0][k] > 0
    out = both["mooncake"]
    assert out["bytes"] > 0 and out["tokens"] == 256
    for k in ("store_gb_s", "load_gb_s", "reload_gb_s", "copy_gb_s", "store_vs_copy", "load_vs_copy", "reload_vs_copy"):
        assert out[k] > 0


def test_bench_pool_refuses_what_it_cannot_take_in_one_line():
    for args, why in ((["--tokens", "100"], "multiple of the 64-token pool block"),
                      (["--prefill-tp", "2"], "does not apply to bench with --pool"),
                      (["--serve"], "drop --serve")):
        res = runner.invoke(app, ["bench", "--pool", *args])
        assert res.exit_code == 2 and why in res.output and len(res.output.strip().splitlines()) == 1, res.output
