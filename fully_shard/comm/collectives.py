"""The runtime's collective calls: all-gather, reduce-scatter, all-reduce, broadcast, object gathers.

See design/data-path.md. The data path's collectives run on flat buffers packed by the core's plans
(``core/gather_plan.py``, ``core/reduce_plan.py``: pack -> collective -> unpack): an in-place all-gather
of this rank's segment, a reduce-scatter of a ``(world, shard_numel)`` input (-> HSDP all-reduce); the
k-rank partial all-gather (reshard_after_forward=k) is the same call over a ``SubgroupInfo`` of k ranks.
Control plane: the structure check at fully_shard() time, gradient-norm sums (optim/clip.py) and
meta-init broadcasts (core/init.py). design/overview.md says which applications call ``torch.distributed``
themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function_unary

from ..parallel.mesh import SubgroupInfo

AVG: dist.ReduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]  # NCCL and gloo both average


def _all_gather_fn():  # torch >= 2.13 renamed all_gather_into_tensor to all_gather_single
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


Alloc = Callable[..., torch.Tensor]  # a custom collective's ``allocate(size, *, dtype, device)``


def allocate(alloc: Alloc | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat communication buffer: from a ``set_custom_all_gather``/``set_custom_reduce_scatter``
    object's ``allocate`` (torch's ``Comm`` protocol) when given, else ``torch.empty``."""
    if alloc is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = alloc((numel,), dtype=dtype, device=device)
    if buf.numel() != numel or buf.dtype != dtype or not buf.is_contiguous():
        raise ValueError(f"custom collective's allocate(({numel},), dtype={dtype}, device={device}) returned a "
                         f"{'' if buf.is_contiguous() else 'non-contiguous '}{buf.dtype} tensor of "
                         f"{buf.numel()} elements. Fix: return a contiguous tensor of that size and dtype.")
    return buf.view(-1)


def segment(buffer: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rank``'s share of a flat buffer split evenly over ``world`` ranks."""
    block = buffer.numel() // world
    return buffer.narrow(0, rank * block, block)


# --- one rank ---------------------------------------------------------------------------------------
_at_world_one = False  # issue_at_world_one(True): the collectives run over one rank too


def issue_at_world_one(enabled: bool) -> bool:
    """Issue the all-gather and the reduce-scatter as collectives even over one rank (default False: as
    torch's FSDP2, one rank skips the all-gather and copies its reduce input); returns the previous
    setting. For checks: at world 1 on NCCL the collective kernels then run on the side streams
    (tests/gpu/delay.py), with the same results."""
    global _at_world_one
    previous, _at_world_one = _at_world_one, bool(enabled)
    return previous


# --- all-gather ------------------------------------------------------------------------------------
def all_gather(over: SubgroupInfo, out: torch.Tensor, async_op: bool, *, custom: Any = None) -> dist.Work | None:
    """In-place all-gather over ``over`` (the shard group or a k-subgroup) of this rank's segment of
    ``out`` into the whole of ``out``, by ``custom(output_tensor=, input_tensor=, group=, async_op=)`` when
    a custom all-gather is set. Over one rank the segment is the whole buffer: no collective
    (as torch's FSDP2; NO_SHARD's one-rank shard groups too) unless ``issue_at_world_one(True)``. A
    group's plan binds ``over`` and ``custom`` once (``GatherPlan.gather``)."""
    if over.world == 1 and not _at_world_one:
        return None
    inp = segment(out, over.rank, over.world)
    if custom is not None:
        return custom(output_tensor=out, input_tensor=inp, group=over.group, async_op=async_op)
    return all_gather_into(out, inp, over.group, async_op=async_op)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *,
                    async_op: bool = False) -> dist.Work | None:
    """``out`` = every rank's ``inp`` back to back (the one call of torch's tensor all-gather)."""
    if _DIRECT_ALL_GATHER and _direct(group, out, inp):
        return _finish(group.all_gather_single(out, inp, _options(_ALLGATHER_OPTIONS, async_op)), async_op)
    return _all_gather_fn()(out, inp, group=group, async_op=async_op)


# --- direct process-group calls ---------------------------------------------------------------------
# The hot path's collectives call the process group's public method, the one ``torch.distributed``'s
# function calls after its checks (design/data-path.md, "Host work per step"): the same collective, the
# same backend call, without the wrapper's Python (argument checks, the logging decorator, the
# coalescing lookup, a new options object per call). Used where those checks have nothing to do: a
# ``ProcessGroup`` object, real (not complex) plain tensors, no ``__torch_function__`` override
# (a tensor subclass or a mode redirects the wrapper), not inside a ``_coalescing_manager`` block
# (the hooks never run in one). torch 2.11 has no public all-gather method (only ``_allgather_base``):
# there the wrapper is called, as with ``direct_calls(False)``.
_ALLGATHER_OPTIONS: Any = getattr(dist.distributed_c10d, "AllgatherOptions", None)  # (not re-exported by dist)
_DIRECT_ALL_GATHER = hasattr(dist.ProcessGroup, "all_gather_single") and _ALLGATHER_OPTIONS is not None
_use_direct = True  # direct_calls(False): always the torch.distributed functions (tests compare both)
_OPTIONS: dict[tuple[type, bool, Any], Any] = {}


def direct_calls(enabled: bool) -> bool:
    """Call the process group's methods directly (True, the default) or always go through
    ``torch.distributed``'s functions; returns the previous setting."""
    global _use_direct
    previous, _use_direct = _use_direct, enabled
    return previous


def _direct(group: Any, *tensors: torch.Tensor) -> bool:
    if not _use_direct or not isinstance(group, dist.ProcessGroup):
        return False
    for t in tensors:  # noqa: SIM110 (a loop, not all() over a generator: once per collective)
        if type(t) is not torch.Tensor or t.is_complex() or has_torch_function_unary(t):
            return False
    return True


def _options(kind: type, async_op: bool, op: Any = None) -> Any:
    """One options object per (kind, async_op, op), reused: the backend copies it per call."""
    key: tuple[type, bool, Any] | None = (kind, async_op, op)
    try:
        return _OPTIONS[key]  # type: ignore[index]
    except KeyError:
        pass
    except TypeError:  # an unhashable op (e.g. a PREMUL_SUM ReduceOp object): a new object
        key = None
    opts = kind()
    opts.asyncOp = async_op
    if op is not None:
        opts.reduceOp = op
    if key is not None:
        _OPTIONS[key] = opts
    return opts


def _finish(work: dist.Work | None, async_op: bool) -> dist.Work | None:
    """What the ``torch.distributed`` function returns: the work when asynchronous, else None once done."""
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


def all_gather_object(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj`` (pickled; error paths, and the extension layout check at lazy init)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# --- reduce-scatter and all-reduce -------------------------------------------------------------------
def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp,
                   async_op: bool, *, custom: Any = None) -> dist.Work | None:
    """``out`` = this rank's segment of ``inp`` reduced over ``group`` (by ``custom(output_tensor=,
    input_tensor=, group=, op=, async_op=)`` when a custom reduce-scatter is set); over one rank
    (``inp`` is one segment) a copy, no collective, unless ``issue_at_world_one(True)``."""
    if out.numel() == inp.numel() and not _at_world_one:
        out.copy_(inp)
        return None
    if custom is not None:
        return custom(output_tensor=out, input_tensor=inp, group=group, op=op, async_op=async_op)
    return reduce_scatter_into(out, inp, group, op, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp, *,
                        async_op: bool = False) -> dist.Work | None:
    """``out`` = this rank's segment of every rank's ``inp`` reduced (torch's tensor reduce-scatter)."""
    return _reduce_scatter_fn()(out, inp, op=op, group=group, async_op=async_op)


def reduce_scatter_is_all_reduce(group: dist.ProcessGroup) -> bool:
    """gloo's reduce-scatter is an all-reduce of a copy of the input (then a copy-out of this rank's
    segment at ``wait``): on gloo the library all-reduces its own reduce input in place instead, same
    bits and bytes on the wire, one input-sized copy less, and the input is the only buffer in flight
    (design/data-path.md)."""
    key = id(group)
    known = _IS_GLOO.get(key)
    if known is None or known[0] is not group:  # (a new group may reuse a destroyed one's id)
        known = _IS_GLOO[key] = (group, str(dist.get_backend(group)) == "gloo")
    return known[1]


# group id -> (group, is gloo): asked once per reduce
_IS_GLOO: dict[int, tuple[dist.ProcessGroup, bool]] = {}


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None,
               op: dist.ReduceOp | dist.ReduceOp.RedOpType, *, async_op: bool = False) -> dist.Work | None:
    if _direct(group, tensor):
        assert group is not None
        return _finish(group.allreduce([tensor], _options(dist.AllreduceOptions, async_op, op)), async_op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_reduce_async(group: dist.ProcessGroup, op: dist.ReduceOp,
                     dtype: torch.dtype) -> Callable[[torch.Tensor, Any, Any], dist.Work | None]:
    """``lambda t, *_: all_reduce(t, group, op, async_op=True)`` for plain tensors of ``dtype`` (a reduce
    plan's in-place collective, called as ``(input, output, async_op)``: the output is the input, the
    call is always asynchronous), with what does not change between calls decided once: the group's type,
    the dtype, the options object. Per call: ``direct_calls``, the tensor's type, a torch function mode."""
    if not isinstance(group, dist.ProcessGroup) or dtype.is_complex:
        def wrapped(tensor: torch.Tensor, _out: Any = None, _async: Any = True) -> dist.Work | None:
            return all_reduce(tensor, group, op, async_op=True)

        return wrapped
    opts = _options(dist.AllreduceOptions, True, op)
    allreduce = group.allreduce

    def call(tensor: torch.Tensor, _out: Any = None, _async: Any = True) -> dist.Work | None:
        if _use_direct and type(tensor) is torch.Tensor and not has_torch_function_unary(tensor):
            return allreduce([tensor], opts)  # type: ignore[no-any-return]
        return all_reduce(tensor, group, op, async_op=True)

    return call


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Synchronous broadcast from global rank ``src`` (meta-init of replicated tensors)."""
    dist.broadcast(tensor, src=src, group=group)

