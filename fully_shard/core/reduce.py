"""The gradient side of a ParamGroup: reduce-scatter (+ HSDP all-reduce), scaling, hooks, ReduceQueue.

See design/data-path.md ("Reduce"). A ``Reducer``, owned by each ``ParamGroup``, decides which parameters
take part in a reduce, packs their unsharded grads (reduce_plan.py), issues the reduce-scatter (the
built-in one or a ``set_custom_reduce_scatter`` object) and the HSDP all-reduce through the ``CommContext``'s
verbs (comm/streams.py), runs ``set_all_reduce_hook``'s hook and the gradient divide factor, and assigns the
sharded ``.grad``. ``ReduceQueue`` bounds the reduces of one root that are in flight.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..comm import collectives, trace
from ..comm.streams import CommContext, Pending
from ..parallel.mesh import MeshInfo
from . import grad_mode
from .layout import FlatLayout
from .param import ShardedParam
from .reduce_plan import Collective, GradView, ReduceOps, ReducePlan, cat_rows, grad_views

SUM: dist.ReduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
_NO_OVERFLOW_RISK = (torch.float32, torch.bfloat16)  # torch's set: every other dtype splits the division
_setting_changes = itertools.count(1)  # ReduceSettings.version: unique over every settings object


@dataclass
class ReduceSettings:
    """What the ``FSDPModule.set_*`` calls of the reduce side chose for one group (torch 2.13's names)."""

    divide_factor: float | None = None  # set_gradient_divide_factor: None = average over all ranks
    force_sum: bool = False  # set_force_sum_reduction_for_comms
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # set_all_reduce_hook
    hook_stream: Any = None
    unused_params: bool | None = None  # set_reduce_scatter_unused_params; None: zeros (this library)
    max_input_buffers: int | None = None  # set_reduce_scatter_max_input_buffers; None: ReduceQueue's
    group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group; None: the shard group
    custom_reduce_scatter: Any = None  # set_custom_reduce_scatter / process-group allocation: allocate() + __call__()
    # a new number on every assignment to a field: a ReducePlan built from older settings is rebuilt
    version: int = field(default=0, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        object.__setattr__(self, "version", next(_setting_changes))


def reduce_ops(settings: ReduceSettings, world: int, dtype: torch.dtype, *,
               collective_world: int | None = None) -> ReduceOps:
    """torch 2.13's rule. fp32/bf16 with the default divisor over the ranks the collectives run on: AVG
    collectives (NCCL and gloo both average). A divide factor ``f``, forced SUM, or a default divisor
    ``world`` other than the ranks the collectives run over (``collective_world``: an expert group of a
    per-parameter-mesh unit, design/experts.md): SUM collectives and a division by ``f`` (default
    ``world``, every shard and replica rank of the unit's mesh) on the reduced shard. In any other dtype
    (fp16, fp64: the overflow risk torch guards against) always SUM, the division split as
    ``pre * post = f`` around the collective (~sqrt(f) each), so neither NCCL's pre-multiplied AVG
    underflows nor gloo's sum-then-divide overflows. torch uses NCCL's ``PREMUL_SUM(1/f)`` for a set
    factor, which gloo lacks; SUM + a division runs everywhere (docs/torch.md, differences)."""
    overflow_risk = dtype not in _NO_OVERFLOW_RISK
    if (settings.divide_factor is None and not settings.force_sum and not overflow_risk
            and collective_world in (None, world)):
        avg: dist.ReduceOp = collectives.AVG
        return ReduceOps(avg, avg, None, None)
    factor = float(settings.divide_factor if settings.divide_factor is not None else world)
    if not overflow_risk:
        return ReduceOps(SUM, SUM, None, factor)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return ReduceOps(SUM, SUM, float(pre), factor / pre)


def _reduce_scatter(group: dist.ProcessGroup, op: dist.ReduceOp, custom: Any, inp: torch.Tensor,
                    out: torch.Tensor | None, async_op: bool) -> dist.Work | None:
    """A plan's reduce-scatter of ``inp`` into ``out`` over ``group`` (``custom``: a custom reduce-scatter)."""
    assert out is not None
    return collectives.reduce_scatter(out, inp, group, op, async_op, custom=custom)


@dataclass
class PendingReduce:
    """One reduce in flight: what to wait on, and where its result goes."""

    output: torch.Tensor | None  # this rank's reduced flat shard (reduce dtype); None: HSDP kept it to sum
    reduce_scatter: Pending
    all_reduce: Pending | None  # HSDP: issued right after the reduce-scatter, waited with it
    cpu_input: torch.Tensor | None  # CPU: kept alive until the async work is waited
    in_place: bool  # gloo: cpu_input was all-reduced in place; this rank's row of it is the output
    flat: FlatLayout
    views: tuple[GradView, ...]  # per parameter whose grad the output holds: its rows (ReducePlan.views)
    ops: ReduceOps
    ctx: CommContext  # the context it was issued in (waited in the same)


class Reducer:
    """The reduce side of one ``ParamGroup``, owned by it: reduce-scatter (+ HSDP all-reduce), hook,
    divide factor, sharded ``.grad``; the sync flags and the ``set_*`` settings of that side."""

    def __init__(self, fqn: str, mesh_info: MeshInfo, device: torch.device,
                 data_parallel_world: int | None = None) -> None:
        self.fqn = fqn
        self.mesh_info = mesh_info
        self.device = device
        own = mesh_info.shard_world * mesh_info.replicate_world
        # the default divisor: the unit's data-parallel ranks (its fully_shard mesh), which for an expert
        # group on (efsdp, ep) is efsdp * ep, not this group's efsdp ranks (design/experts.md)
        self.data_parallel_world = data_parallel_world if data_parallel_world is not None else own
        self.settings = ReduceSettings()  # the reduce side's set_* calls
        self.requires_gradient_sync = True  # set_requires_gradient_sync
        self.requires_all_reduce = True  # set_requires_all_reduce (HSDP)
        self.pending: list[PendingReduce] = []
        self.partial_output: torch.Tensor | None = None  # HSDP without all-reduce: the sum so far
        self._plan: ReducePlan | None = None  # built by the first reduce, rebuilt when its inputs change
        # List units: the parameters of members that ran forward since the last synced backward; None:
        # every parameter (one-module units). See design/hooks.md, "List units".
        self._used: set[int] | None = None
        self._layout: tuple[tuple[bool, ...], list[ShardedParam], FlatLayout] | None = None  # (_layout_of)

    # --- which parameters take part --------------------------------------------------------------
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
        if used and self.settings.unused_params is not False:  # False: torch's skip, see below
            return True
        if not self.requires_all_reduce or self.partial_output is not None:
            return True  # HSDP without all-reduce sums outputs across reduces: one layout
        return p.unsharded_accumulated_grad is not None or (
            p.unsharded_param is not None and p.unsharded_param.grad is not None)

    def _layout_of(self, params: list[ShardedParam]) -> tuple[list[ShardedParam], FlatLayout]:
        """The parameters of ``params`` reduced now and their flat layout (the reduce-scatter buffers),
        rebuilt only when that set changed."""
        key = tuple(map(self._reduced, params))
        if self._layout is None or self._layout[0] != key:
            reduced = [p for p, taking_part in zip(params, key) if taking_part]
            self._layout = (key, reduced, FlatLayout(tuple(p.layout for p in reduced)))
        return self._layout[1], self._layout[2]

    def _new_plan(self, params: list[ShardedParam], flat: FlatLayout, reduce_dtype: torch.dtype,
                  ctx: CommContext) -> ReducePlan:
        """The decisions of a reduce of ``params`` that do not change between calls (reduce_plan.py)."""
        settings, mesh = self.settings, self.mesh_info
        ops = reduce_ops(settings, self.data_parallel_world, reduce_dtype,
                         collective_world=mesh.shard_world * mesh.replicate_world)
        alloc = settings.custom_reduce_scatter.allocate if settings.custom_reduce_scatter is not None else None
        group = settings.group or mesh.shard_group
        # (the reduce input is world * shard_numel elements: one rank's segment only over one rank)
        in_place = (not ctx.accelerated and settings.custom_reduce_scatter is None and mesh.replicate_group is None
                    and flat.world * flat.shard_numel != flat.shard_numel
                    and collectives.reduce_scatter_is_all_reduce(group))
        if in_place:  # gloo: the input all-reduced in place, this rank's row of it the output (_take_row)
            collective: Collective = collectives.all_reduce_async(group, ops.reduce_scatter, reduce_dtype)
            output = None
        else:
            collective = partial(_reduce_scatter, group, ops.reduce_scatter, settings.custom_reduce_scatter)
            output = partial(collectives.allocate, alloc, flat.shard_numel, reduce_dtype, self.device)
        return ReducePlan(flat, reduce_dtype, ctx, settings.version, ops, in_place, alloc,
                          (settings.max_input_buffers or 1) - 1, tuple(params),
                          cat_rows(params, flat, self.device, alloc), self.device,
                          grad_views(params, flat, self.device), collective, output)

    # --- reduce ----------------------------------------------------------------------------------
    def reduce(self, group_params: list[ShardedParam], reduce_dtype: torch.dtype, ctx: CommContext, *,
               before_alloc: Callable[[], None] | None = None) -> bool:
        """Post-backward: reduce-scatter the unsharded grads of the group's parameters that take part, or
        stash them when sync is off; True when a reduce was issued (the caller queues it, see
        ``ReduceQueue``).

        ``before_alloc`` runs once the grads are taken and before the reduce buffers are allocated (the
        group frees its unsharded params there, as torch's FSDP2 does: the peak holds one unit's params
        less)."""
        params, flat = self._layout_of(group_params)
        if not params:
            return False
        if not self.requires_gradient_sync:
            for p in params:
                p.stash_unsharded_grad(reduce_dtype)
            return False
        if torch.is_grad_enabled():  # (backward under create_graph: the copy-in builds no graph)
            with torch.no_grad():
                return self.reduce(group_params, reduce_dtype, ctx, before_alloc=before_alloc)
        grads = [p.take_unsharded_grad() for p in params]
        for g in grads:
            if g is not None:
                break
        else:  # no grad at all
            return False
        if before_alloc is not None:
            before_alloc()
        plan = self._plan
        if plan is None or not plan.matches(flat, reduce_dtype, ctx, self.settings.version):
            plan = self._plan = self._new_plan(params, flat, reduce_dtype, ctx)
        in_place = plan.in_place
        inp, out, pending = ctx.reduce_scatter(partial(plan.copy_in, grads), plan.collective, output=plan.output,
                                               keep_inputs=plan.keep_inputs)
        if trace.observers:  # (the event's fields are not built for nobody)
            trace.emit_if_observed(trace.EventKind.REDUCE_SCATTER, self.fqn, trace.Phase.BACKWARD,
                                   nbytes=inp.nbytes, group_size=self.mesh_info.shard_world,
                                   timing=pending.timing, issued_as="all_reduce" if in_place else "")
        output: torch.Tensor | None = out
        all_reduce = None
        if self.mesh_info.replicate_group is not None:
            assert out is not None  # in_place excludes HSDP
            output, all_reduce = self._all_reduce_replicas(out, pending, plan.ops, ctx)
        # CPU: the input stays alive until waited where the backend's work handle is all we hold (a
        # future-less backend) and where it is all-reduced in place; a future lets it go when done.
        cpu_input = inp if in_place or pending.work is not None else None
        item = PendingReduce(output, pending, all_reduce, cpu_input, in_place, flat, plan.views, plan.ops, ctx)
        if in_place and pending.future is not None:
            pending.future = pending.future.then(partial(self._take_row, item))
        self.pending.append(item)
        return True

    def _take_row(self, item: PendingReduce, done: torch.futures.Future[Any] | None = None) -> None:
        """gloo's thread, as soon as an in-place all-reduce is done: copy this rank's row out as the
        output and let the input go (the backend's work drops its own reference right after), so an
        in-flight reduce holds its input only while it runs, not until it is waited."""
        if done is not None:
            done.value()  # re-raises the collective's error (then the chained future carries it)
        assert item.cpu_input is not None
        item.output = item.cpu_input.view(-1, item.flat.shard_numel)[self.mesh_info.shard_rank].clone()
        item.cpu_input = None

    def settle(self) -> None:
        """Wait for the reduce-scatters (and HSDP all-reduces) in flight and let their inputs go: this rank's
        host only, nothing issued, no hook run, no grad assigned (``finish`` does those). ``ReduceQueue``'s
        CPU budget calls it where an input does not fit in memory: the wait is this rank's own decision,
        since it orders no collective."""
        for item in self.pending:
            item.ctx.finish_reduce(item.reduce_scatter, item.all_reduce)
            if item.in_place and item.cpu_input is not None:  # no future: the row is taken here
                self._take_row(item)
            item.cpu_input = None

    def finish(self) -> None:
        """Wait for the reduce-scatters (and HSDP all-reduces) in flight (``settle``); run the all-reduce hook
        and the divide factor; assign sharded grads (running their post-accumulate-grad hooks). The hooks
        may issue collectives, so ``ReduceQueue`` calls it at a point every rank agrees on."""
        if not self.pending:
            return
        # (settled already where the CPU budget said so; on CPU the host waited for an HSDP reduce-scatter
        # before issuing its all-reduce, which may still be in flight: its output is assigned below)
        # (a loop, not any(<generator>): no Python call added on the post-backward path, test_reduce_plan)
        for item in self.pending:
            if not item.reduce_scatter.waited or (item.all_reduce is not None and not item.all_reduce.waited):
                self.settle()
                break
        hook = self.settings.all_reduce_hook
        for item in self.pending:
            ctx = item.ctx
            output = item.output
            if output is not None:
                if hook is not None:  # in the reduce dtype, before the divide factor (torch's order)
                    ctx.run_hook(partial(hook, output), self.settings.hook_stream)
                if item.ops.post_divide is not None and item.ops.post_divide != 1:
                    output.div_(item.ops.post_divide)
                if self._assign_grads(output, item.views):
                    ctx.hold_grad_offload_event()
        self.pending.clear()
        trace.emit_if_observed(trace.EventKind.REDUCE_DONE, self.fqn, trace.Phase.BACKWARD)

    def discard(self, params: list[ShardedParam]) -> None:
        """``reset_iter_state``: wait for the collectives in flight (every rank issued them) and drop
        their results, the HSDP partial sums and the no-sync accumulators of ``params``: the failed
        step's gradients are lost, as in torch."""
        for item in self.pending:
            item.ctx.finish_reduce(item.reduce_scatter, item.all_reduce)
        self.pending.clear()
        self.partial_output = None
        for p in params:
            p.unsharded_accumulated_grad = None
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None

    def _all_reduce_replicas(self, output: torch.Tensor, reduce_scatter: Pending, ops: ReduceOps,
                             ctx: CommContext) -> tuple[torch.Tensor | None, Pending | None]:
        """HSDP: the reduction of the reduce-scattered shard across replicas, issued as soon as the
        reduce-scatter is done (``CommContext.all_reduce_replicas``), or the shard added to the partial sum
        under ``set_requires_all_reduce(False)``. Returns the output and its all-reduce."""
        group = self.mesh_info.replicate_group
        assert group is not None

        def accumulate() -> torch.Tensor | None:
            shard = output
            if self.partial_output is not None:  # in place, on the stream that wrote both (as torch)
                shard = self.partial_output.add_(output)
                self.partial_output = None
            if not self.requires_all_reduce:
                self.partial_output = shard
                return None
            return shard

        def all_reduce(shard: torch.Tensor, async_op: bool) -> dist.Work | None:
            return collectives.all_reduce(shard, group, ops.all_reduce, async_op=async_op)

        shard, pending = ctx.all_reduce_replicas(reduce_scatter, accumulate, all_reduce)
        if pending is not None and shard is not None:
            trace.emit_if_observed(trace.EventKind.ALL_REDUCE, self.fqn, trace.Phase.BACKWARD, nbytes=shard.nbytes,
                                   group_size=self.mesh_info.replicate_world, timing=pending.timing)
        return shard, pending

    @staticmethod
    def _assign_grads(output: torch.Tensor, views: tuple[GradView, ...]) -> bool:
        """Assign each parameter's rows as its sharded ``.grad``, then run its post-accumulate-grad
        hooks (optimizer-in-backward), as autograd would for a leaf (design/hooks.md). True when some
        went to the host asynchronously (CPU offload: the caller records an event after them)."""
        output = output.contiguous()  # (it always is: one flat buffer)
        base = output.storage_offset()
        copied = False  # CPU offload: some grads went to the host asynchronously
        for p, shape, stride, offset, direct in views:
            # this rank's rows of p: one view (the output is contiguous; it requires no grad, and
            # set_sharded_grad accumulates under no_grad)
            local = output.as_strided(shape, stride, base + offset)
            if not (direct and p.set_new_grad(local)):  # (a first grad, nothing to convert or run)
                with grad_mode.no_grad():
                    copied |= p.set_sharded_grad(local)
                    p.run_post_accumulate_grad_hooks()
        return copied


@dataclass(frozen=True)
class ReduceBytes:
    """One unit's reduce as ``ReduceQueue`` budgets it: what it holds in flight, what it leaves, and what
    the unit's backward let go (this rank's shapes: it decides only when the host waits)."""

    input: int  # the reduce input: the unit's unsharded gradients in the reduce dtype
    kept: int  # the sharded gradients it leaves on this rank (input / shard ranks)
    released: int  # the activations the unit's backward freed, a lower bound (``activation_bytes``)


def activation_bytes(rows: int, in_features: int, dtype: torch.dtype) -> int:
    """A lower bound of what one unit's backward frees: each 2-D weight ``(out, in)`` multiplied ``rows``
    input rows of ``in`` features in the forward, and autograd keeps that input for the weight's gradient
    until the unit's backward has run (``in_features``: the sum of ``in`` over the unit's 2-D weights;
    ``rows``: the unit's output rows, its elements over its last dim)."""
    return rows * in_features * dtype.itemsize


class ReduceQueue:
    """The reducers of one root's groups with reduces in flight, oldest first. Before a group allocates its
    reduce buffers, ``make_room`` finishes the oldest until fewer than the limit remain, so at most
    ``limit`` reduces (the new one included) are ever in flight and their buffers stay bounded instead
    of piling up until the end of backward.

    The limit is the group's ``set_reduce_scatter_max_input_buffers(k)`` when set, else
    ``max_in_flight``: 2 on accelerators (one behind the next unit's backward while the newest is
    issued); 1 on CPU (torch's default): a unit's reduce-scatter runs in gloo's thread behind the next
    unit's backward and is finished just before that unit allocates its own, so two reduce inputs never
    coexist. ``max_in_flight = 0`` finishes each reduce at once (no overlap).

    On CPU a reduce's input stays held only where it fits in what the backward has released so far
    (``budgeted``; design/data-path.md): held behind the next unit's backward, the input adds to the
    memory there, and the step's peak is where the most activations are held, at the backward's start.
    ``released`` counts, over the reduces pushed since the backward began, the activations each unit's
    backward let go (``ReduceBytes.released``, a lower bound, from this rank's forward shapes) less the
    sharded gradients it left (``ReduceBytes.kept``, which the backward adds); a reduce whose ``input``
    exceeds it is settled at once (``Reducer.settle``: the host waits for its collective and the input
    goes). That decision is this rank's own (ranks with other batch shapes decide otherwise): it only
    waits. When a reduce *finishes* (its all-reduce hook, divide factor, grads and post-accumulate-grad
    hooks, which may issue collectives) depends on the limit alone, the same on every rank: so does every
    decision that orders collectives."""

    def __init__(self, *, accelerated: bool) -> None:
        self.max_in_flight = 2 if accelerated else 1
        self.budgeted = not accelerated  # accelerators: streams overlap, the caching allocator reuses
        self.released = 0  # bytes the backward has released so far (see above); reset by drain
        self._reducers: deque[Reducer] = deque()

    def _limit(self, reducer: Reducer | None) -> int:
        k = reducer.settings.max_input_buffers if reducer is not None else None
        return self.max_in_flight if k is None else k

    def make_room(self, reducer: Reducer | None = None) -> None:
        if not self._reducers:
            return
        limit = self._limit(reducer)
        while self._reducers and len(self._reducers) >= limit:
            self._reducers.popleft().finish()

    def push(self, reducer: Reducer, nbytes: ReduceBytes | None = None) -> None:
        """Queue ``reducer``'s newest reduce (``nbytes``: its bytes; None: unknown, settled at once on CPU)
        and finish the oldest beyond the limit."""
        if reducer not in self._reducers:
            self._reducers.append(reducer)
        k = reducer.settings.max_input_buffers
        if self.budgeted and k is None:
            if nbytes is not None:
                self.released += nbytes.released - nbytes.kept
            if nbytes is None or self.released < nbytes.input:
                reducer.settle()  # its input goes now; its finish stays where the limit puts it
        limit = self.max_in_flight if k is None else k  # (_limit, inline: once per reduce)
        while len(self._reducers) > limit:  # 0: finish right away (no overlap)
            self._reducers.popleft().finish()

    def drain(self) -> None:
        while self._reducers:
            self._reducers.popleft().finish()
        self.released = 0

    def discard(self) -> None:
        """``reset_iter_state``: forget the queued reducers (each group discards its own reduces)."""
        self._reducers.clear()
        self.released = 0
