"""Frozen policy types users pass to fully_shard: mixed precision, offload, all-gather format, sharding
strategy, and the checks of a reshard_after_forward value and of what a quantized all-gather can do."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from .torch_version import at_least

# torch 2.15 changed what ``reduce_dtype=None`` means (its MixedPrecisionPolicy docstring, "versionchanged"):
# gradients follow the parameter's grad dtype (its original dtype) instead of ``param_dtype``
REDUCE_IN_ORIG_DTYPE = at_least(2, 15)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gather/compute (``param_dtype``), the gradient reduction (``reduce_dtype``)
    and module outputs (``output_dtype``).

    Same fields as torch's ``MixedPrecisionPolicy`` (torch 2.15's keyword-only ``param_dtype_override_fn``
    included); see design/mixed-precision.md. ``reduce_dtype=None`` follows the torch this runs on: the
    parameters' compute dtype before torch 2.15, their original dtype from 2.15 (``default_reduce_dtype``).
    ``param_dtype_override_fn(param)``, called once per managed parameter at ``fully_shard()``, returns
    None or ``param_dtype`` (the policy's) or the parameter's own dtype (kept in that dtype, e.g. norms or
    a router in fp32); anything else is torch's ``ValueError``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(default=None, kw_only=True)

    def param_dtype_of(self, param: nn.Parameter) -> torch.dtype | None:
        """``param``'s all-gather/compute dtype under this policy (None: its own dtype), calling
        ``param_dtype_override_fn`` once; torch 2.15's errors for a result it does not allow."""
        if self.param_dtype_override_fn is None:
            return self.param_dtype
        override = self.param_dtype_override_fn(param)
        if override is None:
            return self.param_dtype
        if not isinstance(override, torch.dtype):
            raise ValueError(f"param_dtype_override_fn must return a torch.dtype or None but got {type(override)}")
        if override not in (self.param_dtype, param.dtype):
            raise ValueError("param_dtype_override_fn must return None, param_dtype, or the parameter's original "
                             f"dtype but got {override} for a parameter with dtype {param.dtype} and param_dtype "
                             f"{self.param_dtype}")
        return override

    def with_param_dtype(self, param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
        """One parameter's policy: this one, or with an override function, ``param_dtype`` (what it returned for
        that parameter) and no function (what torch 2.15 hands a tensor subclass's pre-all-gather hook)."""
        if self.param_dtype_override_fn is None:
            return self
        return replace(self, param_dtype=param_dtype, param_dtype_override_fn=None)

    def _resolve_for_param(self, param: nn.Parameter) -> MixedPrecisionPolicy:
        """torch 2.15's per-parameter policy (its ``fully_shard`` calls this on the policy it is given, so
        this library's policy object works there too): ``param_dtype`` resolved, no override function."""
        if self.param_dtype_override_fn is None:
            return self
        return self.with_param_dtype(self.param_dtype_of(param))


def default_reduce_dtype(compute_dtypes: Iterable[torch.dtype], orig_dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """What one group's gradients are reduced in (and accumulated in without sync) under ``reduce_dtype=None``,
    following the torch this runs on (docs/torch.md, "Differences"): from torch 2.15 the parameters' original dtypes,
    before it their compute dtypes (``param_dtype``; a parameter ``param_dtype_override_fn`` keeps in its own
    dtype adds that one), promoted to one dtype."""
    return functools.reduce(torch.promote_types, orig_dtypes if REDUCE_IN_ORIG_DTYPE else compute_dtypes)


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on the CPU.

    Each unshard copies the shard to the compute device; each reduced gradient is copied back,
    and the optimizer steps on the CPU. ``pin_memory`` falls back (with one warning) where no
    accelerator exists to pin for.
    """

    pin_memory: bool = True


@dataclass(frozen=True)
class AllGatherPolicy:
    """What a unit's all-gather moves: by default the parameters at ``param_dtype``."""


@dataclass(frozen=True)
class QuantizedAllGather(AllGatherPolicy):
    """All-gather int8 values with one float32 scale per ``block_size`` values (ZeRO++'s qwZ), then
    dequantize into ``param_dtype``. Blocks never straddle ranks or parameters; the sharded master
    parameters, the optimizer and the gradient reduce-scatter keep their dtypes.
    See design/quantized-all-gather.md.
    """

    block_size: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"QuantizedAllGather(block_size={self.block_size!r}): expected a positive int "
                             "(values per scale). Fix: e.g. QuantizedAllGather(block_size=256).")


def check_all_gather_policy(policy: Any, reshard_after_forward: bool | int | None, shard_world: int) -> None:
    """An ``AllGatherPolicy``; a quantized one cannot re-gather a k-rank partial shard (it holds
    dequantized ``param_dtype`` values, not the int8 blocks)."""
    if not isinstance(policy, AllGatherPolicy):
        raise TypeError(f"all_gather_policy must be an AllGatherPolicy, got {type(policy).__name__}: "
                        f"{policy!r:.80}. Fix: all_gather_policy=QuantizedAllGather(block_size=256).")
    k = reshard_after_forward
    if isinstance(policy, QuantizedAllGather) and isinstance(k, int) and not isinstance(k, bool) \
            and 1 < k < shard_world:
        raise ValueError(f"{policy!r} with reshard_after_forward={k}: a partial reshard keeps dequantized values "
                         "and re-gathers them unquantized, which this policy does not do. Fix: "
                         "reshard_after_forward=True or False with QuantizedAllGather, or drop the policy.")


class ShardingStrategy(enum.Enum):
    """FSDP1/DeepSpeed-style presets; see wrap.strategy_kwargs for their fully_shard mapping."""

    FULL_SHARD = "full_shard"  # ZeRO-3: params, grads, optimizer state sharded; re-gather in backward
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: gathered params kept from forward to backward
    NO_SHARD = "no_shard"  # DDP semantics: replicated params, all-reduced grads
    HYBRID_SHARD = "hybrid_shard"  # HSDP: shard within a node, replicate across nodes (2-D mesh)
    _HYBRID_SHARD_ZERO2 = "_hybrid_shard_zero2"  # HSDP keeping the gathered params from forward to backward


def check_reshard_after_forward(value: Any, shard_world: int) -> None:
    """``reshard_after_forward`` is None, a bool, or an int k dividing the shard group size."""
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward must be None, a bool or an int, got {value!r}")
    if value < 1 or shard_world % value:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group size {shard_world} (it is the "
            f"size of the subgroup params stay sharded over between forward and backward). Fix: use one of "
            f"{[k for k in range(1, shard_world + 1) if shard_world % k == 0]}, or True/False.")
