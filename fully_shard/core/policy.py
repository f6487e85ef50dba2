"""Frozen policy types users pass to fully_shard: mixed precision, offload, all-gather format, sharding
strategy, and the checks of a reshard_after_forward value and of what a quantized all-gather can do."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the all-gather/compute (``param_dtype``), the gradient reduction
    (``reduce_dtype``, default ``param_dtype``) and module outputs (``output_dtype``).

    Same fields as torch's ``MixedPrecisionPolicy``; see design/mixed-precision.md.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


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
