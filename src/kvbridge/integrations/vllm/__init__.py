"""kvbridge inside vLLM 0.32 (CPU): a KV connector and vLLM's cache layouts.

* `KVBridgeConnector` (`connector.py`, imports vLLM): name it in `--kv-transfer-config` with
  `"kv_connector_module_path": "kvbridge.integrations.vllm"`; see docs/vllm.md.
* `KVBridgePoolConnector` (`pool_connector.py`): a prefix cache in Mooncake Store that instances of
  any shape share (`kvbridge.pool`); alone or beside `KVBridgeConnector` in vLLM's MultiConnector.
* `VllmCpuLayout` (`layout.py`): vLLM CPU attention's paged cache as a kvbridge layout.
* `sidecar.py`: the process that moves the bytes for a vLLM worker.

The P/D demo and bench that start vLLM instances live beside the library, in `kvbridge.proofs.vllm`.
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

from kvbridge.integrations.vllm.layout import VllmCpuLayout, as_vllm_cpu, vllm_cpu_layout  # noqa: E402


def __getattr__(name: str) -> Any:
    if name in ("KVBridgeConnector", "KVBridgeMetadata"):  # vLLM's factory: getattr(module, kv_connector)
        from kvbridge.integrations.vllm import connector
        return getattr(connector, name)
    if name in ("KVBridgePoolConnector", "PoolMetadata"):
        from kvbridge.integrations.vllm import pool_connector
        return getattr(pool_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVBridgeConnector", "KVBridgePoolConnector", "VllmCpuLayout", "as_vllm_cpu", "vllm_cpu_layout"]
