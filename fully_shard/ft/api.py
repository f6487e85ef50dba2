"""``fault_tolerant()``: the one call that makes a sharded model and its optimizer fault tolerant under torchft.

See design/fault-tolerance.md and docs/ft.md. It checks the manager's settings, puts the replica
all-reduce hook (hook.py) on every unit, creates the optimizer state (optim_state.py), registers the
recovery state (recovery.py) with the manager and returns the optimizer wrapper (optimizer.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from ..core.module import FSDPModule
from ..core.state import states_under
from .hook import ReplicaAllReduce
from .optim_state import create_optimizer_state
from .optimizer import FaultTolerantOptimizer
from .recovery import RecoveryState

__all__ = ["STATE_KEY", "fault_tolerant"]

STATE_KEY = "fully_shard"  # the key of this library's state among the manager's registered state dicts
_MANAGER_METHODS = ("allreduce", "start_quorum", "should_commit", "register_state_dict_fn", "report_error",
                    "state_dict", "load_state_dict", "current_step", "num_participants")


def fault_tolerant(model: nn.Module, optimizer: Optimizer, *, manager: Any,
                   stateful: Mapping[str, Any] | None = None) -> FaultTolerantOptimizer:
    """Make ``model`` (sharded with ``fully_shard`` over this replica group's ranks) and ``optimizer``
    fault tolerant under the torchft ``manager``; return the optimizer to train with.

    - every unit's gradient shard is averaged over the replica groups that contribute to the step
      (``ReplicaAllReduce``: torchft's all-reduce, divided by the contributing groups);
    - the optimizer's state is created now, as its first step would (no step runs: AdamW's step
      count stays 0);
    - this replica's recovery state (local shards of parameters, buffers and optimizer state, and
      ``stateful`` objects such as an LR scheduler) is registered with the manager; it is captured and
      applied on the training thread only, never on torchft's threads;
    - the returned ``FaultTolerantOptimizer`` starts the quorum in ``zero_grad()`` and commits in
      ``step()``.

    Call it on every rank of the replica group, after ``fully_shard`` and before the first step. The
    manager must be built with ``load_state_dict=None, state_dict=None`` (this call registers the state;
    a manager holding other state is refused) and, with the asynchronous quorum (torchft's default),
    ``init_sync=False``.
    """
    missing = [m for m in _MANAGER_METHODS if not callable(getattr(manager, m, None))]
    if missing:
        raise TypeError(f"fault_tolerant(manager=...) expects a torchft.Manager, got {type(manager).__name__} "
                        f"without {missing}. Fix: pip install 'fully_shard[ft]' and pass torchft.Manager(...).")
    if not isinstance(optimizer, Optimizer) or isinstance(optimizer, FaultTolerantOptimizer) \
            or (hasattr(optimizer, "manager") and hasattr(optimizer, "optim")):
        raise TypeError(f"fault_tolerant(optimizer=...) expects the plain torch optimizer over the model's parameters, "
                        f"got {type(optimizer).__name__} (already wrapped for torchft?). Fix: pass the optimizer "
                        "itself; fault_tolerant returns its wrapper.")
    async_quorum = _check_quorum_settings(manager)
    _check_no_other_state(manager)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError(f"fault_tolerant: {type(model).__name__} has no fully_shard unit. Fix: call "
                         "fully_shard on its blocks and its root (over this replica group's ranks) first.")
    for fqn, state in states_under(model):
        for group in state.groups:
            hook = group.reducer.settings.all_reduce_hook
            if hook is not None and not isinstance(hook, ReplicaAllReduce):
                raise ValueError(f"fault_tolerant: unit {fqn or '<root>'!r} already has an all-reduce hook ({hook!r}); "
                                 "the replica average is this call's hook. Fix: drop the set_all_reduce_hook call.")
            if group.reducer.settings.hook_stream is not None:
                raise ValueError(f"fault_tolerant: unit {fqn or '<root>'!r} has an all-reduce hook stream set; the "
                                 "replica all-reduce runs on the unit's all-reduce stream. Fix: drop stream=.")
    group_rank, group_world_size = _group_of()
    recovery = RecoveryState(model, optimizer, group_rank=group_rank, group_world_size=group_world_size,
                             stateful=stateful, report_error=manager.report_error)
    try:
        manager.register_state_dict_fn(STATE_KEY, recovery.load_state_dict, recovery.state_dict)
    except AssertionError:  # torchft asserts on a key registered twice
        raise ValueError(f"fault_tolerant: this manager already holds a state registered as {STATE_KEY!r}: "
                         "fault_tolerant() was called with it before. Fix: one manager per model and optimizer "
                         "(one call per replica group rank).") from None
    create_optimizer_state(optimizer)
    hook = ReplicaAllReduce(manager)
    for unit in units:
        unit.set_all_reduce_hook(hook)
    return FaultTolerantOptimizer(optimizer, manager=manager, recovery=recovery, async_quorum=async_quorum)


def _check_quorum_settings(manager: Any) -> bool:
    """Whether the quorum is asynchronous; refuses ``init_sync=True`` with it (the reason below).

    torchft 0.2.0 keeps both settings private (``Manager._use_async_quorum``, ``Manager._init_sync``; the
    only torchft private names read here, design/fault-tolerance.md)."""
    async_quorum = getattr(manager, "_use_async_quorum", None)
    init_sync = getattr(manager, "_init_sync", None)
    if not isinstance(async_quorum, bool) or not isinstance(init_sync, bool):
        raise TypeError(f"fault_tolerant: cannot read the quorum settings of {type(manager).__name__} "
                        "(Manager._use_async_quorum / Manager._init_sync, as in torchft 0.2.0). Fix: use torchft "
                        "0.2.x (pip install 'fully_shard[ft]').")
    if async_quorum and init_sync:
        raise ValueError(
            "fault_tolerant: Manager(init_sync=True) with the asynchronous quorum (torchft's defaults) changes step 0: "
            "torchft makes every replica group but one heal at step 0 while its forward and backward already run "
            "on its own initial weights, so its gradient is zeroed, its batch is lost, and the average still "
            "divides by every group (the step-0 update is 1/N of the global batch's). Fix: initialize every "
            "replica group identically (the same seed, or the same checkpoint) and pass init_sync=False, or pass "
            "use_async_quorum=False (the step-0 heal then completes before the forward and every group counts).")
    return async_quorum


def _check_no_other_state(manager: Any) -> None:
    """Refuses a manager that already transfers other state (``Manager(load_state_dict=..., state_dict=...)``
    registers it as ``"default"``): its ``state_dict`` would run on torchft's quorum thread in the middle of
    a forward, and its ``load_state_dict`` would write before the commit vote, so a heal would no longer be
    all or nothing. Reads torchft 0.2.0's ``Manager._user_state_dicts`` where it exists."""
    registered = getattr(manager, "_user_state_dicts", None)
    others = sorted(k for k in registered if k != STATE_KEY) if isinstance(registered, Mapping) else []
    if others:
        raise ValueError(
            f"fault_tolerant: the manager already transfers state registered as {others} (Manager("
            "load_state_dict=..., state_dict=...) registers 'default'); torchft would read it on its quorum thread "
            "during the forward and load it before the commit vote. Fix: build the Manager with "
            "load_state_dict=None, state_dict=None and pass other objects (a scheduler, a data position) as "
            "fault_tolerant(..., stateful={name: obj}).")


def _group_of() -> tuple[int, int]:
    """This rank and its replica group's size: the default process group's (each replica group is its own
    job, as torchft runs it), or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
