"""FSDP1's front end: ``FullyShardedDataParallel`` and its option types and auto-wrap policies, on this library's units.

``module.py`` the class; ``options.py`` MixedPrecision, CPUOffload, BackwardPrefetch, StateDictType and the
configs (torch's accepted); ``policies.py`` torch-style auto-wrap policies and their targets; ``mesh.py``
strategy/process group/device mesh -> a unit's mesh; ``init.py`` meta materialization and
sync_module_states; ``state_dict.py`` the state-dict types; ``optim_state.py`` optimizer state dicts;
``summon.py`` summon_full_params. See design/fsdp1.md.
"""

from __future__ import annotations

from .module import FullyShardedDataParallel
from .options import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .policies import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = ["BackwardPrefetch", "CPUOffload", "CustomPolicy", "FullOptimStateDictConfig", "FullStateDictConfig",
           "FullyShardedDataParallel", "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision",
           "ModuleWrapPolicy", "OptimStateDictConfig", "ShardedOptimStateDictConfig", "ShardedStateDictConfig",
           "StateDictConfig", "StateDictSettings", "StateDictType", "always_wrap_policy", "enable_wrap",
           "lambda_auto_wrap_policy", "size_based_auto_wrap_policy", "transformer_auto_wrap_policy", "wrap"]
