"""kvbridge's vLLM state pages against vLLM 0.32's own state shapes, rank by rank.

`vllm_mamba_shapes_probe.py` runs in .venv-vllm and reports, from `MambaStateShapeCalculator`
and `MambaSpec.page_size_bytes`, the per-rank state tensors of Mamba2, Mamba1, gated delta net,
KDA, short conv and lightning attention layers at several TP sizes (groups fewer than ranks
included: vLLM then replicates groups, as kvbridge does). Here kvbridge's description of the same
geometry (`models.recurrent`, vLLM's conv row order by `vllm_conv_rows`, laid out by
`VllmCpuLayout`, which the hybrid connector uses on CPU and which vLLM's MambaSpec makes the same
on GPU) must give every rank the same tensors in the same place: conv row r at r x the row's
bytes, holding exactly vLLM's row; the temporal state right after the conv state, unpadded; and
the page vLLM computes. (Inside a head, vLLM keeps a gated delta net state as [v_dim, k_dim],
transformers as [k_dim, v_dim]: kvbridge moves whole heads, so two vLLM engines agree byte for
byte; the proof against transformers covers transformers' order.)
"""

from __future__ import annotations

import math

import pytest

from kvbridge.core.spec import LayerSpec, ModelSpec
from kvbridge.integrations.vllm.layout import VllmCpuLayout, vllm_conv_rows
from kvbridge.models import recurrent

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def probe(run_probe) -> dict:
    return run_probe("vllm_mamba_shapes_probe.py")


def kvbridge_layer(kind: str, g: dict) -> LayerSpec:
    """The layer as kvbridge's config path describes it (engine view: kernel - 1 conv rows)."""
    rows = g.get("kernel", 1) - 1
    if kind == "mamba2":
        cfg = dict(mamba_n_heads=g["heads"], mamba_d_head=g["head_dim"], n_groups=g["groups"], ssm_state_size=g["state"])
        state = recurrent.mamba2_state(cfg, rows, None)
    elif kind == "mamba1":
        state = recurrent.mamba1_state(dict(intermediate_size=g["intermediate"], state_size=g["state"]), rows, None)
    elif kind == "gdn":
        cfg = dict(linear_num_key_heads=g["k_heads"], linear_num_value_heads=g["v_heads"],
                   linear_key_head_dim=g["k_dim"], linear_value_head_dim=g["v_dim"])
        state = recurrent.gdn_state(cfg, rows, None)
    elif kind == "kda":
        state = recurrent.kda_state(dict(linear_num_heads=g["heads"], linear_head_dim=g["head_dim"]), rows, None)
    elif kind == "short_conv":
        state = recurrent.short_conv_state(dict(hidden_size=g["hidden"]), rows)
    else:
        return LayerSpec("recurrent", state=recurrent.lightning_state(
            dict(num_attention_heads=g["heads"], head_dim=g["head_dim"]), None), recurrent_type="lightning")
    return LayerSpec("recurrent", state=state, recurrent_type=kind, conv_rows=rows)


def test_every_rank_holds_vllms_state_tensors_in_vllms_order(probe):
    assert probe["vllm_version"].startswith("0.32") and probe["conv_state_layout"] == "SD"
    kinds = set()
    for case in probe["cases"]:
        kind, tp, shapes = case["kind"], case["tp"], [tuple(s) for s in case["shapes"]]
        spec = vllm_conv_rows(ModelSpec((kvbridge_layer(kind, case["geometry"]),), "float32", kind))
        layer = spec.layers[0]
        layout = VllmCpuLayout(tp_size=tp, block_size=16, num_blocks=4, kv_order="HND", kv_placement="blocks_first",
                               layer_placement="per_layer")
        for rank in range(tp):
            addr = layout.addressing(spec, rank)
            comps = [(c.name, int(addr.base[0, ci]), int(addr.heads[0, ci] * addr.row_bytes[0, ci]))
                     for ci, c in enumerate(layer.state)]
            where = (kind, case["geometry"], tp, rank, comps, shapes)
            conv = [x for x in comps if x[0].startswith("conv")]
            at = 0
            if layer.conv_rows:
                rows, width = shapes[0]  # SD: [kernel - 1, local conv channels]
                assert rows == layer.conv_rows, where
                for r in range(rows):  # row r: its components back to back, exactly vLLM's row
                    row = [x for x in conv if x[0].endswith(f"@{r}")]
                    assert [b for _, b, _ in row] == [at + sum(n for _, _, n in row[:i]) for i in range(len(row))], where
                    assert sum(n for _, _, n in row) == width * 4, where
                    at += width * 4
                assert sum(n for _, _, n in conv) == math.prod(shapes[0]) * 4, where
            temporal = [x for x in comps if not x[0].startswith("conv")]
            if len(shapes) == (2 if layer.conv_rows else 1):
                (name, base, nbytes), = temporal
                assert base == at and nbytes == math.prod(shapes[-1]) * 4, where  # right after the conv, unpadded
                at += nbytes
            else:
                assert not temporal, where
            assert at == case["page_bytes"] == sum(n for _, _, n in comps), where
        kinds.add(kind)
    assert kinds == {"mamba2", "mamba1", "gdn", "kda", "short_conv", "lightning"}
