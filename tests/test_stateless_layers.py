"""Stateless layers (issue 11): the MLP / MoE blocks of a hybrid stack (Nemotron-H) and layers that
read another layer's K/V hold no cache. transformers gives them a `DummyLayer`, vLLM no KV cache at
all; kvbridge keeps their index (layer numbers and PP stages stay the model's) but gives them no
components, no group and no memory region, and the planner moves nothing for them."""

from __future__ import annotations

import pytest

from kvbridge import ConfigError, EngineLayout, LayerSpec, ModelSpec
from kvbridge.core.plan import Request, plan_request
from kvbridge.models import spec_from_hf_config
from kvbridge.proofs.verify import check_case

NEMOTRON_H = {  # Nemotron-H style pattern: M = Mamba2, - = MLP, * = attention, E = MoE
    "model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-E", "num_hidden_layers": 6, "hidden_size": 256,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "mamba_num_heads": 16,
    "mamba_head_dim": 32, "n_groups": 4, "ssm_state_size": 16, "torch_dtype": "bfloat16",
}
STATELESS = LayerSpec("stateless")
FULL = LayerSpec("full", 2, 8, 8)


@pytest.mark.parametrize("bad", [
    dict(num_kv_heads=1), dict(key_dim=8), dict(value_dim=8), dict(window=4), dict(recurrent_type="mamba2"),
    dict(conv_rows=3)])
def test_stateless_layer_holds_nothing(bad):
    with pytest.raises(ConfigError, match="stateless layer has no"):
        LayerSpec("stateless", **bad)


def test_stateless_layers_have_no_group_and_no_components():
    spec = ModelSpec((STATELESS, FULL, STATELESS, LayerSpec("sliding", 2, 8, 8, 4), FULL))
    assert STATELESS.components == () and STATELESS.is_stateless and not STATELESS.is_attention
    assert spec.groups == ((1, 4), (3,))
    assert spec.layer_group == (-1, 0, -1, 1, 0)
    assert spec.bytes_per_token() == 3 * 2 * 2 * 8 * 2 and spec.total_kv_heads == 2
    assert "2xstateless" in spec.describe()
    with pytest.raises(ConfigError, match="every layer is stateless"):
        ModelSpec((STATELESS, STATELESS))


def test_stateless_kind_is_part_of_the_geometry():
    a, b = ModelSpec((FULL, STATELESS)), ModelSpec((FULL, FULL))
    assert a.fingerprint() != b.fingerprint()
    with pytest.raises(Exception, match="layer 1 kind differs"):
        a.check_compatible(b)


@pytest.mark.parametrize("placement", ["per_layer", "cross_layer"])
def test_stateless_layers_get_no_region(placement):
    """Regions follow the layers that hold a cache, in order: what vLLM registers (no tensor for an MLP)."""
    spec = ModelSpec((STATELESS, FULL, STATELESS, FULL))
    lay = EngineLayout(tp_size=2, block_size=4, num_blocks=3, layer_placement=placement, kv_placement="blocks_first")
    a = lay.addressing(spec, 0)
    assert list(a.num_components) == [0, 2, 0, 2]
    if placement == "per_layer":
        assert len(a.region_nbytes) == 2 and a.region[1, 0] == 0 and a.region[3, 0] == 1
        assert a.region_nbytes == lay.addressing(ModelSpec((FULL, FULL)), 0).region_nbytes
    else:
        assert len(a.region_nbytes) == 1


def test_plan_of_a_stack_with_stateless_layers_equals_the_plan_without_them():
    with_mlp = ModelSpec((STATELESS, FULL, STATELESS, FULL), "bfloat16")
    without = ModelSpec((FULL, FULL), "bfloat16")
    src = EngineLayout(tp_size=1, block_size=4, num_blocks=4)
    dst = EngineLayout(tp_size=2, block_size=8, num_blocks=3, kv_order="HND")
    req = Request(((0, 1, 2),), ((2, 0),), 10)
    p, q = plan_request(with_mlp, src, dst, req), plan_request(without, src, dst, req)
    assert p.nbytes == q.nbytes and len(p) == len(q)
    for key, value in p.runs().items():
        assert (value == q.runs()[key]).all(), key


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_stateless_layers_move_bit_exactly_across_pipeline_stages(pp):
    """PP stages count stateless layers (vLLM splits decoder layers, MLP blocks included)."""
    spec = ModelSpec((STATELESS, FULL, STATELESS, FULL, STATELESS, FULL), "bfloat16")
    src = EngineLayout(tp_size=1, block_size=4, num_blocks=6, pp_size=pp)
    dst = EngineLayout(tp_size=2, block_size=8, num_blocks=4, kv_order="HND")
    req = Request(((0, 1, 2, 3),), ((2, 0),), 13)
    result = check_case(spec, src, dst, req, seed=pp, checksum=True)
    assert result.ok, result.mismatches


def test_nemotron_h_config_maps_mlp_and_moe_layers_to_stateless():
    spec = spec_from_hf_config(NEMOTRON_H)
    assert [layer.kind for layer in spec.layers] == ["recurrent", "stateless", "recurrent", "full", "stateless",
                                                     "stateless"]
    assert spec.groups == ((0, 2), (3,)) and spec.layers[0].recurrent_type == "mamba2"


def test_kv_sharing_shrinks_to_a_tiny_config_transformers_accepts():
    """Gemma-3n's last layers read the K/V of the last earlier layer of their type. Cutting its
    35-layer pattern to 4 layers as a whole left only sliding layers before 15 shared ones, which
    transformers refuses; each part is shrunk on its own, the shared part scaled."""
    from kvbridge.proofs.model_sweep import _shrink_kv_sharing, tiny_config

    pattern = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    shared, types = _shrink_kv_sharing(pattern, 15, 4)
    assert shared == 2 and sorted(set(types[:2])) == sorted(set(types[2:])) == ["full_attention", "sliding_attention"]
    assert _shrink_kv_sharing(["full_attention"] * 4, 3, 1) == (0, ["full_attention"])  # no room for a producer
    config = tiny_config("gemma3n_text")
    assert config.num_kv_shared_layers == 2 and config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    spec = spec_from_hf_config(config.to_dict(), view="transformers", warn=False)
    assert [x.kind for x in spec.layers] == [{"full_attention": "full", "sliding_attention": "sliding"}[t]
                                             for t in config.layer_types[:2]] + ["stateless", "stateless"]


def test_a_model_whose_every_layer_reads_another_models_kv_is_refused_saying_so():
    """Gemma-4 assistants (draft models) read their target's K/V in every layer: the library, not the
    sweep, says so in one line."""
    from transformers import Gemma4TextConfig
    config = Gemma4TextConfig(num_hidden_layers=4, num_kv_shared_layers=4, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                              hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"] * 2)
    with pytest.raises(ConfigError, match=r"layers 0-3 of 'gemma4_text' all read another model's K/V") as e:
        spec_from_hf_config(config.to_dict(), view="transformers", warn=False)
    assert "\n" not in str(e.value)
