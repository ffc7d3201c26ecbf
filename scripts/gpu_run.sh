#!/usr/bin/env bash
# One device-tool call runs every CUDA check (docs/gpu.md says how to prepare .gpu/site.tgz):
#   run: bash scripts/gpu_run.sh   carry: [".gpu"]
# Writes env.txt, gpu-check.jsonl, staging.jsonl, offload.jsonl and pytest.txt under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/gpu-out}"
mkdir -p /tmp/site "$OUT"
tar xzf .gpu/site.tgz -C /tmp/site || exit 2
export PYTHONPATH=/tmp/site:src
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
date -u | tee -a "$OUT/env.txt"
timeout 60 python3 -c "
import numpy as np, torch
from kvbridge.transport import copy_cuda
a = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device='cuda'); b = torch.zeros_like(a)
n = np.array([8, 24, 100000, 7], np.int64); so = np.array([0, 64, 1000, 3], np.int64); do = np.array([8, 512, 4096, 200000], np.int64)
copy_cuda.launch(copy_cuda.prepare(a.data_ptr() + so, b.data_ptr() + do, n, a.device)); torch.cuda.synchronize()
print('kernel smoke', all(torch.equal(a[s:s+k], b[d:d+k]) for s, d, k in zip(so, do, n)))
" 2>&1 | tail -20 | tee "$OUT/smoke.txt"
timeout 240 python3 scripts/gpu_check.py --device cuda --cases 150 2>&1 | tee "$OUT/gpu-check.jsonl"
timeout 60 python3 -c "
import json, msgspec
from kvbridge.bench.staging import bench_staging
for r in bench_staging(device='cuda', repeats=10, num_tokens=2048):
    print(json.dumps(msgspec.to_builtins(r)))
" 2>&1 | tee "$OUT/staging.jsonl"
timeout 90 python3 -c "
import json, msgspec
from kvbridge.bench.offload import bench_offload
for canonical in (False, True):
    for mode in ('kernel', 'memcpy'):
        r = bench_offload('llama-3-8b', num_tokens=4096, canonical=canonical, device='cuda', cuda_copy=mode)
        print(json.dumps(msgspec.to_builtins(r) if not hasattr(r, '__dataclass_fields__') else r.__dict__))
" 2>&1 | tee "$OUT/offload.jsonl"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cache_handles.py \
  tests/transport/test_transport_engines.py tests/offload/test_offload_worker.py -k "cuda or vram" 2>&1 | tee "$OUT/pytest.txt"
