"""FSDP1-style front end: ShardingStrategy -> fully_shard arguments, wrap policies, auto_wrap with a wrap plan."""

from __future__ import annotations

from .plan import ROOT, UnitReport, WrapPlan, auto_wrap, plan_wrap
from .policies import GranularityPolicy, ModuleClassPolicy, ParamCountPolicy, PredicatePolicy, WrapPolicy
from .strategy import strategy_kwargs

__all__ = ["ROOT", "GranularityPolicy", "ModuleClassPolicy", "ParamCountPolicy", "PredicatePolicy", "UnitReport",
           "WrapPlan", "WrapPolicy", "auto_wrap", "plan_wrap", "strategy_kwargs"]
