"""Frozen policy types users pass to fully_shard: mixed precision, offload, sharding strategy."""

from __future__ import annotations

import enum
from dataclasses import dataclass

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


class ShardingStrategy(enum.Enum):
    """FSDP1/DeepSpeed-style presets; see wrap.strategy_kwargs for their fully_shard mapping."""

    FULL_SHARD = "full_shard"  # ZeRO-3: params, grads, optimizer state sharded; re-gather in backward
    SHARD_GRAD_OP = "shard_grad_op"  # ZeRO-2: gathered params kept from forward to backward
    NO_SHARD = "no_shard"  # DDP semantics: replicated params, all-reduced grads
    HYBRID_SHARD = "hybrid_shard"  # HSDP: shard within a node, replicate across nodes (2-D mesh)
