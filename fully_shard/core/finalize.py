"""Manual backward finalization (torch 2.15's surface): the caller, not the end of backward, finishes a root's
gradient reduction, once, after several backward passes (pipeline schedules, split input/weight backward).

See design/hooks.md ("Manual backward finalization"). ``set_manual_backward_finalization(True)`` on the root
before backward; each backward's end then leaves the reductions in flight and the groups whose gradients
no post-backward hook took (still unsharded, not reduced); ``finalize_backward()`` reduces those, reshards
as ``set_reshard_after_backward`` says and waits for every reduction (``async_op=True``: a
``GradientReductionHandle`` whose ``wait()`` does that last step). The errors for misuse are torch 2.15's.
"""

from __future__ import annotations

import torch

from ..comm.trace import Phase
from .group import GroupState, ParamGroup
from .state import FSDPState, RootContext, TrainingState

__all__ = ["GradientReductionHandle", "finalize_backward", "set_manual_backward_finalization"]


class GradientReductionHandle:
    """Returned by ``finalize_backward(async_op=True)``: ``wait()`` finishes the gradient reduction (the
    sharded ``.grad`` are complete after it). ``reset_iter_state()`` invalidates it."""

    def wait(self) -> None:
        return


class _Reduction(GradientReductionHandle):
    """The handle of one asynchronous finalization of ``root`` (None: before the first forward, a no-op)."""

    def __init__(self, root: RootContext | None) -> None:
        self._root = root

    def wait(self) -> None:
        root = self._root
        if root is None:
            return
        if root.ctx.active_reduction is not self:
            raise RuntimeError("This gradient reduction handle was invalidated")
        _end_backward(root)
        root.pending_reduction = None
        root.ctx.active_reduction = None
        self._root = None


def _in_backward() -> bool:
    """True inside an autograd backward (torch's check reads the engine's current graph task)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def set_manual_backward_finalization(state: FSDPState, enabled: bool) -> None:
    """``FSDPModule.set_manual_backward_finalization``: on a root (or a unit not yet lazily initialized,
    which lazy init then requires to be the root), not while a backward runs, not to another mode than
    the one the current backward iteration started with."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_manual_backward_finalization expects a bool, got {type(enabled).__name__}: {enabled!r}")
    if state.root is not None and not state.is_root:
        raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
    if enabled != state.manual_finalization and _in_backward():
        raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
    active = state.root.manual_active if state.root is not None else None
    if active is not None and enabled != active:
        raise RuntimeError("set_manual_backward_finalization cannot change mode after backward starts")
    state.manual_finalization = enabled


def finalize_backward(state: FSDPState, *, async_op: bool) -> GradientReductionHandle | None:
    """``FSDPModule.finalize_backward``: reduce what the backward passes left, reshard, wait (or return the
    handle that waits). Before the root's first forward: nothing to do."""
    root = state.root
    if root is None:
        return _Reduction(None) if async_op else None
    if root.pending_reduction is not None:
        raise RuntimeError("The previous gradient reduction must be waited on before finalizing backward again")
    if root.ctx.active_reduction is not None:
        raise RuntimeError("Another gradient reduction sharing this communication context must be waited on "
                           "before finalizing backward")
    _check(state, root)
    for st in reversed(root.states):
        st._reduce([g for g in reversed(st.groups) if _pending(g)])
        for group in reversed(st.groups):
            if group.reshard_after_backward and group.state is not GroupState.SHARDED:
                group.reshard(Phase.BACKWARD)
            if group.reducer.requires_gradient_sync:
                group.reducer.clear_used()
        st.training_state = TrainingState.IDLE
    if not async_op:
        _end_backward(root)
        return None
    reduction = _Reduction(root)
    root.pending_reduction = reduction
    root.ctx.active_reduction = reduction
    return reduction


def _pending(group: ParamGroup) -> bool:
    """Gradients of ``group`` not reduced yet: left unsharded by a manual backward's end, or accumulated
    without sync (torch's ``_post_backward_pending``)."""
    return group.has_unsharded_grads() or any(p.unsharded_accumulated_grad is not None for p in group.params)


def _check(state: FSDPState, root: RootContext) -> None:
    """torch 2.15's checks, in its order: on the root, in manual mode, after backward, no HSDP reduction
    left half done (partial sums without the all-reduce)."""
    if not state.is_root:
        raise RuntimeError("finalize_backward must be called on the root FSDP module")
    manual = root.manual_active if root.manual_active is not None else state.manual_finalization
    if not manual:
        raise RuntimeError("FSDP finalize_backward requires manual backward finalization. Call "
                           "set_manual_backward_finalization(True) before forward")
    if root.callback_queued:
        raise RuntimeError("FSDP finalize_backward must be called after backward completes")
    groups = [g for st in root.states for g in st.groups]
    partial = next((g for g in groups if g.reducer.partial_output is not None), None)
    if partial is not None:
        raise RuntimeError(f"FSDP manual backward finalization does not support partial gradient reductions for "
                           f"parameter group {partial.fqn or '<root>'!r}. Use automatic backward finalization for "
                           "this configuration")
    no_all_reduce = next((g for g in groups if _pending(g) and g.reducer.requires_gradient_sync
                          and g.mesh_info.replicate_group is not None and not g.reducer.requires_all_reduce), None)
    if no_all_reduce is not None:
        raise RuntimeError(f"FSDP manual backward finalization requires all-reduce for parameter group "
                           f"{no_all_reduce.fqn or '<root>'!r}. Call set_requires_all_reduce(True) before finalization")


def _end_backward(root: RootContext) -> None:
    """Wait for every reduction of the root's backward and end its iteration (as the automatic last
    backward's end does)."""
    root.reduces.drain()
    root.ctx.end_backward(reduces_finished=True, step_ended=False)
    root.manual_active = None


def reset(root: RootContext) -> None:
    """``reset_iter_state``: forget the manual mode of the failed backward and invalidate its handle (a
    handle owned by another root sharing the communication context cannot be reset from here)."""
    active = root.ctx.active_reduction
    if active is not None and active is not root.pending_reduction:
        raise RuntimeError("reset_iter_state cannot reset a gradient reduction owned by another FSDP root sharing "
                           "the communication context")
    root.ctx.active_reduction = None
    root.pending_reduction = None
    root.manual_active = None
