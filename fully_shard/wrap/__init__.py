"""FSDP1-style front end: ShardingStrategy -> fully_shard arguments, wrap policies, auto_wrap with a wrap plan,
and FSDP1's ``FullyShardedDataParallel`` class with torch-style auto-wrap policies (``fsdp1/``)."""

from __future__ import annotations

from .fsdp1 import (
    CustomPolicy,
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)
from .plan import ROOT, UnitReport, WrapPlan, auto_wrap, plan_wrap
from .policies import GranularityPolicy, ModuleClassPolicy, ParamCountPolicy, PredicatePolicy, WrapPolicy
from .strategy import strategy_kwargs

__all__ = ["ROOT", "CustomPolicy", "FullyShardedDataParallel", "GranularityPolicy", "ModuleClassPolicy",
           "ModuleWrapPolicy", "ParamCountPolicy", "PredicatePolicy", "UnitReport", "WrapPlan", "WrapPolicy",
           "always_wrap_policy", "auto_wrap", "enable_wrap", "lambda_auto_wrap_policy", "plan_wrap",
           "size_based_auto_wrap_policy", "strategy_kwargs", "transformer_auto_wrap_policy", "wrap"]
