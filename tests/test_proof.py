"""`prove_cache`, the proof every demo calls, on caches written straight into decode ranks.

No plan or transport here: the prefill cache is exported into the decode engine's ranks
directly, so every finding is the proof's own. Each check that passes on a clean cache is shown
to fail on a cache that is wrong in the way it is meant to catch.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvbridge.core.layout import EngineLayout
from kvbridge.errors import InvalidRequest
from kvbridge.proofs.hf_cache import export_cache
from kvbridge.proofs.local_demo import DemoResult
from kvbridge.proofs.proof import CacheProof, greedy_config, make_prompt_ids, prefill, prove_cache, reference_tokens
from kvbridge.proofs.tiny_models import load_model, spec_for
from kvbridge.proofs.verify import random_bytes
from kvbridge.transport.cache import RankCache

pytestmark = pytest.mark.oracle


def _decode_ranks(name: str, n: int, cached: int, tp: int = 2, seed: int = 0):
    """A model, a prompt of `n` ids and TP=`tp` decode ranks holding its first `cached` tokens."""
    model, config = load_model(name, seed)
    model.generation_config = greedy_config()
    spec = spec_for(config)
    ids = make_prompt_ids(n, config.vocab_size, seed)
    layout = EngineLayout(tp_size=tp, block_size=8, num_blocks=2 * math.ceil(n / 8) + 1)
    ranks = RankCache.allocate_engine(spec, layout, fill=None)
    random_bytes(ranks, seed + 1)
    need = math.ceil(cached / layout.block_size)
    block_ids = tuple(tuple(random.Random(seed).sample(range(layout.num_blocks), need)) for _ in spec.groups)
    cache, first = prefill(model, ids[:cached])
    export_cache(cache, spec, ranks, block_ids, cached)
    return model, ids, ranks, block_ids, first


def _negate_row(rc: RankCache, block_ids, layer: int, comp: int, position: int) -> None:
    ids, pos = np.asarray(block_ids[0]), np.array([position])
    rows = rc.read_tokens(layer, comp, ids, pos)
    rc.write_tokens(layer, comp, ids, pos, -rows)


def test_whole_prompt_with_first_token_proves() -> None:
    model, ids, ranks, block_ids, first = _decode_ranks("tiny-llama-mqa", 20, 20)
    proof = prove_cache(model, ids, ranks, block_ids, 5, first_token=first)
    assert proof.match and proof.cache_equal and proof.replicas_equal, proof
    assert proof.tokens_disaggregated == reference_tokens(model, ids, 5) and len(proof.tokens_reference) == 5


def test_prefix_cache_continues_through_the_rest_of_the_prompt() -> None:
    """A cache of 16 of 21 prompt tokens: generate computes the other 5, then decodes."""
    model, ids, ranks, block_ids, _ = _decode_ranks("tiny-gemma2", 21, 16)
    proof = prove_cache(model, ids, ranks, block_ids, 4, num_cached=16)
    assert proof.match and proof.cache_equal and proof.replicas_equal, proof
    with pytest.raises(InvalidRequest, match="first token follows the whole prompt"):
        prove_cache(model, ids, ranks, block_ids, 4, num_cached=16, first_token=1)


def test_without_first_token_there_is_nothing_to_continue() -> None:
    model, ids, ranks, block_ids, _ = _decode_ranks("tiny-llama", 12, 12)
    proof = prove_cache(model, ids, ranks, block_ids, 3)
    assert proof.tokens_disaggregated == [] and not proof.match and proof.cache_equal


def test_wrong_first_token_fails_on_tokens() -> None:
    model, ids, ranks, block_ids, first = _decode_ranks("tiny-llama", 12, 12)
    proof = prove_cache(model, ids, ranks, block_ids, 3, first_token=(first + 1) % 256)
    assert proof.cache_equal and not proof.match


def test_a_negated_row_fails_the_cache_and_a_bad_replica_fails_replicas() -> None:
    model, ids, ranks, block_ids, first = _decode_ranks("tiny-llama-mqa", 20, 20)
    _negate_row(ranks[1], block_ids, 0, 0, 5)  # the one KV head is on both ranks; import reads rank 0
    proof = prove_cache(model, ids, ranks, block_ids, 3, first_token=first)
    assert proof.cache_equal and proof.replica_mismatches == ["layer 0 comp 0 head 0: rank 1 differs from rank 0"]
    _negate_row(ranks[0], block_ids, 1, 1, 7)
    proof = prove_cache(model, ids, ranks, block_ids, 3, first_token=first)
    assert proof.cache_differences == ["layer 1 values: 16 of 320 elements differ"]  # one row of head_dim 16


def test_reference_cache_is_what_is_compared() -> None:
    model, ids, ranks, block_ids, first = _decode_ranks("tiny-llama", 12, 12)
    other, _ = prefill(model, [(t + 1) % 256 for t in ids])
    proof = prove_cache(model, ids, ranks, block_ids, 2, reference_cache=other, first_token=first)
    assert not proof.cache_equal and proof.match


def test_cached_token_count_is_checked() -> None:
    model, ids, ranks, block_ids, first = _decode_ranks("tiny-llama", 12, 12)
    for bad in (0, 13):
        with pytest.raises(InvalidRequest, match="must hold 1 to 12"):
            prove_cache(model, ids, ranks, block_ids, 2, num_cached=bad)


def test_proof_fields_are_the_decode_job_reply() -> None:
    import msgspec
    proof = CacheProof([1, 2], [1, 2], [], [])
    assert msgspec.structs.asdict(proof) == {"tokens_reference": [1, 2], "tokens_disaggregated": [1, 2],
                                             "cache_differences": [], "replica_mismatches": []}


def test_demo_result_json_keys_end_with_ok() -> None:
    r = DemoResult(model="m", spec="s", prefill="p", decode="d", prompt_len=3, new_tokens=1, tokens_reference=[1],
                   tokens_disaggregated=[1], match=True, cache_equal=True, replicas_equal=False, bytes_moved=1,
                   num_runs=1, transfer_seconds=0.0, plan_seconds=0.0)
    keys = list(r.to_dict())
    assert keys[:4] == ["model", "spec", "prefill", "decode"] and keys[-5:] == ["num_cached_tokens", "kv_conversion", "conversion_mismatches", "elements_checked", "ok"]
    assert not r.ok and r.summary().startswith("MISMATCH: m prefill [p] -> decode [d]")


def test_the_token_by_token_rest_of_a_prompt_is_at_its_positions_and_continues_the_returned_cache(monkeypatch):
    """Where a multi-token forward does not continue from a cache (Mamba1 mixers), the proof feeds
    the rest of the prompt one token at a time. Those steps gave no `position_ids`, so a RoBERTa
    decoder put them at its padding-offset positions (K/V 0.34 off a plain prefill's; its tokens
    can still agree, so the proof could pass on a wrong cache), and they ignored a cache the
    model returned instead of updating the given one (issue 43, noted and left)."""
    import copy

    import torch
    from transformers import RobertaConfig, RobertaForCausalLM

    from kvbridge.proofs import proof

    torch.manual_seed(0)
    model = RobertaForCausalLM(RobertaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=64, max_position_embeddings=64, is_decoder=True,
                                             pad_token_id=1)).eval()
    ids = [int(x) for x in torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(1))]
    full, _ = prefill(model, ids[:19])
    prefix, _ = prefill(model, ids[:8])
    monkeypatch.setattr(proof, "_continues_in_chunks", lambda *a, **k: False)  # the Mamba1 path
    given = {}
    monkeypatch.setattr(model, "generate", lambda input_ids, **kw: given.update(kw) or torch.cat(
        [input_ids, torch.zeros(1, 2, dtype=torch.long)], 1))
    proof.continue_greedy(model, ids, copy.deepcopy(prefix), 8, 2)
    stepped = given["cache"] if "cache" in given else given["past_key_values"]
    assert stepped.get_seq_length() == 19
    for i in range(2):
        assert torch.allclose(stepped.layers[i].keys, full.layers[i].keys, atol=1e-5)
        assert torch.allclose(stepped.layers[i].values, full.layers[i].values, atol=1e-5)

    class Returns(torch.nn.Module):  # a model that returns a new cache object at every step
        device = torch.device("cpu")

        def forward(self, input_ids, past_key_values=None, use_cache=True, position_ids=None):
            return type("Out", (), {"past_key_values": past_key_values + [int(position_ids[0, 0])]})()

    assert proof._step_through(Returns(), ids, 8, 12, {"past_key_values": []}) == {"past_key_values": [8, 9, 10, 11]}
