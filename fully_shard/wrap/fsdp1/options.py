"""FSDP1's option types (MixedPrecision, CPUOffload, StateDictType, configs...); torch's own objects read as ours.

Same names, fields and defaults as torch 2.13's ``torch.distributed.fsdp`` (api.py there). Code that keeps
its torch imports passes torch's objects: ``coerce`` reads an enum by member name and a config dataclass
field by field, so the class accepts either (design/fsdp1.md).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn as nn

from ...core.policy import ShardingStrategy

__all__ = ["BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig",
           "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision", "OptimStateDictConfig",
           "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy", "StateDictConfig",
           "StateDictSettings", "StateDictType", "coerce"]

# torch.nn's BatchNorm base (private): FSDP1 runs these modules in full precision under MixedPrecision
_BatchNorm: type = getattr(nn.modules.batchnorm, "_BatchNorm", nn.BatchNorm1d)


def _torch_twin(ours: object, other: object) -> bool:
    """``other`` is torch's FSDP1 object of the same name (``torch.distributed.fsdp``'s): a wrapper keeps
    this module's objects, and FSDP1 code compares them with torch's (torch's test_wrap:
    ``model.cpu_offload == CPUOffload(...)``, ``model.backward_prefetch == BackwardPrefetch.BACKWARD_POST``)."""
    kind = type(other)
    return kind.__name__ == type(ours).__name__ and kind.__module__.startswith("torch.distributed.fsdp")


class BackwardPrefetch(enum.Enum):
    """When FSDP1 issues the next unit's all-gather in backward. A scheduling hint here: every unit's
    backward all-gather is prefetched one unit ahead (as ``BACKWARD_PRE``) whatever the value. A member
    equals torch's member of the same name."""

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and _torch_twin(self, other):
            return self.name == other.name
        return self is other

    __hash__ = enum.Enum.__hash__


class StateDictType(enum.Enum):
    """What ``model.state_dict()`` returns under ``state_dict_type``: plain full tensors, DTensors, or
    each rank's local shards (plain tensors keyed by parameter FQN: there is no flat parameter)."""

    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass
class MixedPrecision:
    """FSDP1's mixed precision: ``param_dtype`` for compute and the all-gather, ``reduce_dtype`` for the
    gradient reduction (default ``param_dtype`` when that is set: FSDP1's rule, not fp32), ``buffer_dtype``
    for buffers during forward/backward (state dicts keep the original dtype). Gradients are cast back to
    the parameter dtype after the reduction. ``cast_root_forward_inputs`` casts the root's floating-point
    inputs to ``param_dtype``; ``cast_forward_inputs`` every unit's. Modules of
    ``_module_classes_to_ignore`` (BatchNorm) become their own units in full precision when an
    ``auto_wrap_policy`` is given, as in FSDP1."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)


def fsdp1_reduce_dtype(mp: MixedPrecision | None) -> torch.dtype | None:
    """The dtype gradients are reduced in under FSDP1's rule: ``reduce_dtype``, else ``param_dtype`` (set explicitly:
    torch 2.15's FSDP2 reads ``reduce_dtype=None`` as the parameter's original dtype, its FSDP1 does not)."""
    if mp is None:
        return None
    return mp.reduce_dtype if mp.reduce_dtype is not None else mp.param_dtype


@dataclass
class CPUOffload:
    """``offload_params=True``: sharded parameters, gradients and optimizer state live on the CPU. Equals
    torch's ``CPUOffload`` of the same ``offload_params``."""

    offload_params: bool = False

    def __eq__(self, other: object) -> bool:
        if type(other) is CPUOffload or _torch_twin(self, other):
            return bool(self.offload_params == getattr(other, "offload_params", None))
        return NotImplemented


@dataclass
class StateDictConfig:
    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: ranks other than 0 get an empty state dict (every rank still joins the gathers)."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """``_use_dtensor`` is accepted for torch's signature; the values are always DTensors here."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


CONFIG_OF = {StateDictType.FULL_STATE_DICT: FullStateDictConfig,
             StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
             StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig}
OPTIM_CONFIG_OF = {StateDictType.FULL_STATE_DICT: FullOptimStateDictConfig,
                   StateDictType.LOCAL_STATE_DICT: LocalOptimStateDictConfig,
                   StateDictType.SHARDED_STATE_DICT: ShardedOptimStateDictConfig}

T = TypeVar("T")


def coerce(value: Any, ours: type[T], what: str) -> T:
    """``value`` as this module's ``ours``: ours unchanged; torch's same-named enum by member name,
    torch's same-named config dataclass field by field. Anything else raises naming ``what``."""
    if isinstance(value, ours):
        return value
    if type(value).__name__ == ours.__name__:
        if issubclass(ours, enum.Enum) and isinstance(value, enum.Enum):
            if value.name in ours.__members__:
                return ours[value.name]  # type: ignore[no-any-return,index]
        elif dataclasses.is_dataclass(ours) and dataclasses.is_dataclass(value):
            names = {f.name for f in dataclasses.fields(ours)}
            return ours(**{f.name: getattr(value, f.name)  # type: ignore[call-arg]
                           for f in dataclasses.fields(value) if f.name in names})
    if issubclass(ours, enum.Enum):
        valid = ", ".join(f"{ours.__name__}.{n}" for n in ours.__members__)
        raise ValueError(f"{what}: expected one of {valid}, got {value!r}. Fix: pass a {ours.__name__} member "
                         f"(this library's or torch.distributed.fsdp's).")
    raise TypeError(f"{what}: expected a {ours.__name__}, got {type(value).__name__}: {value!r:.100}. Fix: pass "
                    f"{ours.__name__}(...) (this library's or torch.distributed.fsdp's).")


def coerce_config(value: Any, expected: type[T], what: str) -> T:
    """A state-dict config of exactly ``expected``'s kind (torch's or ours), as FSDP1 checks it."""
    if value is None:
        return expected()
    names = {cls.__name__ for cls in type(value).__mro__}
    if type(value).__name__ != expected.__name__ or not names & {"StateDictConfig", "OptimStateDictConfig"}:
        # torch's words first (its test_fsdp_state_dict matches them), then the fix
        raise RuntimeError(f"Expected {what} of type {expected.__name__} but got {type(value).__name__}: "
                           f"{what}: expected a {expected.__name__} for this state_dict_type. Fix: pass "
                           f"{expected.__name__}(...) or None for the default.")
    return coerce(value, expected, what)
