"""`kvbridge serve`'s instance shapes (`--prefill` / `--decode` key=value lists): untrusted text,
refused in one bounded line before anything starts; no vLLM needed."""

from __future__ import annotations

import pytest

from kvbridge.errors import ConfigError
from kvbridge.integrations.vllm.fleet_config import InstanceShape


def test_a_shape_reads_every_key():
    s = InstanceShape.parse("tp=2,pp=1,block=64,transport=nixl,mode=push", "--prefill")
    assert (s.tp, s.pp, s.block, s.transport, s.mode) == (2, 1, 64, "nixl", "push")


@pytest.mark.parametrize("text, why", [
    ("tp", "key=value"), ("tp=1,tp=2", "given twice"), ("foo=1", "unknown key 'foo'"), ("tp=x", "positive integer"),
    ("tp=0", "1..256, got 0"), ("tp=257", "1..256, got 257"), ("block=5000", "1..4096"), ("tp=" + "9" * 5000, "more than 12 digits"),
    ("transport=tcp", "transport must be"), ("mode=both", "mode must be"), ("x" * 500 + "=1", "unknown key"),
])
def test_bad_shapes_are_one_bounded_line(text, why):
    with pytest.raises(ConfigError, match=why) as e:
        InstanceShape.parse(text, "--decode")
    message = str(e.value)
    assert "\n" not in message and len(message) < 300 and message.startswith("--decode ")


@pytest.mark.parametrize("pool, block_tokens, connector, secret, why", [
    ("nohost", 64, "kvbridge", None, "must be 'start' or the host:port"),
    ("start", 48, "kvbridge", None, "does not divide the pool's 48-token block"),
    ("127.0.0.1:99999", 64, "kvbridge", None, "host:port"),
    ("start", 64, "nixl", None, "needs kvbridge's connector"),
    ("", 64, "kvbridge", (b"x" * 32, 0o600), "need --pool"),
    ("", 32, "kvbridge", None, "need --pool"),
    ("start", 64, "kvbridge", (b"x" * 32, 0o644), "--pool-secret-file .*chmod 600"),
    ("start", 64, "kvbridge", (b"short", 0o600), "--pool-secret-file .*at least 16 bytes"),
    ("start", 64, "kvbridge", (b"", 0o600), "--pool-secret-file .*at least 16 bytes"),
])
def test_a_pool_the_fleet_cannot_use_is_refused_in_one_line(tmp_path, pool, block_tokens, connector, secret, why):
    from pathlib import Path

    from kvbridge.integrations.vllm.fleet_config import FleetConfig, check_shapes
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama

    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "m", seed=1))
    secret_file = ""
    if secret is not None:
        secret_file = str(tmp_path / "pool.key")
        Path(secret_file).write_bytes(secret[0])
        Path(secret_file).chmod(secret[1])
    config = FleetConfig(model=Path(model), prefill=[InstanceShape.parse("tp=1,block=64", "--prefill")],
                         decode=[InstanceShape.parse("tp=2,block=32", "--decode")], log_dir=tmp_path, port=1,
                         pool=pool, pool_block_tokens=block_tokens, connector=connector,
                         pool_secret_file=secret_file)
    with pytest.raises(ConfigError, match=why) as e:
        check_shapes(config)
    assert "\n" not in str(e.value)


def test_the_shape_check_remembers_a_models_spec_and_says_its_warnings_again(tmp_path, monkeypatch, capfd):
    """Deriving the spec imports transformers (5-7 s at every `kvbridge serve` start): a second
    check of an unchanged model directory takes it from the cache, warnings included; a changed
    config.json is derived again."""
    import json

    import kvbridge.models as models
    from kvbridge.integrations.vllm.fleet_config import FleetConfig, InstanceShape, check_shapes
    from kvbridge.models import config as model_config
    from kvbridge.proofs.vllm.model import add_byte_tokenizer, make_tiny_llama

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = add_byte_tokenizer(make_tiny_llama(tmp_path / "m", seed=1))
    cfg = json.loads((model / "config.json").read_text())
    del cfg["num_hidden_layers"]  # left to the class's default: a warning line
    (model / "config.json").write_text(json.dumps(cfg))
    calls = []
    derive = models.spec_from_hf_config
    monkeypatch.setattr(models, "spec_from_hf_config", lambda *a, **k: calls.append(a) or derive(*a, **k))
    config = FleetConfig(model=model, prefill=[InstanceShape(tp=1)], decode=[InstanceShape(tp=2)],
                         log_dir=tmp_path, port=1)
    for _ in range(2):
        model_config._WARNED.clear()  # a new process: its own warnings
        check_shapes(config)
    warned = capfd.readouterr().err
    assert len(calls) == 1, calls
    assert warned.count("config.json omits num_hidden_layers") == 2, warned  # said at both starts
    from kvbridge.models.spec_cache import spec_of_dir
    assert spec_of_dir(model) == derive(str(model)) and len(calls) == 1
    cfg["num_hidden_layers"] = 3
    (model / "config.json").write_text(json.dumps(cfg))
    assert len(spec_of_dir(model).layers) == 3 and len(calls) == 2
