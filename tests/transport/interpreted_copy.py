"""Run by test_copy_cuda.py in a subprocess with TRITON_INTERPRET=1: the CUDA copy kernel,
interpreted on CPU tensors, executes random legal plans (`kvbridge verify --all-axes` cases) and
every destination byte is compared with the reference. Prints 'cases N runs R pieces P'."""

from __future__ import annotations

import random
import sys

from kvbridge.proofs.verify import mismatch_report, prepare_case, random_case
from kvbridge.transport import copy_cuda
from kvbridge.transport.local import LocalExecutor


def main(cases: int, seed: int) -> int:
    kernel = copy_cuda._kernel()
    assert kernel is not None and type(kernel).__name__ == "InterpretedFunction", type(kernel)
    copy_cuda.BLOCK = 2  # tiny steps: the random cases' runs (8-128 B) are cut into many pieces
    rng, runs, pieces = random.Random(seed), 0, 0
    for i in range(cases):
        spec, src, dst, request = random_case(rng, all_axes=True)
        s, d, expected, plan = prepare_case(spec, src, dst, request, seed=2 * i)
        executor = LocalExecutor(s, d)
        if plan.needs_conversion:  # conversions are torch's (convert.py): only the byte copies are the kernel's
            continue
        prepared = copy_cuda.prepare(*executor.addresses(*executor.global_regions(plan), plan), s[0].regions[0].device)
        copy_cuda.launch(prepared, kernel)
        bad = mismatch_report(d, expected)
        if bad:
            print(f"case {i} {src.describe()} -> {dst.describe()}: {bad[0]}")
            return 1
        runs, pieces = runs + len(plan), pieces + len(prepared)
    print(f"cases {cases} runs {runs} pieces {pieces}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
