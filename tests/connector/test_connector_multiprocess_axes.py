"""The multi-process proof on PP and CP shapes: every rank of TP x PP x CP engines is its own process
and the bytes travel over shm, NIXL and Mooncake (issue 12: "over shm/NIXL/Mooncake").

Each case: tokens equal to monolithic `generate`, the rebuilt cache bit-exact, replicas equal,
every prefill rank (all stages and CP ranks) releases the request exactly once.
"""

from __future__ import annotations

import pytest
from connector_harness import require

from kvbridge.core.layout import EngineLayout
from kvbridge.proofs.connector_demo import run_multiprocess_demo

pytestmark = pytest.mark.oracle


def L(tp: int, block: int = 16, blocks: int = 32, **kw) -> EngineLayout:  # noqa: N802
    return EngineLayout(tp_size=tp, block_size=block, num_blocks=blocks, **kw)


CASES = {
    # PP on the prefill side only, uneven split, hybrid model (GDN state + attention), TP 2 -> 1, NHD decode
    "nixl-pull-qwen3next-P(tp2,pp2 split1,2)->D(tp1)": (
        "nixl", "pull", "tiny-qwen3-next", L(2, pp_size=2, layer_split=(1, 2)), L(1, 8, 64, kv_order="NHD")),
    # PCP on prefill, DCP + PP on decode, MLA
    "shm-pull-deepseek-P(pcp2)->D(tp2,dcp2,pp2)": (
        "shm", "pull", "tiny-deepseek-v3", L(1, pcp_size=2), L(2, dcp_size=2, pp_size=2)),
    # PP on both sides with different stage boundaries, push, sliding + full groups
    "mooncake-push-gemma2-P(tp2,pp2)->D(tp1,pp2 split 3,1)": (
        "mooncake", "push", "tiny-gemma2", L(2, pp_size=2), L(1, 8, 64, pp_size=2, layer_split=(3, 1))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pp_and_cp_over_real_transports(case: str) -> None:
    transport, mode, model, prefill, decode = CASES[case]
    if transport != "shm":
        require(transport)
    result = run_multiprocess_demo(transport, model, prompt_len=30, new_tokens=3, seed=5, prefill=prefill,
                                   decode=decode, mode=mode, timeout=300)  # ten rank processes on two cores
    d = result.to_dict()
    assert result.match and result.cache_equal and result.replicas_equal, result.cache_differences
    assert result.requests_ok == 1 and result.released_exactly_once, result.releases
    assert len(result.releases) == prefill.world_size  # every stage and CP rank took part
    assert result.processes == prefill.world_size + decode.world_size
    assert result.bytes_moved > 0 and result.bytes_measured == result.bytes_moved and d["ok"]


def test_a_peer_of_another_kv_dtype_is_refused_at_the_handshake() -> None:
    """The connector's transports move bytes: an fp8 decode against a float32 prefill is refused by name."""
    from kvbridge.connector.messages import HandshakeRefused
    with pytest.raises(HandshakeRefused, match="KV dtype differs"):
        run_multiprocess_demo("shm", "tiny-llama", prompt_len=12, new_tokens=2, prefill=L(1),
                              decode=L(2, kv_dtype="float8_e4m3fn"), timeout=30)
