"""FSDPModule: the mixin a sharded module's class is swapped to, with the user-facing methods."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from .group import GroupState
from .policy import check_reshard_after_forward
from .state import FSDPState, get_state, states_under
from .tree import join_fqn


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` makes the all-gathered params usable."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def wait(self) -> None:
        if self._state.group is not None:
            self._state.group.wait_for_unshard()


class FSDPModule:
    """Mixin for modules passed to ``fully_shard``; ``FSDP<Name>`` subclasses it and the original."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Constructing FSDPLinear(...) directly builds the original class (as torch's FSDP2 does).
        orig_cls = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls)  # type: ignore[call-overload]
        self.__init__(*args, **kwargs)
        return self

    @property
    def _fsdp(self) -> FSDPState:
        state = get_state(self)  # type: ignore[arg-type]
        assert state is not None
        return state

    def _fsdp_states(self, recurse: bool) -> Iterator[FSDPState]:
        if not recurse:
            yield self._fsdp
            return
        for _, state in states_under(self):  # type: ignore[arg-type]
            yield state

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``model.to(torch.float64)``, ``.double()``, ``.half()``: convert the sharded parameters
        (resharded first, so the DTensors are what gets converted) and re-read them, so the next
        all-gather moves the new dtype. See design/param-lifecycle.md."""
        state = self._fsdp
        if state.group is not None:
            state.group.reshard()
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        if state.group is not None:
            state.group.adopt_module_params()
        return out

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (e.g. before a forward that skips hooks)."""
        state = self._fsdp
        state.lazy_init()
        if state.group is not None:
            state.group.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters, registering the sharded DTensors again."""
        state = self._fsdp
        if state.group is not None:
            state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate unsharded grads locally with no collective (gradient accumulation)."""
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the cross-replica all-reduce (grads keep accumulating per replica)."""
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, *, recurse: bool = True) -> None:
        for state in self._fsdp_states(recurse):
            check_reshard_after_forward(reshard_after_forward, state.mesh_info.shard_world)
            if state.group is not None:
                state.group.check_subgroup(reshard_after_forward)
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._fsdp.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._fsdp.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the end of the next backward does not wait for in-flight gradient reductions
        (micro-batching); they finish on the next backward or forward. Set on the root."""
        self._fsdp.is_last_backward = is_last_backward

    def fsdp_repr(self) -> str:
        """One line per managed parameter: ``blocks.0.up.weight f32[157@shard/2, 60] SHARDED``."""
        lines = []
        for prefix, state in states_under(self):  # type: ignore[arg-type]
            if state.group is not None:
                lines += [p.describe(join_fqn(prefix, p.local_fqn)) for p in state.group.params]
        return "\n".join(lines)

    @property
    def fsdp_state_name(self) -> str:
        state = self._fsdp
        return state.group.state.name if state.group is not None else GroupState.SHARDED.name


def _state_of(module: Any, method: str) -> FSDPState:
    state = get_state(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(f"{method} expects modules passed to fully_shard, got {type(module).__name__}. "
                         f"Fix: call fully_shard(module) on it first.")
    return state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) unshard/reshard like ``forward``."""
    state = get_state(module)
    if state is None:
        raise ValueError(f"register_fsdp_forward_method expects a module passed to fully_shard, got "
                         f"{type(module).__name__}. Fix: call fully_shard(module) first.")
    method = getattr(module, method_name, None)
    if method is None:
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    orig = getattr(type(module), method_name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward_hook(module, args, kwargs)
        output = orig(module, *args, **kwargs)
        return state._post_forward_hook(module, args, kwargs, output)

    setattr(module, method_name, wrapped)
