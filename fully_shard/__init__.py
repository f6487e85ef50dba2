"""fully_shard: FSDP2 (ZeRO-3) on DTensor. Public API only; see README.md and design/."""

from __future__ import annotations

from . import checkpoint
from .comm.trace import EventKind, Phase
from .core.api import fully_shard
from .core.init import default_init, materialize_meta_module
from .core.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
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
from .tools.profile import Profiler, profile
from .wrap.plan import (
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

__all__ = [
    "AllGatherPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "EventKind",
    "FSDPModule",
    "GranularityPolicy",
    "MixedPrecisionPolicy",
    "ModuleClassPolicy",
    "OffloadPolicy",
    "ParamCountPolicy",
    "Phase",
    "PredicatePolicy",
    "Profiler",
    "QuantizedAllGather",
    "ShardingStrategy",
    "UnitReport",
    "UnshardHandle",
    "WrapPlan",
    "auto_wrap",
    "checkpoint",
    "clip_grad_norm_",
    "default_init",
    "fully_shard",
    "materialize_meta_module",
    "plan_wrap",
    "profile",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "strategy_kwargs",
    "total_grad_norm",
]
