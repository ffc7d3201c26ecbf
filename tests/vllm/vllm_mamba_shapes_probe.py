"""Runs in .venv-vllm: what vLLM 0.32's own code says a recurrent layer's state page holds.

Prints JSON: per case (mixer kind, geometry, TP size), the per-rank state tensor shapes from
`MambaStateShapeCalculator` (conv in vLLM's default "SD" orientation, `get_conv_state_layout`)
and the page bytes of a float32 `MambaSpec` of those shapes.
"""

from __future__ import annotations

import json
import os

os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)  # vLLM's default orientation

import torch  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc, get_conv_state_layout  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

CASES = [  # (kind, geometry, tp sizes)
    ("mamba2", dict(heads=4, head_dim=32, groups=2, state=16, kernel=4), (1, 2, 4)),
    ("mamba2", dict(heads=8, head_dim=16, groups=1, state=8, kernel=3), (1, 2)),
    ("mamba2", dict(heads=8, head_dim=64, groups=8, state=128, kernel=4), (1, 2, 4, 8)),
    ("mamba1", dict(intermediate=256, state=16, kernel=4), (1, 2, 4)),
    ("gdn", dict(k_heads=2, v_heads=4, k_dim=32, v_dim=16, kernel=4), (1, 2)),
    ("gdn", dict(k_heads=16, v_heads=32, k_dim=128, v_dim=128, kernel=4), (1, 2, 4, 8)),
    ("kda", dict(heads=8, head_dim=32, kernel=4), (1, 2, 4)),
    ("short_conv", dict(hidden=128, kernel=3), (1, 2, 4)),
    ("lightning", dict(heads=8, head_dim=16), (1, 2, 4)),
]


def shapes(kind: str, g: dict, tp: int) -> tuple:
    if kind == "mamba2":
        return Calc.mamba2_state_shape(tp, g["heads"] * g["head_dim"], g["groups"], g["heads"], g["head_dim"],
                                       g["state"], g["kernel"])
    if kind == "mamba1":
        return Calc.mamba1_state_shape(tp, g["intermediate"], g["state"], g["kernel"])
    if kind == "gdn":
        return Calc.gated_delta_net_state_shape(tp, g["k_heads"], g["v_heads"], g["k_dim"], g["v_dim"], g["kernel"])
    if kind == "kda":
        return Calc.kda_state_shape(tp, g["heads"], g["head_dim"], conv_kernel_size=g["kernel"])
    if kind == "short_conv":
        return Calc.short_conv_state_shape(tp, g["hidden"], g["kernel"])
    return Calc.linear_attention_state_shape(g["heads"], tp, g["head_dim"])


def main() -> None:
    import vllm

    out = []
    for kind, geometry, tps in CASES:
        for tp in tps:
            s = tuple(tuple(int(x) for x in shape) for shape in shapes(kind, geometry, tp))
            page = MambaSpec(block_size=16, shapes=s, dtypes=(torch.float32,) * len(s)).page_size_bytes
            out.append({"kind": kind, "geometry": geometry, "tp": tp, "shapes": s, "page_bytes": page})
    print(json.dumps({"vllm_version": vllm.__version__, "conv_state_layout": str(get_conv_state_layout()),
                      "cases": out}))


if __name__ == "__main__":
    main()
