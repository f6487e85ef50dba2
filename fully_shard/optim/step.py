"""Run torch optimizers' elementwise step on the local shards of fully_shard's DTensor parameters.

See design/optimizer-step.md. A global optimizer step pre-hook (installed by the first ``fully_shard``
call) hands ``step`` a *local view* of the optimizer: a shallow stand-in whose param groups hold this
rank's shards (``to_local()``, with ``.grad`` set to the local gradient) and whose state holds the
local tensors of the DTensor states. For an elementwise optimizer on ``Shard``/``Replicate``
placements this is exactly the math DTensor dispatch would run, without its per-op cost, so
parameters and states stay bitwise the same. The real optimizer is never modified: its param groups
and state keep the DTensors (``state_dict()``, DCP and ``fully_shard.checkpoint`` see what they see
without this module), and an exception inside ``step`` leaves nothing to restore.

The same hook refuses an optimizer that holds parameters ``fully_shard`` replaced (built before
``fully_shard``): stepping them would silently train nothing.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

try:  # private (design/private-torch.md): without it, fused groups keep torch's own loop
    from torch.optim.optimizer import _device_dtype_check_for_fused
except ImportError:  # pragma: no cover - torch moved it
    _device_dtype_check_for_fused = None  # type: ignore[assignment]

from ..core.registry import OWNER_ATTR
from . import lists
from .cache import (
    TOKEN_ATTR,
    LocalGroup,
    LocalState,
    Slot,
    StateSnapshot,
    check_entries,
    collect_local_grads,
    grad_of,
    is_,
    mirror,
    proven_local_grads,
    same,
    token_of,
)
from .originals import rebind_originals

__all__ = ["StepPath", "get_step_path", "set_step_path"]

# The tensor attribute this module puts on the originals fully_shard replaced (the owner attribute,
# "<Class> (param 'name')", is set by the core on the original and the sharded parameter: registry.py).
_REPLACED_ATTR = "_fully_shard_replaced"


class StepPath(enum.Enum):
    """How ``optimizer.step()`` runs over fully_shard's parameters."""

    LOCAL = "local"  # default: supported elementwise optimizers step the local shards directly
    DTENSOR = "dtensor"  # every op dispatched through DTensor, as with torch's fully_shard


class _Sharded(Protocol):
    """What this module reads of a ShardedParam: the parameter the module trains now."""

    @property
    def sharded_param(self) -> torch.Tensor: ...


class _Hooks:
    """The global step hooks and everything they read: which parameters are fully_shard's, each
    optimizer's cached stand-in, the step path.

    Process-wide, and so one module-level instance (``_hooks``): torch's optimizer step hooks are global
    (``register_optimizer_step_pre_hook``: one hook serves every optimizer of the process, whenever it
    was built), so what they read is too (design/overview.md, "Module-level state")."""

    def __init__(self) -> None:
        self.installed = False  # the two hooks registered with torch (once, by the first fully_shard call)
        self.path = StepPath.LOCAL  # set_step_path
        self.tracked: weakref.WeakSet[Any] = weakref.WeakSet()  # live ShardedParams (not their tensors: api.py)
        self.caches: weakref.WeakKeyDictionary[Optimizer, _Cache] = weakref.WeakKeyDictionary()
        self.epoch = 0  # counts fully_shard calls: a cache made before one must re-check for replaced params
        self.tokens = itertools.count()  # marks a parameter's local view (``_view``)
        self.lock = threading.Lock()  # several ranks in one process (threaded PG) call fully_shard at once
        self.thread = threading.local()  # per thread: with several ranks in one process, each steps its own

    def views_with_grad(self) -> list[Iterable[torch.Tensor]]:
        """This thread's cached local views whose ``.grad`` the running step uses (dropped after it)."""
        views = getattr(self.thread, "with_grad", None)
        if views is None:
            views = self.thread.with_grad = []
        return views


_hooks = _Hooks()  # the one instance: torch calls the hooks for every optimizer of the process
# torch-internal; without it the bulk reads are slower, not different (design/optimizer-step.md, Limits)
_no_torch_function: Callable[[], Any] = getattr(torch._C, "DisableTorchFunctionSubclass", contextlib.nullcontext)


def set_step_path(path: StepPath) -> StepPath:
    """Choose how later ``optimizer.step()`` calls run (process-wide); return the previous choice.

    ``set_step_path(StepPath.DTENSOR)`` turns the local fast path off, e.g. to compare against it.
    """
    if not isinstance(path, StepPath):
        raise TypeError(f"set_step_path expects a StepPath, got {path!r}. Fix: set_step_path(StepPath.DTENSOR) "
                        "or set_step_path(StepPath.LOCAL).")
    previous, _hooks.path = _hooks.path, path
    return previous


def get_step_path() -> StepPath:
    return _hooks.path


def track(params: Iterable[_Sharded], replaced: Iterable[torch.Tensor]) -> None:
    """Register a fully_shard unit's ShardedParams and the original parameters they replaced; install
    the global step hook once."""
    with _hooks.lock:  # thread-ranks (threaded process groups) call fully_shard at once: one hook, one count
        _hooks.tracked.update(params)
        _hooks.epoch += 1
        if not _hooks.installed:
            register_optimizer_step_pre_hook(_pre_step)
            register_optimizer_step_post_hook(_post_step)
            _hooks.installed = True
    for p in replaced:
        setattr(p, _REPLACED_ATTR, getattr(p, OWNER_ATTR, None) or "a fully_shard unit")


# --- which param groups may go local: the state each supported optimizer keeps -------------------
def _sgd_state_keys(group: dict[str, Any]) -> frozenset[str] | None:
    if group.get("differentiable"):
        return None
    return frozenset({"momentum_buffer"}) if group["momentum"] != 0 else frozenset()


def _adam_state_keys(group: dict[str, Any]) -> frozenset[str] | None:
    if group.get("differentiable") or group.get("capturable"):
        return None
    keys = {"step", "exp_avg", "exp_avg_sq"}
    return frozenset(keys | {"max_exp_avg_sq"}) if group.get("amsgrad") else frozenset(keys)


# Exact classes only: a subclass may override step() with math that is not elementwise. The value
# gives, for a param group, the state keys the step expects to exist already (it then only updates
# them in place), or None when the group's flags need the DTensor path.
_STATE_KEYS: dict[type[Optimizer], Callable[[dict[str, Any]], frozenset[str] | None]] = {
    SGD: _sgd_state_keys, Adam: _adam_state_keys, AdamW: _adam_state_keys,
}


# --- the hook -------------------------------------------------------------------------------------
def _pre_step(optimizer: Optimizer, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if torch.compiler.is_compiling():
        return None  # torch.compile(optimizer.step): Dynamo traces torch's own step over the DTensors
    _drop_local_grads()  # left by a step that raised
    cache = _hooks.caches.get(optimizer)
    if cache is None or cache.epoch != _hooks.epoch or cache.groups_seen != len(optimizer.param_groups):
        # new optimizer, a fully_shard call since (params may have been replaced), or add_param_group()
        rebind_originals(optimizer)  # built before the FSDP1 front end wrapped them: the successors (originals.py)
        _refuse_replaced(optimizer)
        cache = _hooks.caches[optimizer] = _Cache(_hooks.epoch, len(optimizer.param_groups),
                                                  LocalState(optimizer.state), ours=_holds_ours(optimizer))
    if not cache.ours:
        return None  # an optimizer over no parameter of ours: torch's own step, nothing more per step
    state_keys = _STATE_KEYS.get(type(optimizer))
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if _hooks.path is StepPath.DTENSOR or state_keys is None or closure is not None:
        return None  # a closure computes the gradients inside step(): after the view would be taken
    with torch.no_grad(), _no_torch_function():  # DTensor .grad reads without its dispatch (optimizer-step.md)
        view = _local_optimizer(optimizer, cache, state_keys)
    if view is None:
        _drop_local_grads()
        return None
    return (view, *args[1:]), kwargs


def _post_step(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    _drop_local_grads()


def _drop_local_grads() -> None:
    """The cached views must not keep gradients alive after the step (``zero_grad`` would free them)."""
    with_grad = _hooks.views_with_grad()
    for views in with_grad:
        for view in views:
            view.grad = None
    with_grad.clear()


def _holds_ours(optimizer: Optimizer) -> bool:
    with _hooks.lock:
        owned = {id(sp.sharded_param) for sp in _hooks.tracked}
    return any(id(p) in owned for group in optimizer.param_groups for p in group["params"])


def _refuse_replaced(optimizer: Optimizer, params: list[torch.Tensor] | None = None) -> None:
    """Refuse a step over originals fully_shard replaced that nothing uses any more (no gradient: an
    optimizer built before fully_shard). One still used elsewhere (a teacher or EMA module registering
    the same Parameter object) has its gradient and trains as it should."""
    if params is None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [p for p in params if hasattr(p, _REPLACED_ATTR) and p.grad is None]
    if stale:
        names = ", ".join(str(getattr(p, _REPLACED_ATTR)) for p in stale[:3])
        more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {len(stale)} of its parameters were replaced by fully_shard "
            f"({names}{more}); the module now trains sharded DTensor parameters this optimizer does not "
            "hold, so the step would change nothing. Fix: build the optimizer after fully_shard, e.g. "
            "fully_shard(model); optimizer = torch.optim.AdamW(model.parameters()).")


# --- the local stand-in, built and refreshed each step (its cache and the checks: cache.py) ----------
@dataclass(eq=False)
class _Cache:
    """One optimizer's stand-in, kept between steps and re-validated each (``_local_optimizer``)."""

    epoch: int
    groups_seen: int
    local_state: LocalState
    ours: bool = True  # holds a parameter of a fully_shard unit (else the hook leaves every step to torch)
    groups: dict[int, LocalGroup] = field(default_factory=dict)  # by param group index
    snapshot: StateSnapshot | None = None


def _local_optimizer(optimizer: Optimizer, cache: _Cache,
                     state_keys: Callable[[dict[str, Any]], frozenset[str] | None]) -> Optimizer | None:
    """A shallow stand-in for ``optimizer`` whose eligible groups hold local shards; None if none is."""
    state = optimizer.state
    local_state = cache.local_state
    local_state.real = state  # load_state_dict() replaces it
    snapshot_matched: list[bool] = []  # computed once, if a group needs it (none does for a plain optimizer)

    def unchanged() -> bool:
        if not snapshot_matched:
            snapshot_matched.append(cache.snapshot is not None and cache.snapshot.matches(state))
        return snapshot_matched[0]
    local_cls = lists.local_class(type(optimizer))
    groups, any_local = [], False
    ready_by_group: dict[int, lists.Ready] = {}
    for i, group in enumerate(optimizer.param_groups):
        keys = state_keys(group)
        cached = cache.groups.get(i)
        refreshed = None if keys is None or cached is None else _refresh(
            cached, group["params"], keys, state, local_state, unchanged, allow_ready=_may_be_ready(group))
        if refreshed is None:
            _refuse_replaced(optimizer, group["params"])  # the group's list may have been edited
            if cached is not None:
                for slot in cache.groups.pop(i).slots:
                    local_state.pop(slot.local, None)
            cached = None if keys is None else _build(group["params"], keys, state, local_state)
            if cached is not None:
                cache.groups[i] = cached
                if local_cls is not None:
                    _prepare_ready(cached, type(optimizer), group)
        if cached is None or not cached.slots:
            groups.append(group)
        else:
            any_local = True
            local_group = {**group, "params": cached.local_params}
            if isinstance(refreshed, lists.Ready):
                ready_by_group[id(local_group)] = refreshed
            groups.append(local_group)
    if any_local and snapshot_matched != [True]:  # else it would be the same objects again
        cache.snapshot = StateSnapshot.of(state)
    if not any_local:
        return None
    view = object.__new__(local_cls or type(optimizer))
    view.__dict__.update(optimizer.__dict__)  # defaults, hooks, grad_scale/found_inf set by GradScaler
    view.param_groups = groups
    view.state = local_state  # type: ignore[assignment]
    view._fully_shard_ready = ready_by_group  # type: ignore[attr-defined]  # read by lists.py's _init_group
    return view


def _may_be_ready(group: dict[str, Any]) -> bool:
    """What torch's Adam ``_init_group`` refuses (a tensor lr with foreach and not capturable) must go
    through it, to raise as torch does."""
    return not (group.get("foreach") and torch.is_tensor(group["lr"]) and not group.get("capturable"))


def _prepare_ready(cached: LocalGroup, cls: type[Optimizer], group: dict[str, Any]) -> None:
    """Let a group of only our parameters take the ready path (lists.py) from its next step on."""
    if not cached.slots or len(cached.local_params) != len(cached.slots):
        return  # plain parameters in the group: torch's loop gathers them (with the views' .grad)
    keys = lists.state_keys_of(cls, group)
    if keys is None:
        return
    if group.get("fused"):
        if _device_dtype_check_for_fused is None:
            return  # torch's loop runs its own check each step: correct, only slower
        for view in cached.views:  # what torch's _init_group checks on a fused group
            _device_dtype_check_for_fused(view)
    cached.ready_keys = keys
    cached.ready_result = cls is not SGD and any(map(torch.is_complex, cached.views))


def _refresh(cached: LocalGroup, params: list[torch.Tensor], keys: frozenset[str],
             state: dict[Any, dict[str, Any]], local_state: LocalState,
             state_unchanged: Callable[[], bool], *, allow_ready: bool = True) -> lists.Ready | bool | None:
    """Hand this step's gradients to the cached group: as ready lists (lists.py) when it has them,
    else on the views' ``.grad`` (True); None if anything the cache relies on changed."""
    if (params is not cached.params or len(params) != len(cached.contents) or keys != cached.keys
            or not all(map(is_, params, cached.contents))):
        return None
    if not cached.slots:
        return True
    try:
        if tuple(map(token_of, cached.ours)) != cached.tokens:
            return None  # swap_tensors replaced a parameter's contents (and __dict__): its view is stale
    except AttributeError:
        return None
    got: tuple[tuple[torch.Tensor | None, ...], bool] | None = proven_local_grads(cached)
    if got is None:
        grads: tuple[Any, ...] = tuple(map(grad_of, cached.ours))
        got = collect_local_grads(cached, grads)
        if got is None:
            return None
    else:
        grads = got[0]  # every parameter has one: what check_entries asks of them
    local_grads, complete = got
    if keys and not (state_unchanged() and cached.entries_unchanged()):
        cached.ready_states = None
        if not check_entries(cached, grads, keys, state, local_state):
            return None
    ready = _ready(cached, local_grads, local_state) if allow_ready and complete else None
    if ready is not None:
        return ready
    _hooks.views_with_grad().append(cached.views)
    try:
        for view, local_grad in zip(cached.views, local_grads):
            view.grad = local_grad  # checks shape, dtype and device against the shard
    except RuntimeError:
        return None
    return True


def _ready(cached: LocalGroup, local_grads: tuple[torch.Tensor | None, ...],
           local_state: LocalState) -> lists.Ready | None:
    """The group's ready lists (lists.py), when it takes that path (the caller checked that every
    parameter has a gradient; else torch's loop on the views' .grad skips those without one)."""
    if cached.ready_keys is None or not cached.mirrored:
        return None
    if cached.ready_states is None:  # after a (re-)mirror: the local state tensors per list, in slot order
        entries = [local_state[view] for view in cached.views]
        cached.ready_states = tuple(() if key is None else tuple(map(operator.itemgetter(key), entries))
                                    for key in cached.ready_keys)
    return lists.Ready(cached.views, local_grads, cached.ready_states,  # type: ignore[arg-type]
                            cached.ready_result)


def _build(params: list[torch.Tensor], keys: frozenset[str], state: dict[Any, dict[str, Any]],
           local_state: LocalState) -> LocalGroup | None:
    """Cache a group: with views for our DTensors, or with no slots when it has none of ours or another
    library's DTensor (torch's fully_shard, tensor parallel: the whole group stays on DTensor). None,
    to try again next step, when a state is missing (the step would create it: let DTensor do that, on
    the first step) or a gradient or state is laid out unlike its parameter."""
    with _hooks.lock:
        owned = {id(sp.sharded_param): sp for sp in _hooks.tracked}
    local_params: list[torch.Tensor] = []
    slots = []
    with_grad: list[torch.Tensor] = []
    _hooks.views_with_grad().append(with_grad)
    mirrored = True
    for p in params:
        sp = owned.get(id(p))
        if sp is None:
            if isinstance(p, DTensor):
                return LocalGroup(params, tuple(params), keys, [], [])
            local_params.append(p)  # a plain parameter: its state is shared as is
            continue
        slot = Slot(p, 0, p, p.placements)  # type: ignore[attr-defined]
        slot.local, slot.token = _view(p)
        grad = p.grad
        if grad is None:
            mirrored = False
        else:
            if type(grad) is not DTensor or not same(grad.placements, slot.placements):
                return None
            entry = state.get(p)
            if keys and (entry is None or not mirror(slot, entry, keys, local_state)):
                return None
            try:
                slot.local.grad = grad.to_local()
            except RuntimeError:
                return None
            with_grad.append(slot.local)
        local_params.append(slot.local)
        slots.append(slot)
    return LocalGroup(params, tuple(params), keys, local_params, slots, mirrored=mirrored)


def _view(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A view of ``p``'s local shard and the token marking it on ``p``: ``torch.utils.swap_tensors``
    (``to_empty``, ``.to()``) swaps ``__dict__`` along with the contents, so the token leaves with them."""
    view = p.to_local()  # type: ignore[attr-defined]  # a fresh view (not the DTensor's own) for a Parameter
    token = next(_hooks.tokens)
    setattr(p, TOKEN_ATTR, token)
    return view, token
