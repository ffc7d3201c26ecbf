"""What decode rank 0 does after the transfer: gather every rank's cache and prove it with a model.

The proof is the one `hf.run_demo` makes in one process, made here across processes: rebuild a
transformers `DynamicCache` from the decode engine's paged caches (rank 0's own, plus the
other ranks' region bytes gathered through the parent), compare it bit for bit with the cache a
monolithic forward pass produces, and continue greedy decoding from it. The tokens must equal a
monolithic `generate` on the same prompt. The reference runs in this process too, with the
same weights (built-in models are drawn from the seed) and one thread like every rank process,
so it is comparable bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvbridge.transport.cache import RankCache, TORCH_DTYPES
def gathered_caches(own: RankCache, others: dict[int, list[np.ndarray]]) -> list[RankCache]:
    """Rank 0's live cache plus the other ranks' caches rebuilt from their region bytes, in rank order."""
    spec, layout = own.spec, own.layout
    caches = {own.rank: own}
    dtype = TORCH_DTYPES[spec.dtype]
    for rank, regions in others.items():
        tensors = [torch.from_numpy(np.ascontiguousarray(r)).view(dtype) for r in regions]
        caches[int(rank)] = RankCache(spec, layout, int(rank), tensors)
    return [caches[r] for r in sorted(caches)]


@torch.inference_mode()
def run_decode_job(own: RankCache, job: dict[str, Any]) -> dict[str, Any]:
    """Per request: reference tokens, disaggregated tokens, cache and replica differences."""
    from transformers import GenerationConfig

    from kvbridge.proofs.hf import cache_differences, import_cache, load_model, replica_mismatches, save_cache

    model, config = load_model(job["model"], job["seed"])
    model.generation_config = GenerationConfig(do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=None,
                                               bos_token_id=None)
    caches = gathered_caches(own, job.get("others", {}))
    new_tokens = int(job["new_tokens"])
    out: dict[str, Any] = {}
    for i, req in enumerate(job["requests"]):
        ids = list(req["prompt_ids"])
        n = len(ids)
        block_ids = tuple(tuple(g) for g in req["block_ids"])
        input_ids = torch.tensor([ids], dtype=torch.long)
        reference = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens)
        tokens_reference = reference[0, n:].tolist()
        monolithic = model(input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True).past_key_values
        imported = import_cache(caches, block_ids, n, config)
        differences = cache_differences(monolithic, imported)
        replicas = replica_mismatches(caches, block_ids, n)
        if i == 0 and job.get("dump"):
            save_cache(imported, job["dump"])
        first = req.get("first_token")
        tokens: list[int] = [] if first is None else [int(first)]
        if first is not None and new_tokens > 1:
            cont = torch.cat([input_ids, torch.tensor([[int(first)]])], dim=1)
            rest = model.generate(cont, attention_mask=torch.ones_like(cont), past_key_values=imported,
                                  max_new_tokens=new_tokens - 1)
            tokens += rest[0, n + 1:].tolist()
        out[req["id"]] = {"tokens_reference": tokens_reference, "tokens_disaggregated": tokens,
                          "cache_differences": differences, "replica_mismatches": replicas}
    return out


__all__ = ["gathered_caches", "run_decode_job"]
