"""The transformers proof on tiny random models of the state kinds issue 11 added: stateless layers
(Nemotron-H's MLP and MoE blocks), layers holding attention K/V and recurrent state together
(Zamba2's shared-attention layers, Falcon-H1), multi-head Mamba1 (Zamba), Kimi delta attention (Kimi-Linear, Bailing hybrid),
lightning attention (MiniMax), ZAYA's convolutional attention, Inkling's K/V and residual-stream convs (four conv states
per layer), xLSTM's mLSTM state (kept in its own `xLSTMCache`) and the
sparse-attention indexer key cache (DeepSeek-V3.2). Bit-exact cache and
greedy tokens after a move between engines of other shapes than the sweep's pairs: TP 2 -> 3
(neither divides the other) with a prefix-cache hit on the decode side and HND -> NHD, and TP 1 -> 6
(KV heads replicated, Mamba groups split to one per rank)."""

from __future__ import annotations

import pytest
import torch

from kvbridge import EngineLayout
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.local_demo import run_demo
from kvbridge.proofs.model_sweep import tiny_config

KINDS = {"nemotron_h": "stateless", "zamba2": "hybrid", "falcon_h1": "hybrid", "zamba": "mamba1_heads",
         "kimi_linear": "kda", "bailing_hybrid": "kda", "deepseek_v32": "indexer",
         "hy_v4": "indexer", "gemma3n_text": "stateless", "minimax": "lightning", "zaya": "cca", "inkling_text": "kv_conv",
         "inkling2_text": "kv_conv", "xlstm": "mlstm"}  # HY-V4: "shared" indexed layers keep K/V only;
# Gemma-3n: its last layers read earlier layers' K/V (DummyLayer)
PAIRS = [
    (EngineLayout(tp_size=2, block_size=16, num_blocks=8, kv_order="HND"),
     EngineLayout(tp_size=3, block_size=8, num_blocks=16, kv_order="NHD", kv_placement="blocks_first"), 16),
    (EngineLayout(tp_size=1, block_size=8, num_blocks=16),
     EngineLayout(tp_size=6, block_size=16, num_blocks=8, kv_order="HND"), 0),
]


@pytest.fixture(scope="module", params=sorted(KINDS))
def model_dir(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    config = tiny_config(request.param)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp(request.param)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    return request.param, d, config


def test_tiny_model_has_the_kind(model_dir):
    arch, _, config = model_dir
    spec = spec_from_hf_config(config.to_dict(), view="transformers", dtype="float32", warn=False)
    kinds = {layer.kind for layer in spec.layers} | {layer.recurrent_type for layer in spec.layers}
    want = KINDS[arch]
    if want in ("hybrid", "indexer"):  # more spec layers than transformers layers: one cache layer is two
        assert spec.num_layers > config.num_hidden_layers
        assert {"full", "recurrent"} <= kinds if want == "hybrid" else kinds == {"mla", ""}
    else:
        assert want in kinds


@pytest.mark.parametrize("prefill, decode, cached", PAIRS, ids=["tp2-hnd-to-tp3-nhd-prefix", "tp1-to-tp6"])
def test_moves_bit_exactly(model_dir, prefill, decode, cached):
    _, d, _ = model_dir
    result = run_demo(str(d), prompt_len=37, new_tokens=4, seed=1, prefill=prefill, decode=decode,
                      num_cached_tokens=cached)
    assert result.ok and result.cache_equal and result.match, result.cache_differences[:3]
