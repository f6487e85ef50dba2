"""fully_shard: FSDP2 (ZeRO-3) on DTensor. Public API only; see README.md and design/."""

from __future__ import annotations

from . import checkpoint
from .api import fully_shard
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy
from .trace import EventKind, Phase

__all__ = [
    "CPUOffloadPolicy",
    "EventKind",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Phase",
    "ShardingStrategy",
    "UnshardHandle",
    "checkpoint",
    "fully_shard",
    "register_fsdp_forward_method",
]
