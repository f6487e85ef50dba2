"""ReducePlan: one group's reduce decisions and its copy-in, fixed until what they were built from changes.

See design/data-path.md ("Reduce", "Host work per step"). A ``Reducer`` builds its plan at its first reduce and
again whenever what it was built from changed: the parameters reduced (their ``FlatLayout``), the reduce dtype,
the ``CommContext``, or any of the group's reduce ``set_*`` settings (``ReduceSettings.version``). It fixes the
collectives' ops and scaling, the process group, whether gloo's in-place all-reduce replaces the
reduce-scatter (and that all-reduce's call), the buffer allocator, how many reduce inputs stay held, each
parameter's rows of the reduced shard, and the copy-in: the unsharded gradients packed into a
``(world, shard_numel)`` buffer of the reduce dtype whose row r goes to rank r, by

- one ``torch.cat`` of ``(world, size)`` views of the gradients, with no per-call check of the layout, on
  CPU where every parameter is split along dim 0 without padding and has a gradient (``rows``);
- else one ``torch._chunk_cat`` where every gradient is present, non-empty, of one dtype and split along
  dim 0 (each gradient's rows split per rank, padded and cast in one kernel, torch's FSDP2 copy-in; on CPU
  only where some gradient needs padding);
- else one ``torch.cat`` along dim 1 of ``(world, size)`` views, a missing gradient as zeros, a replicated
  (0-dim) one written into every rank's row, only a gradient whose rows do not fill its padded layout
  copied once to pad it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.collectives import allocate
from ..comm.streams import CommContext
from .layout import FlatLayout
from .param import ShardedParam

# private (design/private-torch.md): without it the copy-in pads each padded gradient with one copy
_chunk_cat = getattr(torch, "_chunk_cat", None)

# a parameter, the shape, stride and offset of its rows in the reduced shard, and whether its gradient may
# take ``ShardedParam.set_new_grad`` (Shard(0), no CPU offload, kept on the reduce's device)
GradView = tuple[ShardedParam, tuple[int, ...], tuple[int, ...], int, bool]
# a reduce's collective: (input, output or None where it is reduced in place, async_op) -> its work
Collective = Callable[[torch.Tensor, "torch.Tensor | None", bool], "dist.Work | None"]


@dataclass(frozen=True)
class ReduceOps:
    """The two collectives' ops and the scaling around them for one reduce."""

    reduce_scatter: dist.ReduceOp
    all_reduce: dist.ReduceOp
    pre_divide: float | None  # the reduce-scatter input, before the collective (fp16: overflow)
    post_divide: float | None  # the reduced shard, after the all-reduce and the hook


@dataclass(frozen=True, slots=True)
class ReducePlan:
    """The fixed decisions of one group's reduce (see the module docstring)."""

    flat: FlatLayout
    dtype: torch.dtype
    ctx: CommContext
    version: int  # the ReduceSettings.version it was built from
    ops: ReduceOps
    in_place: bool  # gloo: all-reduce the reduce input in place (Reducer.reduce)
    alloc: Callable[..., torch.Tensor] | None  # a custom collective's allocate
    keep_inputs: int  # reduce-scatter inputs left held before a new one is allocated (accelerators)
    params: tuple[ShardedParam, ...]
    rows: tuple[tuple[int, int], ...] | None  # per parameter its (world, size) rows; None: no plain cat
    device: torch.device
    views: tuple[GradView, ...]  # per parameter: its rows of the reduced shard (``grad_views``)
    # the collective over the process group (the reduce-scatter, a custom one, or gloo's in-place all-reduce)
    collective: Collective
    output: Callable[[], torch.Tensor] | None  # allocates the reduced shard; None: the input's own row

    def matches(self, flat: FlatLayout, dtype: torch.dtype, ctx: CommContext, version: int) -> bool:
        return self.flat is flat and self.dtype is dtype and self.ctx is ctx and self.version == version

    def copy_in(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The reduce input: ``grads`` (one per parameter, None: no gradient) packed, cast to the reduce
        dtype and pre-divided (fp16); ``grads`` is emptied, so the gradients are freed once packed."""
        inp = None
        rows = self.rows
        if rows is not None:  # the plain cat (every gradient present), else the general copy-in
            try:
                pieces = [g.reshape(r) for g, r in zip(grads, rows)]  # type: ignore[union-attr]
            except AttributeError:  # a parameter without a gradient: zeros, by the general copy-in
                pieces = None
            if pieces is not None and pieces[0].dtype is self.dtype:  # no cast: cat allocates the buffer
                inp = torch.cat(pieces, dim=1).view(-1)
                if inp.dtype is not self.dtype:  # (some gradient of another dtype promoted it)
                    inp = None
            if pieces is not None and inp is None:
                flat = self.flat
                buf = torch.empty((flat.world, flat.shard_numel), dtype=self.dtype, device=self.device)
                torch.cat(pieces, dim=1, out=buf)  # casts on the way
                inp = buf.view(-1)
        if inp is None:
            inp = self._pack(grads)
        grads.clear()
        if self.ops.pre_divide is not None:
            inp.div_(self.ops.pre_divide)
        return inp

    def _pack(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The general copy-in: one ``_chunk_cat`` where it lays the gradients out as the flat layout does
        (on CPU only where some gradient needs padding: else a cat of views is one copy too, and the CPU
        kernel measured a higher peak RSS, design/data-path.md), else one cat of ``(world, size)`` views."""
        flat, params, dtype, device = self.flat, self.params, self.dtype, self.device
        world = flat.world
        buf = allocate(self.alloc, world * flat.shard_numel, dtype, device).view(world, flat.shard_numel)
        if _chunk_cat is not None and _chunk_catable(grads, params) and (
                device.type != "cpu" or _needs_padding(grads, world)):
            _chunk_cat(grads, 0, world, out=buf)  # pads each grad's rows per rank and casts: one kernel
            return buf.view(-1)
        pieces = []
        for grad, p, size in zip(grads, params, flat.sizes):
            if grad is None:
                pieces.append(torch.zeros(world, size, dtype=dtype, device=device))
            elif p.layout.replicated:  # summed over ranks like an all-reduce would
                pieces.append(grad.reshape(1, 1).expand(world, 1))
            else:
                src = p.moved(grad).reshape(-1)  # shard dim first (a no-op for Shard(0))
                pad = world * size - src.numel()
                pieces.append((F.pad(src, (0, pad)) if pad else src).view(world, size))
        if pieces:
            torch.cat(pieces, dim=1, out=buf)
        return buf.view(-1)


def _chunk_catable(grads: Sequence[torch.Tensor | None], params: Sequence[ShardedParam]) -> bool:
    """``torch._chunk_cat`` lays these grads out as the flat layout does: each present, non-empty, of
    one dtype, and split along dim 0 (not a replicated 0-dim one, nor ``Shard(d > 0)``)."""
    dtype = None
    for grad, p in zip(grads, params):
        if grad is None or p.staged_gather or not grad.numel():
            return False
        if dtype is None:
            dtype = grad.dtype
        elif grad.dtype != dtype:
            return False
    return dtype is not None


def _needs_padding(grads: Sequence[torch.Tensor | None], world: int) -> bool:
    """Some grad's rows do not split evenly over ``world`` ranks (its copy-in needs zero padding)."""
    return any(g is not None and g.dim() > 0 and g.shape[0] % world for g in grads)


def cat_rows(params: Sequence[ShardedParam], flat: FlatLayout, device: torch.device,
             alloc: Callable[..., torch.Tensor] | None) -> tuple[tuple[int, int], ...] | None:
    """Each parameter's ``(world, size)`` rows where the plain cat copy-in applies: on CPU (accelerators use
    ``torch._chunk_cat``), the built-in allocator, and every parameter split along dim 0, not empty and
    not padded (its unsharded numel is ``world * size``). None elsewhere."""
    if device.type != "cpu" or alloc is not None or not params:
        return None
    world = flat.world
    rows = []
    for p, size in zip(params, flat.sizes):
        if p.layout.replicated or p.staged_gather or p.shard_dim or not size or p.layout.numel != world * size:
            return None
        rows.append((world, size))
    return tuple(rows)


def grad_views(params: Sequence[ShardedParam], flat: FlatLayout, device: torch.device) -> tuple[GradView, ...]:
    """Each parameter's rows of the reduced shard (``GradView``): the shapes cached on the parameter, its
    padded shard's offset, and whether its gradient is a plain view of them."""
    return tuple((p, tuple(p.local_shape), tuple(p.local_stride), offset,
                  not p.shard_dim and not p.offload and p.storage_device == device)
                 for p, offset in zip(params, flat.offsets))
