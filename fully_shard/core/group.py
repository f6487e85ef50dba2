"""ParamGroup: the unit of communication (one fully_shard call); unshard, reshard and reduce.

See design/param-lifecycle.md for the state machine. The group tells each transition once: the tensors
of its all-gather are its ``GatherPlan``'s (gather_plan.py), the stream protocol is its ``CommContext``'s
verbs (comm/streams.py), the reduce side is its ``Reducer``'s (reduce.py); what the group does itself is
put the sharded or the unsharded parameters in the modules' slots:

    SHARDED --unshard()--> UNSHARDING --wait_for_unshard()--> UNSHARDED
       ^                                                          |
       +------------------- reshard() ---------------------------+
       |                                                          | reshard(partial=True)
       +--- reshard() --- PARTIALLY_SHARDED <---------------------+   (reshard_after_forward=k)
                               |  unshard() gathers within the k-rank subgroup
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..comm import trace
from ..comm.streams import CommContext, Pending
from ..parallel.mesh import MeshInfo, SubgroupInfo
from . import grad_mode
from .gather_plan import GatherPlan, GatherVariant
from .layout import FlatLayout
from .param import ShardedParam
from .policy import AllGatherPolicy, MixedPrecisionPolicy, QuantizedAllGather, default_reduce_dtype
from .quantize import BlockLayout
from .reduce import ReduceQueue, Reducer

__all__ = ["GroupState", "ParamGroup", "ReduceQueue"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _outside_functorch(method: _F) -> _F:
    """Run ``method`` with torch.func transforms (jvp, vmap, grad) switched off, as torch's FSDP2
    does: the buffers and collectives of gathering and freeing are plain tensors, never functorch
    wrappers (which have no storage to resize and cannot be communicated). The gathered parameters
    then enter the transformed function as constants (zero tangent). ``torch._C`` holds the only
    switch torch offers for this."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class GroupState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDING = "unsharding"  # all-gather issued, not yet waited
    UNSHARDED = "unsharded"
    PARTIALLY_SHARDED = "partially_sharded"  # sharded over a k-rank subgroup after forward


class ParamGroup:
    """All managed parameters of one fully_shard call, communicated together."""

    def __init__(self, params: list[ShardedParam], fqn: str, mesh_info: MeshInfo, device: torch.device,
                 mp_policy: MixedPrecisionPolicy, subgroup: SubgroupInfo | None, *,
                 all_gather_policy: AllGatherPolicy = AllGatherPolicy(),
                 data_parallel_world: int | None = None) -> None:
        self.params = params
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.subgroup = subgroup
        self.flat = FlatLayout(tuple(p.layout for p in params))
        # QuantizedAllGather: the int8 blocks of one rank's segment (design/quantized-all-gather.md)
        self.blocks = (BlockLayout(self.flat.sizes, all_gather_policy.block_size)
                       if isinstance(all_gather_policy, QuantizedAllGather) else None)
        self.state = GroupState.SHARDED
        self.ctx: CommContext | None = None  # the root's, set at lazy init
        # every (module, attribute, parameter) slot the group's parameters are registered in
        self._slots = tuple((module, name, p) for p in params for module, name in p.slots)
        self.gather_plan: GatherPlan | None = None  # built at lazy init (_plan_gather)
        # the gathered buffer, its collective and its trace event, between unshard and wait_for_unshard
        self._pending_unshard: tuple[torch.Tensor, Pending, trace.TraceEvent | None] | None = None
        # reshard_after_forward=k: the block kept at reshard, and the event recorded on compute after it
        self._partial_shard: torch.Tensor | None = None
        self._partial_shard_event: Any = None
        # the reduce side: which parameters take part, its settings, flags, reduces in flight
        self.reducer = Reducer(fqn, mesh_info, device, data_parallel_world)
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # set_unshard_in_backward
        self._custom_all_gather: Any = None  # set_custom_all_gather / PG allocation: allocate() + __call__()
        # set_keep_unsharded_storage: reshard registers the sharded parameters but keeps the unsharded storage
        self.keep_unsharded_storage = False
        self._unset_reduce_dtype = torch.get_default_dtype()  # (a group without parameters reduces nothing)
        # each parameter's all-gather/compute dtype (its param_dtype, param_dtype_override_fn applied, else its
        # own); where they differ the plan gathers bytes (GatherVariant.BYTES, torch 2.15's uint8 all-gather)
        self.dtypes: tuple[torch.dtype, ...] = ()
        self._check_dtypes()

    @property
    def fqn(self) -> str:
        """The unit's module FQN relative to the root ("" for the root), known from lazy init on."""
        return self.reducer.fqn

    @fqn.setter
    def fqn(self, fqn: str) -> None:
        self.reducer.fqn = fqn

    # --- dtypes ---------------------------------------------------------------------------------
    def _check_dtypes(self) -> None:
        """The group's dtypes are fixed here (at construction, lazy init and after ``module.to(dtype)``):
        checked, and the reduce dtype under ``reduce_dtype=None`` (``policy.default_reduce_dtype``) kept."""
        if self.params:
            self.dtypes = tuple(p.param_dtype or p.orig_dtype for p in self.params)
            self._unset_reduce_dtype = default_reduce_dtype(self.dtypes, (p.orig_dtype for p in self.params))
        if self.blocks is not None:
            self._check_quantizable()
        if self.mp_policy.param_dtype is not None or not self.params:
            return
        dtypes = {p.orig_dtype for p in self.params}
        if len(dtypes) > 1:
            found = ", ".join(f"{p.fqn}: {p.orig_dtype}" for p in self.params)
            unit = "this fully_shard call" if self.ctx is None else f"fully_shard unit {self.fqn or '<root>'!r}"
            raise ValueError(
                f"{unit} groups parameters of several dtypes ({found}); one "
                "all-gather moves one dtype. Fix: pass mp_policy=MixedPrecisionPolicy(param_dtype=...) "
                "or shard the differing submodules in their own fully_shard calls.")

    def _check_quantizable(self) -> None:
        if len(set(self.dtypes)) > 1:
            raise NotImplementedError(
                f"fully_shard({self.fqn or '<root>'}) with QuantizedAllGather and param_dtype_override_fn keeping "
                f"some parameters in another dtype ({sorted(set(map(str, self.dtypes)))}): the int8 blocks dequantize "
                "into one param_dtype. Fix: drop one of the two, or shard those parameters in their own call.")
        bad = [f"{p.fqn}: {p.orig_dtype}" for p in self.params if not p.orig_dtype.is_floating_point]
        if bad or not self.param_dtype.is_floating_point:
            raise ValueError(
                f"fully_shard({self.fqn or '<root>'}) with QuantizedAllGather: int8 blocks quantize floating-point "
                f"parameters into a floating param_dtype; found {', '.join(bad) or self.param_dtype}. Fix: pass "
                "those parameters in ignored_params, or shard them in a fully_shard call without the policy.")

    @property
    def param_dtype(self) -> torch.dtype:
        """The unit's compute dtype (its inputs are cast to it); ``dtypes`` has each parameter's."""
        return self.mp_policy.param_dtype or self.params[0].orig_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self._unset_reduce_dtype

    @property
    def grad_params(self) -> list[ShardedParam]:
        return [p for p in self.params if p.requires_grad]

    @property
    def custom_all_gather(self) -> Any:
        """``set_custom_all_gather``'s object (or the process-group allocation's): ``allocate()`` + ``__call__()``."""
        return self._custom_all_gather

    @custom_all_gather.setter
    def custom_all_gather(self, custom: Any) -> None:
        self._custom_all_gather = custom
        if self.ctx is not None:  # planned already: again with the new collective and allocator
            self._plan_gather()

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes of the gathered buffer, each parameter at its ``dtypes`` entry (padding included)."""
        if self.gather_plan is not None:
            return self.gather_plan.nbytes
        return self.flat.world * sum(n * d.itemsize for n, d in zip(self.flat.sizes, self.dtypes))

    def check_subgroup(self, reshard_after_forward: bool | int | None) -> None:
        """A k-rank partial reshard needs the k-rank subgroups created at fully_shard time."""
        k = reshard_after_forward
        if k is None or isinstance(k, bool) or not 1 < k < self.mesh_info.shard_world:
            return
        if self.subgroup is None or self.subgroup.world != k:
            raise ValueError(f"set_reshard_after_forward({k}) needs the {k}-rank subgroups created at "
                             f"fully_shard time. Fix: pass reshard_after_forward={k} to fully_shard.")

    # --- state machine ---------------------------------------------------------------------------
    def _transition(self, expected: tuple[GroupState, ...], new: GroupState, action: str) -> None:
        if self.state not in expected:  # (a tuple: members compare by identity, no enum hashing)
            names = " or ".join(sorted(s.name for s in expected))
            raise RuntimeError(f"fully_shard unit {self.fqn or '<root>'}: cannot {action}: expected state "
                               f"{names}, found {self.state.name}")
        self.state = new

    def _emit(self, kind: trace.EventKind, phase: trace.Phase, **kw: object) -> trace.TraceEvent | None:
        return trace.emit_if_observed(kind, self.fqn, phase, **kw)

    def _register(self, *, unsharded: bool) -> None:
        """Put the unsharded (or the sharded) parameters in every module slot that holds them. An unsharded
        parameter takes the sharded one's ``requires_grad`` (set only where the user changed it since the
        last unshard: ``requires_grad_`` is a C++ call; torch's ``to_unsharded`` does the same), so a
        parameter frozen or unfrozen between steps gets, or stops getting, its gradient."""
        if unsharded:
            for p in self.params:
                flag = p.sharded_param.requires_grad
                if p.unsharded_param is not None and p.unsharded_param.requires_grad is not flag:
                    p.unsharded_param.requires_grad_(flag)
        for module, name, p in self._slots:
            module._parameters[name] = p.unsharded_param if unsharded else p.sharded_param  # type: ignore[assignment]

    def register_sharded(self) -> None:
        """``fully_shard()``: the sharded DTensor parameters replace the modules' parameters."""
        self._register(unsharded=False)

    @property
    def _ctx(self) -> CommContext:
        if self.ctx is None:
            raise RuntimeError(f"fully_shard unit {self.fqn or '<root>'}: communication before lazy init "
                               "(the first forward, or unshard() on a module passed to fully_shard, sets it "
                               "up). Fix: run a forward first, or call unshard() on the FSDP module.")
        return self.ctx

    # --- unshard -------------------------------------------------------------------------------
    @_outside_functorch
    def lazy_init(self, ctx: CommContext) -> None:
        self.ctx = ctx
        for p in self.params:
            p.adopt_module_param()
        self._check_dtypes()
        for p, dtype in zip(self.params, self.dtypes):
            p.init_unsharded(dtype, self.device)
        self._plan_gather()

    def adopt_module_params(self) -> None:
        """After ``module.to(dtype)``/``_apply`` replaced or converted the sharded parameters: re-read
        them and re-create the unsharded storage at the new ``param_dtype`` (lazily initialized groups)."""
        for p in self.params:
            p.adopt_module_param()
        self._check_dtypes()
        if self.ctx is not None:
            for p, dtype in zip(self.params, self.dtypes):
                p.init_unsharded(dtype, self.device)
            self._plan_gather()

    def _plan_gather(self) -> None:
        """(Re)build the all-gather's plan from the parameters as they are now (a tensor-subclass unit keeps
        the layout its ranks agreed on)."""
        self.gather_plan = GatherPlan(self.params, fqn=self.fqn, flat=self.flat, blocks=self.blocks,
                                      dtypes=self.dtypes, device=self.device, mesh_info=self.mesh_info,
                                      subgroup=self.subgroup, mp_policy=self.mp_policy, custom=self._custom_all_gather,
                                      agreed=self.gather_plan)

    @_outside_functorch
    def unshard(self, phase: trace.Phase = trace.Phase.EXPLICIT, *, prefetch: bool = False) -> None:
        """Issue the all-gather (asynchronously); ``wait_for_unshard`` makes the params usable."""
        if self.state in (GroupState.UNSHARDED, GroupState.UNSHARDING) or not self.params:
            return
        if self._skips_backward_unshard(phase):
            return
        partial = self.state is GroupState.PARTIALLY_SHARDED
        self._transition((GroupState.SHARDED, GroupState.PARTIALLY_SHARDED), GroupState.UNSHARDING, "unshard")
        ctx, plan = self._ctx, self.gather_plan
        assert plan is not None  # (built at lazy init, which _ctx checked)
        with grad_mode.no_grad():
            if partial:  # reshard_after_forward=k: gathered within the k-rank subgroup from the kept block
                block, written = self._partial_shard, self._partial_shard_event
                assert block is not None and plan.gather_kept is not None
                self._partial_shard = self._partial_shard_event = None
                out, pending = ctx.all_gather(functools.partial(plan.copy_in_kept, block), plan.gather_kept,
                                              after=written, hold=block)
            else:
                out, pending = ctx.all_gather(plan.copy_in, plan.gather,
                                              prepare=plan.agree if plan.variant is GatherVariant.SUBCLASS else None)
        event = None
        if trace.observers:
            over = plan.kept_over if partial else plan.over
            assert over is not None
            event = self._emit(trace.EventKind.ALL_GATHER, phase, nbytes=out.nbytes, group_size=over.world,
                               prefetch=prefetch, timing=pending.timing)
        self._pending_unshard = (out, pending, event)

    def _skips_backward_unshard(self, phase: trace.Phase) -> bool:
        """``set_unshard_in_backward(False)``: backward does not need these parameters (an embedding's
        weight gradient reads only indices): no backward all-gather; autograd still accumulates the
        full-size gradient into the freed unsharded parameter, reduced at the end of backward."""
        return (phase is trace.Phase.BACKWARD and not self.unshard_in_backward
                and self.state is not GroupState.UNSHARDING)

    @_outside_functorch
    def wait_for_unshard(self, phase: trace.Phase = trace.Phase.EXPLICIT) -> None:
        """Finish the all-gather, copy out into the unsharded params and register them."""
        if self.state is GroupState.UNSHARDED or not self.params or self._skips_backward_unshard(phase):
            return
        if self.state is not GroupState.UNSHARDING:
            self.unshard(phase)
        assert self._pending_unshard is not None
        out, pending, event = self._pending_unshard
        self._pending_unshard = None
        assert self.gather_plan is not None
        with grad_mode.no_grad():
            exposed = self._ctx.finish_all_gather(out, pending, self.gather_plan.copy_out,
                                                  hold=phase is trace.Phase.FORWARD, event=event)
        self._register(unsharded=True)
        self._transition((GroupState.UNSHARDING,), GroupState.UNSHARDED, "finish unshard")
        if trace.observers:  # (the byte count is not computed for nobody)
            self._emit(trace.EventKind.UNSHARD, phase, nbytes=self.unsharded_nbytes, exposed_s=exposed)

    # --- reshard -------------------------------------------------------------------------------
    @_outside_functorch
    def reshard(self, phase: trace.Phase = trace.Phase.EXPLICIT, *, partial: bool = False) -> None:
        """Free the unsharded params (``keep_unsharded_storage``: register the sharded ones, keep the storage);
        with ``partial`` keep this rank's k-subgroup block first."""
        if self.state is GroupState.UNSHARDING:
            self.wait_for_unshard(phase)
        if self.state is not GroupState.UNSHARDED:
            if self.state is GroupState.PARTIALLY_SHARDED and not partial:
                self._partial_shard = self._partial_shard_event = None
                self.state = GroupState.SHARDED
            return
        plan = self.gather_plan
        assert plan is not None  # (UNSHARDED: initialized)
        keep = partial and self.subgroup is not None
        if keep:
            with grad_mode.no_grad():
                block = plan.kept()
            self._partial_shard = block
            self._partial_shard_event = self._ctx.compute_event()  # (its copy-in, on another stream, follows it)
        if not self.keep_unsharded_storage:  # set_keep_unsharded_storage: data pointers stay (CUDA graphs)
            plan.free()
        self._register(unsharded=False)
        # (UNSHARDED -> new: checked on entry, as _transition would)
        self.state = GroupState.PARTIALLY_SHARDED if keep else GroupState.SHARDED
        if trace.observers:
            kept = self._partial_shard if keep else None
            self._emit(trace.EventKind.RESHARD, phase, nbytes=kept.nbytes if kept is not None else 0)

    def reset(self) -> None:
        """``reset_iter_state``: finish the all-gather in flight, drop the failed step's reduces and
        gradients and register the sharded parameters again (SHARDED)."""
        if self._pending_unshard is not None:
            self._pending_unshard[1].wait(self._ctx)
            self._pending_unshard = None
            self.state = GroupState.UNSHARDED  # nothing copied out: reshard() frees and re-registers
        self.reshard()
        self.reducer.discard(self.params)
        self.reducer.clear_used()

    # --- gradients (always reduced in, or finished after, a backward) ---------------------------
    def reduce_grads(self, *, reshard_first: bool = False) -> bool:
        """Post-backward: hand the unsharded grads to the reducer; True when a reduce was issued.
        ``reshard_first``: free the unsharded params once their grads are taken (see ``Reducer.reduce``)."""
        return self.reducer.reduce(self.params, self.reduce_dtype, self._ctx,
                                   before_alloc=self._reshard_in_backward if reshard_first else None)

    def _reshard_in_backward(self) -> None:
        self.reshard(trace.Phase.BACKWARD)

    def has_unsharded_grads(self) -> bool:
        return any(p.unsharded_param is not None and p.unsharded_param.grad is not None
                   for p in self.grad_params)

    def __repr__(self) -> str:
        lines = [f"ParamGroup({self.fqn or '<root>'}, {self.state.name}, {len(self.params)} params)"]
        lines += [f"  {p!r}" for p in self.params]
        return "\n".join(lines)
