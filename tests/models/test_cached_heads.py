"""Every layer's heads as transformers builds and caches them (issue 30 point 1).

Two configs of a hidden sweep were planned wrong: MiMo-V2-Flash at 12 query heads, 6 KV heads of
24 with values of 16 (its sliding layers double the KV heads in the modeling code: 12 of 12; the
module reader took the query heads from the output projection, which reads 16-wide *values*, and
refused "12 KV heads but only 8 query heads"), and Falcon with `num_kv_heads` under its new decoder
architecture (the fused projection computes 6 KV heads, the forward broadcasts each over its query
group and caches 12; kvbridge planned 6 and the proof refused). Both now move bit-exactly through
the transformers proof from a saved model directory, as `kvbridge demo --model DIR` runs it.
"""

from __future__ import annotations

import json
import tempfile

import pytest

from kvbridge.core.layout import EngineLayout
from kvbridge.errors import ConfigError
from kvbridge.models import spec_from_hf_config
from kvbridge.models.modules import BuiltAttention, as_cached

MIMO = {"model_type": "mimo_v2_flash", "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 6,
        "head_dim": 24, "v_head_dim": 16, "hidden_size": 96, "intermediate_size": 64, "vocab_size": 256,
        "sliding_window": 8, "layer_types": ["full_attention"] + ["sliding_attention"] * 3,
        "bos_token_id": None, "eos_token_id": None}
FALCON = {"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 12, "num_kv_heads": 6,
          "hidden_size": 192, "vocab_size": 256, "new_decoder_architecture": True,
          "bos_token_id": None, "eos_token_id": None}
PAIRS = [(EngineLayout(tp_size=1, block_size=16, num_blocks=8), EngineLayout(tp_size=2, block_size=16, num_blocks=8)),
         (EngineLayout(tp_size=3, block_size=16, num_blocks=8),
          EngineLayout(tp_size=2, block_size=8, num_blocks=16, kv_order="NHD"))]


def _heads(config: dict, view: str = "transformers") -> list[tuple[str, int, int, int]]:
    return [(x.kind, x.num_kv_heads, x.key_dim, x.value_dim)
            for x in spec_from_hf_config(config, view=view, warn=False).layers]


def test_mimo_v2_flash_sliding_layers_plan_the_twelve_kv_heads_transformers_builds():
    want = [("full", 6, 24, 16)] + [("sliding", 12, 24, 16)] * 3
    assert _heads(MIMO) == _heads(MIMO, "engine") == want


def test_the_query_heads_come_from_the_query_projection_not_the_value_wide_output():
    """The module reader's check (never more KV than query heads) reads 12 query heads from q_proj
    (288 = 12 x 24), not 8 from o_proj (192 = 12 values of 16 read as keys of 24)."""
    import torch
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    from kvbridge.models.modules import attention_geometry
    raw = {k: v for k, v in MIMO.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["mimo_v2_flash"](**raw))
    got = [attention_geometry(layer.self_attn) for layer in model.model.layers]
    assert [(g.q_heads, g.heads, g.key_dim, g.value_dim) for g in got] == [(12, 6, 24, 16)] + [(12, 12, 24, 16)] * 3


def test_falcon_new_decoder_architecture_engines_keep_the_computed_heads_transformers_the_cached(capsys):
    assert _heads(FALCON, "engine") == [("full", 6, 16, 16)] * 2  # vLLM's FalconAttention: num_kv_heads
    assert _heads(FALCON) == [("full", 12, 16, 16)] * 2  # transformers broadcasts each over its 2 query heads
    spec_from_hf_config(FALCON)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FalconAttention computes 6 KV heads and caches each 2 times (12 heads)" in err[0], err
    assert "layers 0-1" in err[0]


def test_falcon_without_the_new_architecture_keeps_what_its_projection_computes():
    old = {**FALCON, "new_decoder_architecture": False}
    assert _heads({**old, "multi_query": True}) == [("full", 1, 16, 16)] * 2  # Falcon-7B's MQA
    # multi_query off: the fused projection is 3 x hidden, 12 KV heads, whatever num_kv_heads says
    # (transformers' own forward cannot run it with 6: its reshape to num_kv_heads fails)
    assert _heads({**old, "multi_query": False}) == [("full", 12, 16, 16)] * 2


@pytest.mark.oracle
@pytest.mark.parametrize("config", [MIMO, FALCON], ids=["mimo_v2_flash", "falcon-new-decoder"])
def test_both_move_bit_exactly_through_the_transformers_proof_from_a_saved_directory(config):
    import torch
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    from kvbridge.proofs.local_demo import run_demo
    raw = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[config["model_type"]](**raw), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        assert json.load(open(f"{d}/config.json"))["model_type"] == config["model_type"]
        for prefill, decode in PAIRS:
            r = run_demo(d, prompt_len=40, new_tokens=4, prefill=prefill, decode=decode)
            assert r.ok and r.match and r.cache_equal, (prefill.describe(), r.cache_differences[:3])


def test_as_cached_rules():
    built = BuiltAttention("A", False, 6, 16, 16, q_heads=12)
    assert as_cached(built, None) == (built, 6)  # nothing measured: the module
    assert as_cached(built, (6, 16, 16)) == (built, 6)
    assert as_cached(built, (12, 16, 16)) == (built, 12)  # each computed head cached twice
    other, heads = as_cached(built, (4, 32, 32))  # another measurement wins over the module
    assert (other.heads, other.key_dim, other.value_dim, heads) == (4, 32, 32, 4)
    made, heads = as_cached(None, (3, 8, 8), "XAttention")  # no module read: the measurement alone
    assert (made.module, made.heads, heads) == ("XAttention", 3, 3)
    mla = BuiltAttention("M", True, lora=32, rope=8)
    assert as_cached(mla, (1, 32, 8)) == (mla, 0)  # MLA's latent and rope parts are left to the module


def test_an_attention_module_nothing_can_read_is_refused_by_name(monkeypatch):
    """K/V projections the module reader cannot read, and no forward on meta to measure the cache:
    refused naming the layer and the module, not planned from the config's fields."""
    from kvbridge.models import modules, probe
    monkeypatch.setattr(modules, "attention_geometry", lambda module: None)
    monkeypatch.setattr(probe, "cached_kv", lambda model, n: None)
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
             "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 128}
    with pytest.raises(ConfigError, match=r"^layer 0 \(full_attention\): .*transformers' LlamaAttention cannot be "
                                          r"read from its projections") as e:
        spec_from_hf_config(llama)
    assert "\n" not in str(e.value)
    # the forward measured: it answers for the module
    monkeypatch.setattr(probe, "cached_kv", lambda model, n: dict.fromkeys(range(n), (2, 8, 8)))
    assert [(x.num_kv_heads, x.key_dim) for x in spec_from_hf_config(llama, warn=False).layers] == [(2, 8)] * 2


@pytest.mark.parametrize("in_a_thread", [False, True])
def test_a_meta_forward_that_does_not_end_is_stopped_and_measures_nothing(monkeypatch, caplog, in_a_thread):
    """The meta-device forward had no time bound: a forward that never ends on meta (a loop on a
    value meta cannot give, a modeling file that waits) held `kvbridge plan` or a fleet's start
    for ever (issue 43, noted and left). It is stopped after PROBE_SECONDS, in whichever thread it
    runs, and nothing is measured, said in one line."""
    import threading
    import time

    import torch

    from kvbridge.models import probe

    class Hangs(torch.nn.Module):
        def forward(self, input_ids, use_cache=True):
            end = time.monotonic() + 20
            while time.monotonic() < end:
                time.sleep(0.01)
            raise AssertionError("not stopped")

    monkeypatch.setattr(probe, "PROBE_SECONDS", 0.5, raising=False)  # (raising=False: the old code runs too)
    got, took = [], []

    def run() -> None:
        t0 = time.monotonic()
        got.append(probe.cached_kv(Hangs(), 2))
        took.append(time.monotonic() - t0)

    with caplog.at_level("WARNING", logger="kvbridge"):
        if in_a_thread:
            t = threading.Thread(target=run)
            t.start()
            t.join(30)
        else:
            run()
    assert got == [None] and took[0] < 5, took
    assert "ran past 0 s and was stopped" in caplog.text or "ran past 1 s and was stopped" in caplog.text, caplog.text
    # a forward that ends in time is measured as before, and no stop lands after it
    assert probe.cached_kv(type("Quick", (torch.nn.Module,), {"forward": lambda self, x, use_cache: None})(), 2) == {}
    time.sleep(1.0)
