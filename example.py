"""The library in one screen: plan a TP3 -> TP2 move of a Llama-style cache, run it, check it.

    .venv/bin/python example.py
"""

from kvbridge import EngineLayout, LocalExecutor, RankCache, Request, plan_request
from kvbridge.core.topology import TransferTopology
from kvbridge.core.integrity import verify_request
from kvbridge.models import spec_from_hf_config
from kvbridge.models.presets import PRESETS

spec = spec_from_hf_config(PRESETS["llama-3-8b"])  # or a config.json path / model directory
prefill = EngineLayout(tp_size=4, block_size=64, num_blocks=8, kv_order="NHD")
decode = EngineLayout(tp_size=2, block_size=16, num_blocks=32, kernel_block_size=16)

topo = TransferTopology("decode-0", spec, decode, tp_rank=0)  # vLLM's meanings, checked once, here
topo.register_remote_engine("prefill-0", prefill, spec)
print("decode rank 0 reads prefill ranks", topo.source_ranks("prefill-0"))

num_tokens = 200  # block ids per KV-cache group; a one-group model also takes a flat list
request = Request([3, 0, 7, 5], list(range(19, 32)), num_tokens)
plan = plan_request(spec, prefill, decode, request)
print(f"{len(plan.length)} runs, {int(plan.length.sum()) / 2**20:.1f} MiB")  # numpy run arrays

src = RankCache.allocate_engine(spec, prefill)
for cache in src:
    for region in cache.byte_regions():
        region.random_()
dst = RankCache.allocate_engine(spec, decode)
LocalExecutor(src, dst).execute(plan)
print("checksums differ on:", verify_request(src, dst, request) or "no rank")
