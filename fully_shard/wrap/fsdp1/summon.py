"""summon_full_params: every unit's parameters as plain full tensors in the module, written back to the shards on exit.

FSDP1's context manager on per-parameter DTensors: each managed parameter is gathered at its own dtype
(full precision, not ``param_dtype``), registered in every module slot that holds it as a plain
``nn.Parameter``, and on exit this rank's rows of the (possibly edited) full tensor are copied into its
shard (``writeback``) before the sharded DTensor is registered again. Collective: every rank enters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...checkpoint.views import describe
from ...core.param import ShardedParam
from ...core.state import FSDPState, TrainingState

__all__ = ["summon"]


@dataclass
class _Summoned:
    sp: ShardedParam
    sharded: DTensor
    full: nn.Parameter | None  # None: this rank keeps the shard (rank0_only)


def _check(states: list[tuple[str, FSDPState]], writeback: bool, rank0_only: bool, offload_to_cpu: bool,
           with_grads: bool) -> None:
    if rank0_only and writeback:
        raise NotImplementedError("summon_full_params(rank0_only=True, writeback=True): only rank 0 would hold the "
                                  "full parameters, so the other ranks' shards could not be written back. Fix: "
                                  "writeback=False with rank0_only=True.")
    if with_grads and offload_to_cpu:
        raise NotImplementedError("summon_full_params(with_grads=True, offload_to_cpu=True) is not supported (as in "
                                  "FSDP1). Fix: offload_to_cpu=False to read the full gradients.")
    for fqn, state in states:
        if state.training_state is not TrainingState.IDLE:
            raise RuntimeError(f"summon_full_params on unit {fqn or '<root>'!r}: it is in {state.training_state.name}; "
                               "the context can only be entered between steps, not inside forward or backward. Fix: "
                               "enter it before the forward or after the backward.")


@contextlib.contextmanager
def summon(states: Iterable[tuple[str, FSDPState]], *, writeback: bool, rank0_only: bool, offload_to_cpu: bool,
           with_grads: bool) -> Generator[None, None, None]:
    """Full parameters in the modules of ``states`` (FQN, unit) for the duration of the context."""
    states = list(states)
    _check(states, writeback, rank0_only, offload_to_cpu, with_grads)
    keep = not rank0_only or dist.get_rank() == 0
    summoned: list[_Summoned] = []
    groups = []
    try:
        for _, state in states:
            for group in state.groups:
                groups.append(group)
                group.reshard()  # the slots hold the sharded DTensors again (a root kept its gathered params)
                for sp in group.params:
                    summoned.append(_gather(sp, keep, offload_to_cpu, with_grads))
        for item in summoned:
            if item.full is not None:
                for module, name in item.sp.slots:
                    module._parameters[name] = item.full
        yield
    finally:
        for item in summoned:
            if writeback and item.full is not None:
                _write_back(item.sharded, item.full)
        for group in groups:
            group.register_sharded()  # the sharded DTensors in every slot again


def _gather(sp: ShardedParam, keep: bool, offload_to_cpu: bool, with_grads: bool) -> _Summoned:
    sharded = sp.sharded_param
    with torch.no_grad():
        full = sharded.full_tensor()  # collective over the unit's mesh, at the parameter's own dtype
        grad = sharded.grad.full_tensor() if with_grads and isinstance(sharded.grad, DTensor) else None
    if not keep:
        return _Summoned(sp, sharded, None)
    if offload_to_cpu:
        full = full.cpu()
    param = nn.Parameter(full, requires_grad=sharded.requires_grad)
    if grad is not None:
        param.grad = grad
    return _Summoned(sp, sharded, param)


def _write_back(sharded: DTensor, full: torch.Tensor) -> None:
    """This rank's rows of ``full`` into the shard (a no-op where the gather returned the shard itself)."""
    view = describe("param", sharded)
    with torch.no_grad():
        rows = full.detach()[view.held.slices()]
        if rows.data_ptr() != view.local.data_ptr() or rows.device != view.local.device:
            view.local.copy_(rows)
