"""Differential probe, run with .venv-vllm's python: vLLM's own topology code vs kvbridge's.

For every case of a grid (local TP, remote TP, KV heads or MLA, local rank) it asks vLLM 0.32's
`kv_connector.utils.TransferTopology` and `v1.nixl.tp_mapping.compute_tp_mapping` and kvbridge's
`TransferTopology` the same questions, and prints one JSON object (vLLM's answers, kvbridge's
answers, or the exception each raised). `tests/vllm/test_vllm_topology.py` compares them.

Perspective, as in vLLM's pull connector: the *local* engine is the decode engine, the *remote*
engine the prefill engine it reads from.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import sys


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def vllm_answers(L: int, R: int, H: int, mla: bool, rank: int) -> dict:
    from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo, TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    heads = 1 if mla else H
    topo = TransferTopology(tp_rank=rank, tp_size=L, block_size=32, engine_id="decode", is_mla=mla,
                            is_mamba=False, total_num_kv_heads=heads, attn_backends=[])
    out: dict = {"local_replicates_kv_cache": topo.local_replicates_kv_cache}
    try:
        out["tp_ratio"] = topo.tp_ratio(R)
    except AssertionError as e:
        out["tp_ratio_error"] = _err(e)
        return out  # every other answer of vLLM goes through tp_ratio
    topo.register_remote_engine("prefill", EngineTransferInfo(remote_tp_size=R, remote_block_len=4096,
                                                              remote_block_size=32,
                                                              remote_physical_blocks_per_logical=1))
    out["is_kv_replicated"] = topo.is_kv_replicated("prefill")
    out["replicates_kv_cache"] = topo.replicates_kv_cache("prefill")
    out["handshake_target_ranks"] = list(topo.handshake_target_ranks(R))
    out["target_remote_ranks"] = list(topo.target_remote_ranks("prefill"))
    # NixlConnectorWorker._validate_remote_agent_handshake: "num_kv_heads > tp_size with P_TP > D_TP
    # not supported for non-mamba" -- the same predicates, evaluated here without a NIXL worker.
    out["handshake_rejected"] = (not mla) and out["tp_ratio"] < 0 and out["is_kv_replicated"]
    spec_type = MLAAttentionSpec if mla else FullAttentionSpec
    mapping = compute_tp_mapping(topo, R, (spec_type,))
    out["source_ranks"] = sorted(mapping.all_source_ranks)
    out["local_consumers"] = mapping.local_consumers
    # The heads each source rank is read for (pull_worker / base_worker descriptor math):
    # D >= P reads `local heads` at rank_offset_factor * local block len inside the source rank's
    # block; D < P reads each source rank's whole block into slot rank_to_attention_slot.
    slices = []
    lh, rh = max(1, heads // L), max(1, heads // R)
    for s in mapping.source_ranks_per_group[0]:
        first = s * heads // R
        if mla:
            slices.append([s, 0, 1])
        elif L >= R:
            start = first + mapping.rank_offset_factor * lh
            slices.append([s, start, start + lh])
        else:
            slices.append([s, first, first + rh])
    out["head_slices"] = sorted(slices)
    return out


def kvbridge_answers(L: int, R: int, H: int, mla: bool, rank: int) -> dict:
    from kvbridge.errors import KVBridgeError
    from kvbridge.core.layout import EngineLayout
    from kvbridge.core.shard import head_range, holders
    from kvbridge.core.spec import ModelSpec
    from kvbridge.core.topology import TransferTopology

    spec = ModelSpec.uniform(2, 1 if mla else H, 64, "float32", kinds=("mla",) if mla else None)
    topo = TransferTopology("decode", spec, EngineLayout(tp_size=L, block_size=32), rank)
    topo.register_remote_engine("prefill", EngineLayout(tp_size=R, block_size=32))
    out: dict = {"local_replicates_kv_cache": topo.local_replicates_kv_cache}
    try:
        out["tp_ratio"] = topo.tp_ratio("prefill")
    except KVBridgeError as e:
        out["tp_ratio_error"] = _err(e)
    out["is_kv_replicated"] = topo.is_kv_replicated("prefill")
    out["replicates_kv_cache"] = topo.replicates_kv_cache("prefill")
    out["handshake_target_ranks"] = list(topo.handshake_target_ranks("prefill"))
    out["source_ranks"] = list(topo.attention_source_ranks("prefill"))
    out["head_slices"] = sorted([list(s) for s in topo.head_slices("prefill")])
    # What the producer side counts: the decode ranks that read from each prefill rank.
    readers = []
    for p in range(R):
        ptopo = TransferTopology("prefill", spec, EngineLayout(tp_size=R, block_size=32), p)
        ptopo.register_remote_engine("decode", EngineLayout(tp_size=L, block_size=32))
        readers.append(len(ptopo.reader_ranks("decode")))
    out["readers_per_source_rank"] = readers
    # Is the read set a valid plan? Every head this rank holds, read once, from a rank holding it.
    heads = 1 if mla else H
    want = head_range(heads, L, rank, mla)
    covered = []
    ok = True
    for s, a, b in out["head_slices"]:
        covered.extend(range(a, b))
        ok &= all(s in holders(heads, R, h, mla) for h in range(a, b))
    out["plan_valid"] = bool(ok and sorted(covered) == list(range(*want)))
    return out


def cases() -> list[tuple[int, int, int, bool]]:
    sizes = (1, 2, 4, 8, 16)
    grid = [(L, R, H, False) for L in sizes for R in sizes for H in sizes]
    grid += [(L, R, 1, True) for L in sizes for R in sizes]
    # Beyond vLLM: non-divisible TP pairs that shard 6 or 12 KV heads on both sides.
    grid += [(L, R, H, False) for H in (6, 12) for L in (2, 3, 4, 6) for R in (2, 3, 4, 6)
             if L % R and R % L and H % L == 0 and H % R == 0]
    return grid


def main() -> None:
    from vllm import __version__ as vllm_version
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping

    rows = []
    for L, R, H, mla in cases():
        for rank in range(L):
            row = {"local_tp": L, "remote_tp": R, "heads": H, "mla": mla, "rank": rank}
            for side, fn in (("vllm", vllm_answers), ("kvbridge", kvbridge_answers)):
                try:
                    row[side] = fn(L, R, H, mla, rank)
                except Exception as e:  # noqa: BLE001 - reported, the test decides
                    row[side] = {"error": _err(e)}
            rows.append(row)
    print(json.dumps({
        "vllm_version": vllm_version,
        "signatures": {"TransferTopology": str(inspect.signature(TransferTopology)),
                       "compute_tp_mapping": str(inspect.signature(compute_tp_mapping))},
        "rows": rows,
    }))


if __name__ == "__main__":
    with contextlib.redirect_stdout(io.StringIO()) as noise:  # vLLM prints at import
        import vllm  # noqa: F401
    sys.stderr.write(noise.getvalue())
    main()
