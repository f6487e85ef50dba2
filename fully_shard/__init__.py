"""fully_shard: FSDP2 (ZeRO-3) on DTensor. Public API only; see README.md and design/overview.md.

The core (``fully_shard``, ``FSDPModule``, policies, clipping) is imported here; the applications on it
(``checkpoint``, the profiler, the wrap planner, ``ft``) are imported on first use of their names, so
``import fully_shard`` loads neither safetensors, the tools nor torchft.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import optim  # noqa: F401  (registers the local-shard optimizer step with the core (optim/__init__.py))
from .comm.trace import EventKind, Phase
from .core.api import fully_shard
from .core.finalize import GradientReductionHandle
from .core.init import default_init, materialize_meta_module
from .core.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .core.placement import ShardPlacement
from .core.policy import (
    AllGatherPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizedAllGather,
    ShardingStrategy,
)
from .optim.clip import clip_grad_norm_, total_grad_norm
from .parallel.mesh import DataParallelMeshDims

if TYPE_CHECKING:
    from . import checkpoint, ft
    from .tools.profile import Profiler, profile
    from .wrap import (
        FullyShardedDataParallel,
        GranularityPolicy,
        ModuleClassPolicy,
        ParamCountPolicy,
        PredicatePolicy,
        UnitReport,
        WrapPlan,
        auto_wrap,
        plan_wrap,
        strategy_kwargs,
    )
    from .wrap.fsdp1 import (
        BackwardPrefetch,
        CPUOffload,
        FullOptimStateDictConfig,
        FullStateDictConfig,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictSettings,
        StateDictType,
    )

# FSDP1's option types (wrap/fsdp1/options.py), beside the existing ShardingStrategy
_FSDP1_NAMES = ("BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig",
                "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision", "ShardedOptimStateDictConfig",
                "ShardedStateDictConfig", "StateDictSettings", "StateDictType")

# name -> the module that defines it, imported on first access (PEP 562)
_LAZY = {
    "checkpoint": "fully_shard.checkpoint", "ft": "fully_shard.ft",
    "Profiler": "fully_shard.tools.profile", "profile": "fully_shard.tools.profile",
    **{name: "fully_shard.wrap" for name in (
        "GranularityPolicy", "ModuleClassPolicy", "ParamCountPolicy", "PredicatePolicy", "UnitReport", "WrapPlan",
        "auto_wrap", "plan_wrap", "strategy_kwargs", "FullyShardedDataParallel")},
    **{name: "fully_shard.wrap.fsdp1" for name in _FSDP1_NAMES},
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'fully_shard' has no attribute {name!r}")
    module = importlib.import_module(target)
    value = module if name in ("checkpoint", "ft") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AllGatherPolicy",
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "EventKind",
    "FSDPModule",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "GradientReductionHandle",
    "GranularityPolicy",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "ModuleClassPolicy",
    "OffloadPolicy",
    "ParamCountPolicy",
    "Phase",
    "PredicatePolicy",
    "Profiler",
    "QuantizedAllGather",
    "ShardPlacement",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictSettings",
    "StateDictType",
    "UnitReport",
    "UnshardHandle",
    "WrapPlan",
    "auto_wrap",
    "checkpoint",
    "clip_grad_norm_",
    "default_init",
    "ft",
    "fully_shard",
    "materialize_meta_module",
    "plan_wrap",
    "profile",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "strategy_kwargs",
    "total_grad_norm",
]
