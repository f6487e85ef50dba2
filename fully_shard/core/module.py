"""FSDPModule: the mixin a sharded module's class is swapped to, with the user-facing methods."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm import protocol
from ..parallel.mesh import describe_mesh
from . import finalize, roots
from .finalize import GradientReductionHandle
from .group import GroupState, ParamGroup
from .policy import check_reshard_after_forward
from .state import FSDPState, get_state, states_under
from .tree import join_fqn


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` makes the all-gathered params usable."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def wait(self) -> None:
        for group in self._state.groups:
            group.wait_for_unshard()


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
        for group in state.groups:
            group.reshard()
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        for group in state.groups:
            group.adopt_module_params()
        return out

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters now (e.g. before a forward that skips hooks)."""
        state = self._fsdp
        state.lazy_init()
        for group in state.groups:  # every group's all-gather issued; the handle waits for each
            group.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's unsharded parameters (unless ``set_keep_unsharded_storage(True)``), registering the
        sharded DTensors again."""
        for group in self._fsdp.groups:
            group.reshard()

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """True: ``reshard()`` (and every reshard after forward or backward) registers the sharded parameters
        again but keeps the unsharded storage allocated, so its data pointers stay the same across reshard and
        unshard (CUDA-graph capture), at the memory of the gathered parameters (torch 2.15's). False (the
        default): the next reshard frees it."""
        if not isinstance(keep, bool):
            raise TypeError(f"set_keep_unsharded_storage expects a bool, got {type(keep).__name__}: {keep!r}")
        for group in self._groups(recurse):
            group.keep_unsharded_storage = keep

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: accumulate unsharded grads locally with no collective (gradient accumulation)."""
        for group in self._groups(recurse):
            group.reducer.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False skips the cross-replica all-reduce (grads keep accumulating per replica)."""
        for group in self._groups(recurse):
            group.reducer.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, *, recurse: bool = True) -> None:
        for state in self._fsdp_states(recurse):
            check_reshard_after_forward(reshard_after_forward, state.mesh_info.shard_world)
            for group in state.groups:
                group.check_subgroup(reshard_after_forward)
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._fsdp.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        self._fsdp.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the end of the next backward does not wait for in-flight gradient reductions
        (micro-batching); they finish on the next backward or forward. Set on the root."""
        self._fsdp.is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """True (on the root, before backward): the end of backward leaves the gradient reduction to
        ``finalize_backward()``, called once after all backward passes of the step (supersedes
        ``set_is_last_backward``); the mode cannot change during a backward iteration (finalize.py)."""
        finalize.set_manual_backward_finalization(self._fsdp, enabled)

    @overload
    def finalize_backward(self, *, async_op: Literal[False] = False) -> None: ...

    @overload
    def finalize_backward(self, *, async_op: Literal[True]) -> GradientReductionHandle: ...

    @overload
    def finalize_backward(self, *, async_op: bool) -> GradientReductionHandle | None: ...

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Manual backward finalization, on the root after backward: reduce the gradients the backward
        passes left, reshard (``set_reshard_after_backward``) and wait for every reduction; ``async_op``:
        return a ``GradientReductionHandle`` to ``wait()`` on before using the gradients or running forward.
        Before the first forward: nothing to do."""
        return finalize.finalize_backward(self._fsdp, async_op=async_op)

    def _groups(self, recurse: bool = False) -> Iterator[ParamGroup]:
        for state in self._fsdp_states(recurse):
            yield from state.groups

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward, on the root: every unit resharded, the
        failed step's in-flight reductions dropped, the next step correct (design/hooks.md)."""
        roots.reset_iter_state(self._fsdp)

    # --- gradient reduction (reduce.py) ---------------------------------------------------------
    def set_gradient_divide_factor(self, factor: float, *, mesh: DeviceMesh | None = None) -> None:
        """Divide the summed gradient by ``factor`` instead of averaging over all ranks (``1.0``: the
        pure sum, for a loss already scaled by the global token count). SUM collectives + one scale,
        on every backend (torch needs NCCL's PREMUL_SUM); composes with HSDP and ``reduce_dtype``.
        ``mesh`` (not in torch): only the group of this unit sharded over that mesh (per-parameter
        meshes, e.g. the experts' ``efsdp`` mesh); default every group of the unit."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor expects a finite number > 0, got {factor!r}. "
                             "Fix: pass e.g. 1.0 for the pure sum or the global batch size.")
        groups = [g for g in self._groups() if mesh is None or g.mesh_info.mesh == mesh]
        if mesh is not None and not groups:
            found = [describe_mesh(g.mesh_info.mesh) for g in self._groups()]
            raise ValueError(f"set_gradient_divide_factor(mesh={describe_mesh(mesh)}): no group of this unit is "
                             f"sharded over that mesh; its groups are on {found}. Fix: pass one of those meshes, "
                             "or mesh=None for every group.")
        for group in groups:
            group.reducer.settings.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor` (as in torch)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """True: only SUM collectives; the average (or divide factor) is a separate scale afterwards
        (split around the collective for fp16, as torch)."""
        for group in self._groups():
            group.reducer.settings.force_sum = bool(enable)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """``hook(reduced_shard)`` after the reduce-scatter (1-D mesh) or after the replica all-reduce
        (HSDP), in the reduce dtype, before the divide factor, in place. ``stream`` (accelerators, 1-D
        only): run it there; default the all-reduce stream."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable hook(tensor), got {type(hook).__name__}")
        for group in self._groups():
            if stream is not None and group.mesh_info.replicate_group is not None:
                raise ValueError("set_all_reduce_hook: stream cannot be set with HSDP (the hook runs on the "
                                 "all-reduce stream). Fix: pass stream=None.")
            # (after lazy init the unit's context says: the stream stand-in gives CPU units streams)
            has_streams = group.ctx.accelerated if group.ctx is not None else group.device.type != "cpu"
            if stream is not None and not has_streams:
                raise ValueError("set_all_reduce_hook: device 'cpu' has no streams; the hook runs on the host "
                                 "after the reduce-scatter finished. Fix: pass stream=None.")
            group.reducer.settings.all_reduce_hook = hook
            group.reducer.settings.hook_stream = stream

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: a parameter with no gradient on this rank sends zeros (this library's default, safe
        when ranks use different parameters). False: torch's default, such a parameter is left out of
        the reduce-scatter and keeps ``.grad = None``; every rank must then leave out the same ones."""
        for group in self._groups(recurse):
            group.reducer.settings.unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """At most ``max_input_buffers`` reduce-scatters (their input buffers) in flight at once; the
        oldest is finished before a new one is allocated (default: 1 on CPU as torch, 2 on GPUs)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._groups(recurse):
            group.reducer.settings.max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run the reduce-scatters on their own process group over the shard ranks (one per rank set),
        so they can progress beside the all-gathers; collective: call it on every rank."""
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            settings = group.reducer.settings
            if not enable:
                settings.group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(group.mesh_info.shard_group))
            if ranks not in created:
                created[ranks] = settings.group or dist.new_group(list(ranks), use_local_synchronization=True)
            settings.group = created[ranks]

    # --- collectives and buffers (protocol.py) -----------------------------------------------------
    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: no backward all-gather for this unit, whose parameters backward does not read (an
        embedding); their gradients are still reduced."""
        for group in self._groups():
            group.unshard_in_backward = bool(unshard_in_backward)

    def set_custom_all_gather(self, comm: Any) -> None:
        """Replace the all-gather and its buffer: ``comm.allocate((n,), dtype=, device=)`` gives the
        gathered buffer, ``comm(output_tensor=, input_tensor=, group=, async_op=)`` fills it."""
        protocol.check_custom(comm, "set_custom_all_gather", "output_tensor, input_tensor, group, async_op")
        for group in self._groups():
            group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Replace the reduce-scatter and its buffers: ``comm.allocate`` gives the input and the output,
        ``comm(output_tensor=, input_tensor=, group=, op=, async_op=)`` reduces."""
        protocol.check_custom(comm, "set_custom_reduce_scatter", "output_tensor, input_tensor, group, op, async_op")
        for group in self._groups():
            group.reducer.settings.custom_reduce_scatter = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Take the communication buffers from the process group's allocator (NCCL zero-copy). A
        backend without one (gloo) warns once and keeps ``torch.empty``."""
        for group in self._groups():
            if not (protocol.is_builtin(group.custom_all_gather)
                    and protocol.is_builtin(group.reducer.settings.custom_reduce_scatter)):
                raise ValueError("set_allocate_memory_from_process_group_for_comm cannot be combined with "
                                 "set_custom_all_gather/set_custom_reduce_scatter (they allocate their own "
                                 "buffers). Fix: allocate from the process group inside your custom collective.")
            shard = group.mesh_info.shard_group
            rs_group = group.reducer.settings.group or shard
            if enable and not protocol.supports_tensor_alloc(shard, group.device):
                protocol.warn_once("set_allocate_memory_from_process_group_for_comm", group.device,
                                protocol.backend_name(shard), "the backend has no tensor allocator; buffers come "
                                "from torch.empty")
                enable = False
            group.custom_all_gather = protocol.PGAllocAllGather(shard) if enable else None
            group.reducer.settings.custom_reduce_scatter = protocol.PGAllocReduceScatter(rs_group) if enable else None

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Symmetric-memory all-gather buffers: not implemented (needs CUDA + NCCL symmetric memory);
        raises ``NotImplementedError`` naming this unit's device and backend."""
        for group in self._groups():
            found = protocol.backend_name(group.mesh_info.shard_group)
            raise NotImplementedError(
                f"set_symm_mem_for_comm(backend={backend!r}): symmetric-memory buffers are not implemented in "
                f"fully_shard (this unit runs on device {group.device.type!r} with the {found!r} backend; torch's "
                "needs CUDA + NCCL). Fix: drop the call, or plug a symmetric-memory all-gather in with "
                "set_custom_all_gather.")

    def set_post_optim_event(self, event: Any) -> None:
        """The root's next all-gather copy-in waits on ``event`` (recorded after the optimizer step)
        instead of the compute stream, once; pass a new event each iteration. On CPU (no streams) the
        host waits on it: a ``torch.Event`` or any object with ``synchronize()`` or ``wait()``. ``None``
        (what ``record_event()`` returns on CPU) is no event: the copy-in orders after compute, as torch."""
        waitable = callable(getattr(event, "synchronize", None)) or callable(getattr(event, "wait", None))
        if event is not None and not waitable:
            raise TypeError(f"set_post_optim_event expects a torch.Event (or an object with synchronize() or "
                            f"wait()), got {type(event).__name__}")
        state = self._fsdp
        state.lazy_init()
        assert state.root is not None
        state.root.ctx.post_optim_event = event

    def fsdp_repr(self) -> str:
        """One line per managed parameter: ``blocks.0.up.weight f32[157@shard/2, 60] SHARDED``."""
        lines = []
        for prefix, state in states_under(self):  # type: ignore[arg-type]
            for group in state.groups:
                lines += [p.describe(join_fqn(prefix, p.local_fqn)) for p in group.params]
        return "\n".join(lines)

    @property
    def fsdp_state_name(self) -> str:
        state = self._fsdp
        return state.groups[0].state.name if state.groups else GroupState.SHARDED.name


def _state_of(module: Any, method: str) -> FSDPState:
    state = get_state(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(f"{method} expects modules passed to fully_shard, got {type(module).__name__}. "
                         f"Fix: call fully_shard(module) on it first.")
    return state


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Several roots (pipeline chunks) share one communication context (streams, buffers); see
    ``roots.share_comm_ctx``."""
    roots.share_comm_ctx([_state_of(m, "share_comm_ctx") for m in modules])


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) unshard/reshard like ``forward``."""
    state = get_state(module)
    if state is None:
        raise ValueError(f"register_fsdp_forward_method expects a module passed to fully_shard, got "
                         f"{type(module).__name__}. Fix: call fully_shard(module) first.")
    method = getattr(module, method_name, None)
    if method is None:
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    # the class's function (registering twice wraps once); else the bound method, e.g. an FSDP1 wrapper's
    # ``generate`` reached through its wrapped module (transformers' Trainer registers it)
    orig = getattr(type(module), method_name, None)
    call = functools.partial(orig, module) if orig is not None else method

    @functools.wraps(orig if orig is not None else method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward_hook(module, args, kwargs)
        output = call(*args, **kwargs)
        return state.post_forward_hook(module, args, kwargs, output)

    setattr(module, method_name, wrapped)
