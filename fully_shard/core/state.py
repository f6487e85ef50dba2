"""Per-module runtime: the forward/backward hooks that drive each ParamGroup, and root lazy init.

See design/hooks.md. One ``FSDPState`` per fully_shard call (shared by all modules of a list call);
the first state to run forward becomes the root and owns the ``RootContext``: the streams, the
recorded forward order used for implicit prefetching, and the end-of-backward callback.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from ..comm.streams import CommContext
from ..comm.trace import Phase
from ..parallel.mesh import MeshInfo
from .checks import check_not_meta
from .dynamo import eager
from .group import GroupState, ParamGroup, ReduceQueue
from .param import ShardedParam
from .policy import MixedPrecisionPolicy
from .reduce import ReduceBytes, activation_bytes
from .tree import join_fqn, map_tensors, tensors

# The runtime's entry points, public because other files call them too (module.py, compat): every
# method torch calls (module hooks, tensor hooks, autograd Function
# backward, the engine's final callback; register_fsdp_forward_method calls the forward hooks):
# replaced per state by its torch.compiler.disable'd form, so that Dynamo never traces them and a
# compiled block's forward stays one graph (dynamo.py, design/hooks.md "torch.compile").
_EAGER_METHODS = ("pre_forward_hook", "post_forward_hook", "pre_backward", "post_backward",
                  "root_final_callback", "finish_reduces_callback")


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"  # unsharded for backward (also while recomputing checkpoints)
    POST_BACKWARD = "post_backward"


class RootContext:
    """What the root shares with every state below it."""

    def __init__(self, states: list[FSDPState], device: torch.device, ctx: CommContext | None = None) -> None:
        self.states = states
        self.ctx = ctx or CommContext(device)  # share_comm_ctx: one shared by several roots
        self.reduces = ReduceQueue(accelerated=self.ctx.accelerated)
        self.forward_order: list[FSDPState] = []  # units in the order their forward began
        self.post_forward_order: list[FSDPState] = []  # ... and ended: backward runs it in reverse
        self.order_frozen = False
        self.callback_queued = False
        self.reduce_callback_queued = False  # finish_reduces_callback (a backward inside a list unit's pass)
        self.owner: FSDPState | None = None  # the root state (set at lazy init)
        # manual backward finalization (finalize.py): the mode this backward iteration started with (None:
        # no backward since the last finalization), and finalize_backward(async_op=True)'s handle until waited
        self.manual_active: bool | None = None
        self.pending_reduction: Any = None


class FSDPState:
    """Hooks and settings of one fully_shard unit."""

    def __init__(self, modules: tuple[nn.Module, ...], groups: list[ParamGroup], mesh_info: MeshInfo,
                 device: torch.device, mp_policy: MixedPrecisionPolicy,
                 reshard_after_forward: bool | int | None) -> None:
        self.modules = modules
        # one ParamGroup per (shard group, replicate group) of the unit's parameters: one for a unit on one
        # mesh; several with per-parameter meshes (e.g. dense on dp, experts on efsdp: design/experts.md)
        self.groups = groups
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.root: RootContext | None = None
        self.is_root = False
        self.fqn = ""
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] | None = None  # explicit; None means implicit
        self.backward_prefetch: list[FSDPState] | None = None
        self.is_last_backward = True
        self.manual_finalization = False  # set_manual_backward_finalization (read on the root; finalize.py)
        self.shared_ctx: CommContext | None = None  # share_comm_ctx before lazy init (roots.py)
        self._modules_to_run: set[nn.Module] = set()  # list unit: members still to run this pass
        self._awaits_post_backward = False  # this pass wrapped grad-requiring inputs in _PostBackward
        self._member_params = _member_params(modules, groups)  # list unit: params under each member
        self.forward_rows = 0  # rows of the unit's last grad-enabled forward output (ReduceQueue's budget)
        self._in_features = {id(g): sum(p.unsharded_shape[1] for p in g.params if len(p.unsharded_shape) == 2)
                             for g in groups}  # per group: the 2-D weights' input features
        self._reduce_bytes_of: dict[int, tuple[int, ReduceBytes]] = {}  # per group: (forward rows, its bytes)
        for name in _EAGER_METHODS:
            setattr(self, name, eager(getattr(self, name)))
        for module in modules:
            module.register_forward_pre_hook(self.pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward_hook, prepend=False, with_kwargs=True)
            module.register_state_dict_pre_hook(self._reshard_for_state_dict)
            module.register_load_state_dict_pre_hook(self._reshard_for_state_dict)

    # --- lazy init ---------------------------------------------------------------------------------
    def lazy_init(self) -> None:
        """Called on the first forward (or explicit unshard) of a unit nobody initialized: it becomes
        the root of every fully_shard unit below its modules."""
        if self.root is not None:
            return
        module = self.modules[0]
        found = list(states_under(module))
        check_not_meta(module)  # ranks made the same calls: checked at fully_shard() time (checks.py)
        if any(state is not self and state.manual_finalization for _, state in found):
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        root = RootContext([state for _, state in found], self.device, self.shared_ctx)
        root.owner = self
        for fqn, state in found:
            state.root = root
            state.is_root = state is self
            state.fqn = fqn
            for group in state.groups:
                # several groups: each named by its mesh (profiler rows, trace, errors), e.g. "layers.0[efsdp]"
                group.fqn = fqn if len(state.groups) == 1 else f"{fqn}[{group_label(group)}]"
                for p in group.params:
                    p.fqn = join_fqn(fqn, p.local_fqn)
                group.lazy_init(root.ctx)
        self.is_root = True

    @property
    def group(self) -> ParamGroup | None:
        """The unit's one group (None: no managed parameters). A unit with per-parameter meshes has several:
        ``groups`` (as torch's ``_fsdp_param_group`` asserts one)."""
        if len(self.groups) > 1:
            raise AssertionError(f"fully_shard unit {self.fqn or '<root>'!r} has {len(self.groups)} parameter groups "
                                 "(per-parameter meshes); use state.groups")
        return self.groups[0] if self.groups else None

    @property
    def _root(self) -> RootContext:
        if self.root is None:
            name = self.fqn or type(self.modules[0]).__name__
            raise RuntimeError(f"fully_shard unit {name!r} has no root: it ran a hook before lazy init. "
                               "Fix: run the first forward through the outermost module passed to fully_shard.")
        return self.root

    def _reshard_for_state_dict(self, *_: Any) -> None:
        """``state_dict()``/``load_state_dict()`` between steps always see the sharded DTensors, even
        after a forward that kept the parameters gathered (e.g. the root, or a no_grad forward)."""
        if self.training_state is TrainingState.IDLE:
            for group in self.groups:
                group.reshard()

    @property
    def effective_reshard_after_forward(self) -> bool | int:
        value = self.reshard_after_forward
        if value is None:
            return not self.is_root
        if not isinstance(value, bool):  # k=1 keeps everything, k=world is a full reshard
            if value == 1:
                return False
            if value == self.mesh_info.shard_world:
                return True
        return value

    # --- forward -----------------------------------------------------------------------------------
    def pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.root is None:
            self.lazy_init()
        if self.training_state is TrainingState.PRE_BACKWARD:  # activation-checkpoint recompute
            for group in self.groups:
                group.wait_for_unshard(Phase.BACKWARD)
            return self._cast_inputs(args, kwargs)  # the recompute sees the original forward's dtypes
        # A list unit's pass starts with whichever member runs first; every member's call casts its
        # inputs and makes sure the parameters are gathered (a member may run on its own, e.g. a
        # chunked loss calling the lm_head of a [norm, lm_head] unit once per chunk).
        first_in_pass = self.training_state is not TrainingState.FORWARD
        if first_in_pass:
            args, kwargs = self._start_pass(args, kwargs)
        if torch.is_grad_enabled() and self._member_params is not None:
            for group in self.groups:
                group.reducer.mark_used(self._member_params[module])
        args, kwargs = self._cast_inputs(args, kwargs)
        self._unshard(Phase.FORWARD)
        if first_in_pass:
            self._prefetch(self._forward_targets(), Phase.FORWARD)
            self._awaits_post_backward = False
            if torch.is_grad_enabled():
                args, kwargs = _register_post_backward(self, args, kwargs)
        return args, kwargs

    def _start_pass(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._modules_to_run = set(self.modules)
        root = self._root
        if root.pending_reduction is not None or root.ctx.active_reduction is not None:
            raise RuntimeError("The previous gradient reduction must be waited on before forward")
        if self.is_root:
            self._root_pre_forward()
            args, kwargs = self._move_inputs_to_device(args, kwargs)
        if not root.order_frozen and self not in root.forward_order:
            root.forward_order.append(self)
        self.training_state = TrainingState.FORWARD
        return args, kwargs

    def post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return self._cast_output(output)
        self._modules_to_run.discard(module)
        if torch.is_grad_enabled():  # every member's outputs: a member's backward may come first
            output = self._register_pre_backward(output)
            self.forward_rows = _rows(output)
        if not self._modules_to_run:  # the last member of a list unit (or the only module) finished
            self._finish_pass()
            if self.is_root:
                self._finish_partial_passes()
                self._root.ctx.end_forward()  # the last unit's gathered buffer goes (as torch)
        return self._cast_output(output)

    def _finish_pass(self) -> None:
        """Post-forward of the whole unit: reshard as configured and go back to IDLE."""
        self._modules_to_run = set()
        self.training_state = TrainingState.IDLE
        root = self.root
        if root is not None and not root.order_frozen and self not in root.post_forward_order:
            root.post_forward_order.append(self)
        for group in self.groups:
            if not torch.is_grad_enabled():  # no backward needs them; only an explicit False keeps them
                if self.reshard_after_forward is not False:
                    group.reshard(Phase.FORWARD)
                continue
            raf = self.effective_reshard_after_forward
            if raf is True:
                group.reshard(Phase.FORWARD)
            elif raf is not False:
                group.reshard(Phase.FORWARD, partial=True)

    def _finish_partial_passes(self) -> None:
        """End of the root's forward: list units some of whose members did not run (a model forward
        that skips the lm_head of a [norm, lm_head] unit) finish their pass now."""
        for state in self._root.states:
            if state is not self and state.training_state is TrainingState.FORWARD:
                state._finish_pass()

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output
        return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)

    def _root_pre_forward(self) -> None:
        root = self._root
        if root.forward_order:
            root.order_frozen = True
        root.reduces.drain()
        root.ctx.start_forward()  # this forward's first copy-in orders after compute (the optimizer step)

    def _move_inputs_to_device(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.device.type == "cpu":
            return args, kwargs
        move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return map_tensors(move, args), map_tensors(move, kwargs)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = self.mp_policy.param_dtype
        if dtype is None or not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        cast: Callable[[torch.Tensor], torch.Tensor] = (  # noqa: E731
            lambda t: t.to(dtype) if t.is_floating_point() else t)
        return map_tensors(cast, args), map_tensors(cast, kwargs)

    # --- prefetch ----------------------------------------------------------------------------------
    def _forward_targets(self) -> list[FSDPState]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        return self._neighbours(+1)

    def _backward_targets(self) -> list[FSDPState]:
        """The unit whose forward ended just before this one's: backward reaches it next. For the root
        (whose forward ends last) that is the last block, prefetched while the head's backward runs."""
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        root = self.root
        return self._neighbours(-1, root.post_forward_order if root is not None else [])

    def _neighbours(self, step: int, order: list[FSDPState] | None = None) -> list[FSDPState]:
        root = self.root
        if root is None:
            return []
        order = root.forward_order if order is None else order
        if not root.order_frozen or self not in order:
            return []
        i = order.index(self) + step
        return [order[i]] if 0 <= i < len(order) else []

    def _prefetch(self, targets: list[FSDPState], phase: Phase) -> None:
        for target in targets:
            for group in target.groups:  # every group of the target: one all-gather each, all issued
                if group.state in (GroupState.SHARDED, GroupState.PARTIALLY_SHARDED):
                    group.unshard(phase, prefetch=True)

    def _unshard(self, phase: Phase) -> None:
        """Issue every group's all-gather, then wait for each (several groups: their gathers overlap)."""
        groups = self.groups
        if len(groups) == 1:
            groups[0].unshard(phase)
            groups[0].wait_for_unshard(phase)
            return
        for group in groups:
            group.unshard(phase)
        for group in groups:
            group.wait_for_unshard(phase)

    # --- backward ----------------------------------------------------------------------------------
    def _register_pre_backward(self, output: Any) -> Any:
        for t in tensors(output):
            if t.requires_grad:
                t.register_hook(self.pre_backward)
        return output

    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad
        # A list unit whose pass is still open (a member run on its own, e.g. once per loss chunk,
        # each chunk with its own backward) is outside the model's step: its backward prefetches
        # nothing and, when its post-backward will reduce, does not end the step (which would
        # reshard the root and the units still waiting for the model's backward), as in torch.
        partial_pass = self.training_state is TrainingState.FORWARD
        if not (partial_pass and self._awaits_post_backward):
            self._queue_final_callback()
        else:  # ... but this backward still leaves complete gradients: its reduces finish at its end
            self._queue_reduce_callback()
        self.training_state = TrainingState.PRE_BACKWARD
        self._unshard(Phase.BACKWARD)
        if not partial_pass:
            self._prefetch(self._backward_targets(), Phase.BACKWARD)
        return grad

    def _queue_final_callback(self) -> None:
        root = self._root
        if not root.callback_queued:
            root.callback_queued = True
            if root.manual_active is None:  # the mode this backward iteration runs in (finalize.py)
                root.manual_active = root.owner.manual_finalization if root.owner is not None else False
            torch.autograd.Variable._execution_engine.queue_callback(self.root_final_callback)

    def _queue_reduce_callback(self) -> None:
        root = self._root
        if not root.reduce_callback_queued:
            root.reduce_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_reduces_callback)

    def finish_reduces_callback(self) -> None:
        """End of a backward that ended inside a list unit's open pass (a member run on its own, e.g.
        per loss chunk): finish its reduces, so ``.grad`` is complete when ``backward()`` returns."""
        root = self._root
        root.reduce_callback_queued = False
        root.reduces.drain()
        root.ctx.end_backward(reduces_finished=True, step_ended=False)

    def post_backward(self, only: ParamGroup | None = None) -> None:
        """All gradients of this unit's parameters for one forward call are ready (``only``: reduce just
        that group, as torch's pipelining calls each group's ``post_backward``)."""
        self.training_state = TrainingState.POST_BACKWARD
        groups = [g for g in self.groups if g.state is GroupState.UNSHARDED and (only is None or g is only)]
        self._reduce(groups)
        for group in groups:  # (a reduce that took grads has resharded already: reshard_first)
            if group.reshard_after_backward and group.state is not GroupState.SHARDED:
                group.reshard(Phase.BACKWARD)

    def _reduce(self, groups: list[ParamGroup]) -> None:
        """Reduce-scatter the grads of ``groups`` (one unit's) and queue them; the root's queue decides when
        they finish. Room is made once, before the first group's buffers: a unit's groups are all issued
        before any of them is waited, so their collectives overlap."""
        if not groups:
            return
        reduces = (self.root or self._root).reduces  # (_root raises without one)
        if groups[0].reducer.requires_gradient_sync:
            reduces.make_room(groups[0].reducer)  # before this unit's reduce buffers are allocated
        issued = [g for g in groups if g.reduce_grads(reshard_first=g.reshard_after_backward)]
        for group in issued:
            reduces.push(group.reducer, self._reduce_bytes(group))

    def _reduce_bytes(self, group: ParamGroup) -> ReduceBytes:
        """``group``'s reduce for the root's ``ReduceQueue``: its input, the shard it leaves, and the
        activations its weights kept for backward (from the forward's output rows; shapes only)."""
        rows = self.forward_rows
        cached = self._reduce_bytes_of.get(id(group))
        if cached is not None and cached[0] == rows:  # (the same shapes every step: built once)
            return cached[1]
        nbytes = group.flat.total_numel * group.reduce_dtype.itemsize
        released = activation_bytes(rows, self._in_features.get(id(group), 0), group.param_dtype)
        value = ReduceBytes(nbytes, nbytes // group.flat.world, released)
        self._reduce_bytes_of[id(group)] = (rows, value)
        return value

    def root_final_callback(self) -> None:
        """End of backward: reduce what no post-backward hook caught, reshard, finish reduces. Under manual
        backward finalization (finalize.py) the groups with gradients still to reduce stay as they are,
        and the reductions in flight are finished by ``finalize_backward``."""
        root = self._root
        manual = bool(root.manual_active)
        for state in root.states:
            left = [g for g in state.groups if g.has_unsharded_grads()]
            kept = [g for g in left if manual and g.reducer.requires_gradient_sync]  # finalize_backward's
            self._reduce([g for g in left if g not in kept])
            for group in state.groups:
                if group in kept:
                    continue
                # an all-gather a prefetch issued for a unit whose backward never ran: dropped whatever
                # reshard_after_backward says (as torch), else the next forward would use it, gathered
                # before the optimizer step, and the step would write shards its copy-in may still read
                if group.state is GroupState.UNSHARDING or (
                        group.state is not GroupState.SHARDED and group.reshard_after_backward):
                    group.reshard(Phase.BACKWARD)
                if group.reducer.requires_gradient_sync:
                    group.reducer.clear_used()
            state.training_state = TrainingState.IDLE
            state._modules_to_run = set()  # a list unit's pass some of whose members never ran
        # else finished later (the next backward's end, or finalize_backward)
        last = not manual and any(s.is_root and s.is_last_backward for s in root.states)
        if last:
            root.reduces.drain()
            root.manual_active = None  # the backward iteration ended (its mode may change now)
        root.ctx.end_backward(reduces_finished=last, step_ended=True)
        root.callback_queued = False
        root.order_frozen = True


def _rows(output: Any) -> int:
    """Rows of a forward output (its first tensor's elements over its last dim; 0 without one)."""
    t = output if isinstance(output, torch.Tensor) else next(iter(tensors(output)), None)
    if t is None or t.dim() == 0 or t.shape[-1] == 0:
        return 0
    return t.numel() // t.shape[-1]


def _post_backward_backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
    """Both forms' backward: the unit's post-backward, then the inputs' gradients unchanged."""
    ctx.state.post_backward()
    return (None, *grads)


def _post_backward_jvp(ctx: Any, _state_tangent: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tangents


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once their gradients are computed,
    i.e. after the unit's own backward, and triggers the unit's post-backward.

    Written in the ``setup_context`` form with a ``jvp`` and a generated vmap rule so that
    torch.func transforms (jvp, vmap, grad) can run through a unit."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.state = inputs[0]

    backward = staticmethod(_post_backward_backward)
    jvp = staticmethod(_post_backward_jvp)


class _PostBackwardEager(torch.autograd.Function):
    """``_PostBackward`` in the ``forward(ctx, ...)`` form, used outside torch.func transforms:
    ``Function.apply`` binds a ``setup_context`` form's arguments through ``inspect.signature`` on
    every call (a unit's forward pays it once per step); this form skips that."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.state = state
        return inputs

    backward = staticmethod(_post_backward_backward)
    jvp = staticmethod(_post_backward_jvp)


def _register_post_backward(state: FSDPState, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if not kwargs and type(args) is tuple and all(isinstance(a, torch.Tensor) for a in args):
        return _register_post_backward_tensors(state, args), kwargs  # a forward of tensors only: no tree walk
    flat = [t for t in tensors((args, kwargs)) if t.requires_grad]
    if not flat:
        return args, kwargs
    outputs = _apply_post_backward(state, flat)
    replacement = {id(t): o for t, o in zip(flat, outputs)}
    swap: Callable[[torch.Tensor], torch.Tensor] = lambda t: replacement.get(id(t), t)  # noqa: E731
    return map_tensors(swap, args), map_tensors(swap, kwargs)


def _register_post_backward_tensors(state: FSDPState, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``_register_post_backward`` for positional tensor args: the same Function call, the same outputs."""
    flat = [t for t in args if t.requires_grad]
    if not flat:
        return args
    outputs = iter(_apply_post_backward(state, flat))
    return tuple([next(outputs) if t.requires_grad else t for t in args])


def _apply_post_backward(state: FSDPState, flat: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``flat`` (the grad-requiring inputs) through the post-backward Function: the form torch.func needs
    under its transforms, else the eager form."""
    state._awaits_post_backward = True
    function = _PostBackward if torch._C._are_functorch_transforms_active() else _PostBackwardEager
    return function.apply(state, *flat)


def _member_params(modules: tuple[nn.Module, ...],
                   groups: list[ParamGroup]) -> dict[nn.Module, list[ShardedParam]] | None:
    """A list unit's parameters under each member module (None for a one-module unit): a member
    that did not run forward leaves its parameters' grads None (design/hooks.md)."""
    if len(modules) < 2 or not groups:
        return None
    found: dict[nn.Module, list[ShardedParam]] = {}
    for member in modules:
        subs = {id(m) for m in member.modules()}
        found[member] = [p for g in groups for p in g.params if any(id(m) in subs for m, _ in p.slots)]
    return found


def group_label(group: ParamGroup) -> str:
    """A group of a several-group unit by its mesh's dim names (its shape without names): ``efsdp``,
    ``dp_replicate,efsdp``."""
    mesh = group.mesh_info.mesh
    return ",".join(mesh.mesh_dim_names or tuple(str(n) for n in mesh.shape))


def get_state(module: nn.Module) -> FSDPState | None:
    return module.__dict__.get("_fsdp_state")


def states_under(module: nn.Module) -> Iterator[tuple[str, FSDPState]]:
    """Every fully_shard state at or below ``module``, once each (a list unit is reached through its
    first module), with the FQN of that module relative to ``module``, in ``named_modules`` order."""
    seen: set[int] = set()
    for fqn, sub in module.named_modules():
        state = get_state(sub)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            yield fqn, state
