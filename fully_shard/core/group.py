"""ParamGroup: the unit of communication (one fully_shard call); unshard, reshard and reduce.

See design/param-lifecycle.md for the state machine and design/data-path.md for the buffers (every
collective call itself lives in collectives.py, the streams it runs on in streams.py):

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
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..comm import collectives, trace
from ..comm.streams import CommContext, Pending
from ..parallel.mesh import MeshInfo, SubgroupInfo
from . import buffers, grad_mode
from .gather_plan import GatherPlan
from .layout import ByteLayout, FlatLayout
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
        self.comm: CommContext | None = None  # the root's, set at lazy init
        # the gathered buffer, its collective, its trace event, and the k-partial block its copy-in read
        self._pending_unshard: tuple[torch.Tensor, Pending, trace.TraceEvent | None, torch.Tensor | None] | None = None
        self.gather_plan: GatherPlan | None = None  # tensor-subclass params (extension.py)
        self._partial_shard: torch.Tensor | None = None
        self._partial_shard_event: Any = None  # recorded on compute after writing it (accelerators)
        # the reduce side: its settings, flags, reduces in flight
        self.reducer = Reducer(fqn, mesh_info, device, data_parallel_world)
        self._grad_flat: tuple[tuple[bool, ...], list[ShardedParam], FlatLayout] | None = None
        # List units: the parameters of members that ran forward since the last synced backward;
        # None: every parameter (one-module units). See design/hooks.md, "List units".
        self._used: set[int] | None = None
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # set_unshard_in_backward
        self.all_gather_comm: Any = None  # set_custom_all_gather / PG allocation: allocate() + __call__()
        self._unset_reduce_dtype = torch.get_default_dtype()  # (a group without parameters reduces nothing)
        # each parameter's all-gather/compute dtype (its param_dtype, param_dtype_override_fn applied, else its
        # own), and where they differ the segment in bytes: one uint8 all-gather (torch 2.15's)
        self.dtypes: tuple[torch.dtype, ...] = ()
        self.bytes: ByteLayout | None = None
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
            self.bytes = ByteLayout(self.flat, tuple(d.itemsize for d in self.dtypes)) if len(set(self.dtypes)) > 1 \
                else None
            self._unset_reduce_dtype = default_reduce_dtype(self.dtypes, (p.orig_dtype for p in self.params))
        if self.blocks is not None:
            self._check_quantizable()
        if self.mp_policy.param_dtype is not None or not self.params:
            return
        dtypes = {p.orig_dtype for p in self.params}
        if len(dtypes) > 1:
            found = ", ".join(f"{p.fqn}: {p.orig_dtype}" for p in self.params)
            unit = "this fully_shard call" if self.comm is None else f"fully_shard unit {self.fqn or '<root>'!r}"
            raise ValueError(
                f"{unit} groups parameters of several dtypes ({found}); one "
                "all-gather moves one dtype. Fix: pass mp_policy=MixedPrecisionPolicy(param_dtype=...) "
                "or shard the differing submodules in their own fully_shard calls.")

    def _check_quantizable(self) -> None:
        if self.bytes is not None:
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

    def mark_used(self, params: list[ShardedParam]) -> None:
        """A list unit's member ran forward with grad enabled: its ``params`` take part in the next
        synced reduce (with zeros where this rank computed no gradient)."""
        self._used = (self._used or set()) | {id(p) for p in params}

    def clear_used(self) -> None:
        if self._used is not None:
            self._used = set()

    def _reduced(self, p: ShardedParam) -> bool:
        """Whether ``p`` takes part in a reduce: trainable and, in a list unit, under a member that ran
        (or holding a gradient), so a member no rank ran keeps ``.grad = None`` as in torch. Under
        ``set_reduce_scatter_unused_params(False)`` only a parameter holding a gradient on this rank
        (torch's default: every rank must then agree on which are unused)."""
        if not p.requires_grad:
            return False
        used = self._used is None or id(p) in self._used
        reducer = self.reducer
        if used and reducer.settings.unused_params is not False:  # False: torch's skip, see below
            return True
        if not reducer.requires_all_reduce or reducer.partial_output is not None:
            return True  # HSDP without all-reduce sums outputs across reduces: one layout
        return p.unsharded_accumulated_grad is not None or (
            p.unsharded_param is not None and p.unsharded_param.grad is not None)

    def _grad_layout(self) -> tuple[list[ShardedParam], FlatLayout]:
        """The parameters reduced now and their flat layout (the reduce-scatter buffers), rebuilt only
        when that set changed."""
        key = tuple(map(self._reduced, self.params))
        if self._grad_flat is None or self._grad_flat[0] != key:
            params = [p for p, reduced in zip(self.params, key) if reduced]
            self._grad_flat = (key, params, FlatLayout(tuple(p.layout for p in params)))
        return self._grad_flat[1], self._grad_flat[2]

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes of the gathered buffer at ``param_dtype`` (padding included)."""
        if self.gather_plan is not None and self.gather_plan.split is not None:  # tensor subclasses
            return self.gather_plan.nbytes
        if self.bytes is not None:
            return self.bytes.total_numel
        return self.flat.total_numel * self.dtypes[0].itemsize

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

    @property
    def _comm(self) -> CommContext:
        if self.comm is None:
            raise RuntimeError(f"fully_shard unit {self.fqn or '<root>'}: communication before lazy init "
                               "(the first forward, or unshard() on a module passed to fully_shard, sets it "
                               "up). Fix: run a forward first, or call unshard() on the FSDP module.")
        return self.comm

    # --- unshard -------------------------------------------------------------------------------
    @_outside_functorch
    def lazy_init(self, comm: CommContext) -> None:
        self.comm = comm
        for p in self.params:
            p.adopt_module_param()
        self._check_dtypes()
        for p, dtype in zip(self.params, self.dtypes):
            p.init_unsharded(dtype, self.device)
        self.gather_plan = GatherPlan.of(self, collectives.all_gather_object)

    def adopt_module_params(self) -> None:
        """After ``module.to(dtype)``/``_apply`` replaced or converted the sharded parameters: re-read
        them and re-create the unsharded storage at the new ``param_dtype`` (lazily initialized groups)."""
        for p in self.params:
            p.adopt_module_param()
        self._check_dtypes()
        if self.comm is not None:
            for p, dtype in zip(self.params, self.dtypes):
                p.init_unsharded(dtype, self.device)

    @_outside_functorch
    def unshard(self, phase: trace.Phase = trace.Phase.EXPLICIT, *, prefetch: bool = False) -> None:
        """Issue the all-gather (asynchronously); ``wait_for_unshard`` makes the params usable."""
        if self.state in (GroupState.UNSHARDED, GroupState.UNSHARDING) or not self.params:
            return
        if self._skips_backward_unshard(phase):
            return
        partial = self.state is GroupState.PARTIALLY_SHARDED
        self._transition((GroupState.SHARDED, GroupState.PARTIALLY_SHARDED), GroupState.UNSHARDING, "unshard")
        over = self._gather_over(partial)
        # reshard_after_forward=k: the kept block is read by the copy-in stream; it stays alive until the
        # all-gather is waited (compute then follows the copy-in), as the caching allocator needs
        kept = self._partial_shard if partial else None
        with grad_mode.no_grad():
            out = self._copy_in(partial)
            pending = self._issue_all_gather(out, over)
        event = self._emit(trace.EventKind.ALL_GATHER, phase, nbytes=out.nbytes,
                           group_size=over.world, prefetch=prefetch, timing=pending.timing)
        self._pending_unshard = (out, pending, event, kept)

    def _gather_over(self, partial: bool) -> SubgroupInfo:
        """The ranks the all-gather runs over: the k-subgroup after a partial reshard, else the shard
        group."""
        if not partial:
            return self.mesh_info.shard_subgroup
        assert self.subgroup is not None
        return self.subgroup

    def _copy_in(self, partial: bool) -> torch.Tensor:
        """A fresh gathered buffer holding this rank's segment, written on the copy-in stream."""
        ctx = self._comm
        copy_in_stream = ctx.stream("all_gather_copy_in")
        # the shards may have just been updated by the optimizer on the compute stream
        ctx.order_copy_in(copy_in_stream)  # after the optimizer step (or set_post_optim_event's event)
        if self.gather_plan is not None and self.gather_plan.agree():  # first unshard: on compute, then
            ctx.wait_stream(copy_in_stream, ctx.current_stream())  # the copy-in reads the pre-hooks' inputs
        alloc = self.all_gather_comm.allocate if self.all_gather_comm is not None else None
        with ctx.on(copy_in_stream):
            ctx.release_all_gather_buffer()
            if self.gather_plan is not None:  # (never partial nor quantized: GatherPlan.of)
                return self.gather_plan.copy_in(self.mesh_info.shard_rank, alloc=alloc)
            if self.blocks is not None:  # (never partial: check_all_gather_policy)
                return buffers.quantized_all_gather_copy_in(self.params, self.blocks, self.mesh_info.shard_rank,
                                                                self.flat.world, self.device, alloc=alloc)
            if not partial and self.bytes is not None:
                return buffers.mixed_all_gather_copy_in(self.params, self.dtypes, self.bytes,
                                                        self.mesh_info.shard_rank, self.device, alloc=alloc)
            if not partial:
                return buffers.all_gather_copy_in(self.params, self.flat, self.mesh_info.shard_rank,
                                                      self.dtypes[0], self.device, alloc=alloc)
            assert self.subgroup is not None and self._partial_shard is not None
            if self._partial_shard_event is not None:  # written on compute at reshard: read after it
                copy_in_stream.wait_event(self._partial_shard_event)
                self._partial_shard_event = None
            block, self._partial_shard = self._partial_shard, None
            if self.bytes is not None:
                return buffers.partial_all_gather_copy_in(block, self.bytes, self.subgroup, torch.uint8, self.device,
                                                          alloc=alloc)
            return buffers.partial_all_gather_copy_in(block, self.flat, self.subgroup, self.dtypes[0],
                                                          self.device, alloc=alloc)

    def _issue_all_gather(self, out: torch.Tensor, over: SubgroupInfo) -> Pending:
        ctx = self._comm
        ctx.wait_stream(ctx.stream("all_gather"), ctx.stream("all_gather_copy_in"))
        return ctx.issue("all_gather", lambda a: collectives.all_gather(out, over, a, comm=self.all_gather_comm))

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
        out, pending, event, kept = self._pending_unshard
        self._pending_unshard = None
        traced = event is not None or trace.enabled()  # (the clock is read only for an observer)
        t0 = time.perf_counter() if traced else 0.0
        pending.wait(self._comm)
        del kept  # the compute stream now follows the copy-in that read it: free to reuse
        exposed = time.perf_counter() - t0 if traced else 0.0
        if event is not None:
            event.t_end = time.perf_counter()
            event.exposed_s = exposed
        with grad_mode.no_grad():
            for p in self.params:
                p.alloc_unsharded()
            if self.gather_plan is not None:
                self.gather_plan.copy_out(out)
            elif self.blocks is not None:
                buffers.quantized_all_gather_copy_out(out, self.params, self.blocks, self.dtypes[0])
            elif self.bytes is not None:
                buffers.mixed_all_gather_copy_out(out, self.params, self.dtypes, self.bytes)
            else:
                buffers.all_gather_copy_out(out, self.params, self.flat)
        self._comm.hold_all_gather_buffer(out)
        for p in self.params:
            p.register_unsharded()
        self._transition((GroupState.UNSHARDING,), GroupState.UNSHARDED, "finish unshard")
        if trace.enabled():  # (the byte count is not computed for nobody)
            self._emit(trace.EventKind.UNSHARD, phase, nbytes=self.unsharded_nbytes, exposed_s=exposed)

    # --- reshard -------------------------------------------------------------------------------
    @_outside_functorch
    def reshard(self, phase: trace.Phase = trace.Phase.EXPLICIT, *, partial: bool = False) -> None:
        """Free the unsharded params; with ``partial`` keep this rank's k-subgroup block first."""
        if self.state is GroupState.UNSHARDING:
            self.wait_for_unshard(phase)
        if self.state is not GroupState.UNSHARDED:
            if self.state is GroupState.PARTIALLY_SHARDED and not partial:
                self._partial_shard = None
                self.state = GroupState.SHARDED
            return
        keep = partial and self.subgroup is not None
        if keep:
            assert self.subgroup is not None
            with grad_mode.no_grad():
                self._partial_shard = (buffers.partial_shard_copy_in(self.params, self.flat, self.subgroup)
                                       if self.bytes is None else
                                       buffers.mixed_partial_shard_copy_in(self.params, self.bytes, self.subgroup))
            ctx = self._comm
            self._partial_shard_event = ctx.record_event(ctx.current_stream())
        for p in self.params:
            if not p.keep_unsharded_storage:  # set_keep_unsharded_storage: data pointers stay (CUDA graphs)
                p.free_unsharded()
            p.register_sharded()
        # (UNSHARDED -> new: checked on entry, as _transition would)
        self.state = GroupState.PARTIALLY_SHARDED if keep else GroupState.SHARDED
        if trace.enabled():
            kept = self._partial_shard if keep else None
            self._emit(trace.EventKind.RESHARD, phase, nbytes=kept.nbytes if kept is not None else 0)

    def reset(self) -> None:
        """``reset_iter_state``: finish the all-gather in flight, drop the failed step's reduces and
        gradients and register the sharded parameters again (SHARDED)."""
        if self._pending_unshard is not None:
            self._pending_unshard[1].wait(self._comm)
            self._pending_unshard = None
            self.state = GroupState.UNSHARDED  # nothing copied out: reshard() frees and re-registers
        self.reshard()
        self.reducer.discard(self.params)
        self.clear_used()

    # --- gradients (always reduced in, or finished after, a backward) ---------------------------
    def reduce_grads(self, *, reshard_first: bool = False) -> bool:
        """Post-backward: hand the unsharded grads to the reducer; True when a reduce was issued.
        ``reshard_first``: free the unsharded params once their grads are taken (see ``Reducer.reduce``)."""
        params, flat = self._grad_layout()
        return self.reducer.reduce(params, flat, self.reduce_dtype, self._comm,
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
