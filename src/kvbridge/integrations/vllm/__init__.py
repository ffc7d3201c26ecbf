"""kvbridge inside vLLM 0.32 (CPU): a KV connector, a prefill/decode demo, a benchmark.

* `KVBridgeConnector` (`connector.py`, imports vLLM): name it in `--kv-transfer-config` with
  `"kv_connector_module_path": "kvbridge.integrations.vllm"`; see docs/vllm.md.
* `run_vllm_demo`, `bench_vllm` (`demo.py`, no vLLM import): start vLLM instances as
  subprocesses of the vLLM environment (`.venv-vllm`, `make vllm-env`), so they can be called
  from kvbridge's own environment (the CLI).
* `VllmCpuLayout` (`layout.py`): vLLM CPU attention's paged cache as a kvbridge layout.
"""

from __future__ import annotations

from typing import Any


def _llvmlite_vars_safe() -> None:
    """Let vLLM 0.32 CPU workers start in a process where numba (llvmlite) is imported.

    A CPU worker's `init_worker` rebinds Triton kernels by scanning every module namespace and
    calling `vars(value)` on each attribute (`vllm/triton_utils/dispatcher.py`,
    `_rebind_kernels`). llvmlite's lazy C-library wrapper (`llvmlite.binding.ffi.lib`) answers
    the `__dict__` lookup through its `__getattr__` with a *C function wrapper*, so the scan
    raises `AttributeError: '_lib_fn_wrapper' object has no attribute 'get'` and the worker
    fails to start ("WorkerProc failed to start"). kvbridge imports numba, so loading this
    connector triggers it. An empty `__dict__` entry in the wrapper's function table makes
    `vars(lib)` an empty dict; nothing else reads it.
    """
    try:
        import llvmlite.binding.ffi as ffi
    except ImportError:  # pragma: no cover - numba (and so llvmlite) is a kvbridge dependency
        return
    lib = getattr(ffi, "lib", None)
    table = getattr(lib, "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


_llvmlite_vars_safe()

from kvbridge.proofs.vllm.demo import bench_vllm, run_vllm_demo, vllm_python
from kvbridge.integrations.vllm.layout import VllmCpuLayout, as_vllm_cpu, vllm_cpu_layout
from kvbridge.proofs.vllm.model import make_tiny_llama


def __getattr__(name: str) -> Any:
    if name in ("KVBridgeConnector", "KVBridgeMetadata"):  # vLLM's factory: getattr(module, kv_connector)
        from kvbridge.integrations.vllm import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVBridgeConnector", "VllmCpuLayout", "as_vllm_cpu", "bench_vllm", "make_tiny_llama", "run_vllm_demo",
           "vllm_cpu_layout", "vllm_python"]
