"""kvbridge: move LLM KV caches between inference engines of any shape, byte-exact."""

from kvbridge.errors import ConfigError, IncompatibleEngines, InvalidRequest, KVBridgeError, ShardingError
from kvbridge.layout import Addressing, EngineLayout, RankCache
from kvbridge.plan import Plan, PlanStats, Request, plan_request
from kvbridge.spec import LayerSpec, ModelSpec
from kvbridge.transport.local import LocalExecutor, execute_plan

__version__ = "0.1.0"

__all__ = [
    "Addressing", "ConfigError", "EngineLayout", "IncompatibleEngines", "InvalidRequest", "KVBridgeError",
    "LayerSpec", "LocalExecutor", "ModelSpec", "Plan", "PlanStats", "RankCache", "Request", "ShardingError",
    "execute_plan", "plan_request", "__version__",
]
