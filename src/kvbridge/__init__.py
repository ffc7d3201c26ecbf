"""kvbridge: move LLM KV caches between inference engines of any shape, byte-exact.

The names below load on first use, so `import kvbridge` (and the pure-numpy core under
`kvbridge.core`) stays fast and free of torch and numba.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbridge._lazy import lazy_exports
from kvbridge.errors import ConfigError, IncompatibleEngines, InvalidRequest, KVBridgeError, ShardingError

from kvbridge._version import __version__

_EXPORTS = {
    "Addressing": "kvbridge.core.layout", "EngineLayout": "kvbridge.core.layout",
    "LayerSpec": "kvbridge.core.spec", "ModelSpec": "kvbridge.core.spec",
    "Plan": "kvbridge.core.plan", "PlanStats": "kvbridge.core.plan", "Request": "kvbridge.core.plan",
    "plan_request": "kvbridge.core.plan",
    "spec_from_hf_config": "kvbridge.models.config",
    "RankCache": "kvbridge.transport.cache",
    "LocalExecutor": "kvbridge.transport.local", "execute_plan": "kvbridge.transport.local",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from kvbridge.core.layout import Addressing, EngineLayout
    from kvbridge.core.plan import Plan, PlanStats, Request, plan_request
    from kvbridge.core.spec import LayerSpec, ModelSpec
    from kvbridge.models.config import spec_from_hf_config
    from kvbridge.transport.cache import RankCache
    from kvbridge.transport.local import LocalExecutor, execute_plan

__all__ = ["ConfigError", "IncompatibleEngines", "InvalidRequest", "KVBridgeError", "ShardingError",
           "__version__", *_EXPORTS]
