"""kvbridge's TransferTopology against vLLM 0.32's own code, answer by answer.

`vllm_topology_probe.py` runs in .venv-vllm and asks vLLM's `kv_connector.utils.TransferTopology`
and `v1.nixl.tp_mapping.compute_tp_mapping` and kvbridge's `TransferTopology` the same questions
for local (decode) TP x remote (prefill) TP in {1, 2, 4, 8, 16}, KV heads in {1, 2, 4, 8, 16}
plus MLA, every local rank; and for non-divisible TP pairs that vLLM refuses. Here we compare.

Where vLLM refuses and kvbridge extends, the test asserts both: vLLM's refusal, and that
kvbridge's read set is a valid plan (every head this rank holds, read once, from a rank that
holds it):

* non-divisible TP pairs (3 -> 2, 4 -> 6, ...): vLLM's `tp_ratio` asserts divisibility;
  kvbridge keeps `tp_ratio` undefined (raises) but answers everything else and plans the pair;
* a replicated dense prefill engine with more ranks than the decode engine (P TP > KV heads and
  P TP > D TP): vLLM's NIXL worker refuses it at handshake (`_validate_remote_agent_handshake`:
  "num_kv_heads > tp_size with P_TP > D_TP not supported for non-mamba"); the probe evaluates
  that condition with vLLM's own predicates. kvbridge reads each head once from one replica.

One documented difference in what the prefill side counts: vLLM's decode rank notifies every
handshake target, so each prefill rank waits for `local_consumers` notifications, while
kvbridge's producer counts only the decode ranks that actually read from it
(`reader_ranks`): a prefill rank that GQA de-duplication leaves unread has none.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytestmark = pytest.mark.vllm

COMPARED = ("tp_ratio", "is_kv_replicated", "replicates_kv_cache", "local_replicates_kv_cache",
            "handshake_target_ranks", "source_ranks", "head_slices")


@pytest.fixture(scope="module")
def probe(run_probe) -> dict:
    return run_probe("vllm_topology_probe.py")


def _case(row: dict) -> str:
    kind = "MLA" if row["mla"] else f"{row['heads']} KV heads"
    return f"D TP {row['local_tp']} rank {row['rank']} <- P TP {row['remote_tp']}, {kind}"


def test_probe_ran_vllm_032_code(probe):
    assert probe["vllm_version"].startswith("0.32")
    assert "total_num_kv_heads" in probe["signatures"]["TransferTopology"]
    assert "group_spec_types" in probe["signatures"]["compute_tp_mapping"]
    sizes = {(r["local_tp"], r["remote_tp"], r["heads"], r["mla"]) for r in probe["rows"]}
    assert len(sizes) == 5 * 5 * 5 + 5 * 5 + 8  # dense grid, MLA grid, non-divisible pairs (2 for 6 heads, 6 for 12)


def test_every_answer_matches_vllm(probe):
    mismatches = []
    compared = Counter()
    for row in probe["rows"]:
        v, k = row["vllm"], row["kvbridge"]
        assert "error" not in v and "error" not in k, (_case(row), v, k)
        if "tp_ratio_error" in v:
            continue  # vLLM refuses the pair: see test_non_divisible_pairs
        for key in COMPARED:
            compared[key] += 1
            if v[key] != k[key]:
                mismatches.append(f"{_case(row)}: {key} vLLM {v[key]} kvbridge {k[key]}")
        # vLLM's target_remote_ranks is its handshake rule applied after registration.
        assert v["target_remote_ranks"] == v["handshake_target_ranks"]
        # The prefill side: readers per source rank equal vLLM's local_consumers.
        for s in v["source_ranks"]:
            if k["readers_per_source_rank"][s] != v["local_consumers"]:
                mismatches.append(f"{_case(row)}: P rank {s} readers kvbridge {k['readers_per_source_rank'][s]} "
                                  f"vLLM local_consumers {v['local_consumers']}")
    assert not mismatches, "\n".join(mismatches[:40])
    assert min(compared.values()) >= 5 * 5 * 5 * 5  # every divisible case, every rank, every answer


def test_kvbridge_plans_are_valid_everywhere(probe):
    bad = [_case(r) for r in probe["rows"] if not r["kvbridge"]["plan_valid"]]
    assert not bad, bad


def test_non_divisible_pairs(probe):
    rows = [r for r in probe["rows"] if r["local_tp"] % r["remote_tp"] and r["remote_tp"] % r["local_tp"]]
    assert rows
    for row in rows:
        v, k = row["vllm"], row["kvbridge"]
        assert "not divisible" in v["tp_ratio_error"], (_case(row), v)
        assert v["tp_ratio_error"].startswith("AssertionError")
        assert "not divisible" in k["tp_ratio_error"] and "still plans" in k["tp_ratio_error"]
        assert k["plan_valid"], _case(row)
        assert set(k["source_ranks"]) <= set(k["handshake_target_ranks"]), _case(row)
    assert {r["local_tp"] for r in rows} == {r["remote_tp"] for r in rows} == {2, 3, 4, 6}


def test_replicated_prefill_larger_than_decode(probe):
    """vLLM's NIXL handshake refuses it for dense attention; kvbridge reads one replica per head."""
    rows = [r for r in probe["rows"] if r["vllm"].get("handshake_rejected")]
    assert rows
    for row in rows:
        assert not row["mla"] and row["remote_tp"] > row["local_tp"] and row["remote_tp"] > row["heads"]
        k = row["kvbridge"]
        assert k["plan_valid"], _case(row)
        assert len(k["source_ranks"]) == len({s[1] for s in k["head_slices"]}), _case(row)  # one rank per head
        assert k["source_ranks"] == row["vllm"]["source_ranks"]
    expected = {(L, R, H) for L in (1, 2, 4, 8, 16) for R in (1, 2, 4, 8, 16) for H in (1, 2, 4, 8, 16)
                if R > L and R > H}
    assert {(r["local_tp"], r["remote_tp"], r["heads"]) for r in rows} == expected


def test_unread_prefill_ranks_are_counted_differently(probe):
    """GQA de-duplication: vLLM notifies every handshake target; kvbridge counts actual readers."""
    row = next(r for r in probe["rows"] if (r["local_tp"], r["remote_tp"], r["heads"], r["mla"]) == (1, 4, 2, False))
    assert row["vllm"]["handshake_target_ranks"] == [0, 1, 2, 3]
    assert row["vllm"]["source_ranks"] == row["kvbridge"]["source_ranks"] == [0, 2]
    assert row["vllm"]["local_consumers"] == 1
    assert row["kvbridge"]["readers_per_source_rank"] == [1, 0, 1, 0]
