"""ReducePlan: what one group's reduce decides once instead of per call (design/data-path.md, "Host work per step").

A ``Reducer`` builds its plan at its first reduce and again whenever what it was built from changed: the
parameters reduced (their ``FlatLayout``), the reduce dtype, the ``CommContext``, or any of the group's
reduce ``set_*`` settings (``ReduceSettings.version``). It fixes the collectives' ops and scaling, the
process group, whether gloo's in-place all-reduce replaces the reduce-scatter (and that all-reduce's
call), the buffer allocator, how many reduce inputs stay held, each parameter's rows of the reduced
shard, and the copy-in: on CPU, where every parameter is split along dim 0 without padding, one
``torch.cat`` of ``(world, size)`` views of the gradients into a ``(world, shard_numel)`` buffer, with no
per-call check of the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.streams import CommContext
from .layout import FlatLayout
from .param import ShardedParam

# a parameter, the shape, stride and offset of its rows in the reduced shard, and whether its gradient may
# take ``ShardedParam.set_new_grad`` (Shard(0), no CPU offload, kept on the reduce's device)
GradView = tuple[ShardedParam, tuple[int, ...], tuple[int, ...], int, bool]


@dataclass(frozen=True, slots=True)
class ReducePlan:
    """The fixed decisions of one group's reduce (see the module docstring); ``ops`` is a ``ReduceOps``."""

    flat: FlatLayout
    dtype: torch.dtype
    comm: CommContext
    version: int  # the ReduceSettings.version it was built from
    ops: Any
    group: Any  # the process group the reduce-scatter runs over
    in_place: bool  # gloo: all-reduce the reduce input in place (Reducer.reduce)
    alloc: Callable[..., torch.Tensor] | None  # a custom comm's allocate
    keep_inputs: int  # reduce-scatter inputs left held before a new one is allocated (accelerators)
    rows: tuple[tuple[int, int], ...] | None  # per parameter its (world, size) rows; None: buffers' copy-in
    device: torch.device
    views: tuple[GradView, ...]  # per parameter: its rows of the reduced shard (``grad_views``)
    in_place_all_reduce: Callable[[torch.Tensor], Any] | None  # in_place: the input's async all-reduce

    def matches(self, flat: FlatLayout, dtype: torch.dtype, comm: CommContext, version: int) -> bool:
        return self.flat is flat and self.dtype is dtype and self.comm is comm and self.version == version

    def copy_in(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """The reduce input when the plan's copy-in applies (every gradient present), else None (the caller
        uses ``buffers.reduce_scatter_copy_in``). The same bytes as that copy-in: one cat, cast on the way."""
        rows = self.rows
        if rows is None:
            return None
        try:
            pieces = [g.reshape(r) for g, r in zip(grads, rows)]  # type: ignore[union-attr]
        except AttributeError:  # a parameter without a gradient: zeros, by the general copy-in
            return None
        if pieces[0].dtype is self.dtype:  # no cast: cat allocates the buffer itself
            buf = torch.cat(pieces, dim=1)
            if buf.dtype is self.dtype:  # (else some gradient of another dtype promoted it)
                return buf.view(-1)
        flat = self.flat
        buf = torch.empty((flat.world, flat.shard_numel), dtype=self.dtype, device=self.device)
        torch.cat(pieces, dim=1, out=buf)  # casts on the way
        return buf.view(-1)


def cat_rows(params: Sequence[ShardedParam], flat: FlatLayout, device: torch.device,
             alloc: Callable[..., torch.Tensor] | None) -> tuple[tuple[int, int], ...] | None:
    """Each parameter's ``(world, size)`` rows where the plan's copy-in applies: on CPU (accelerators use
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
