"""Every collective the core issues: the flat-buffer data path and its few control-plane calls.

See design/data-path.md. Data path: pack -> all-gather -> unpack; pack -> reduce-scatter (-> HSDP
all-reduce). A group's tensors are laid out by ``layout.FlatLayout``: every rank owns one segment of
``shard_numel`` elements, each tensor's padded shard at a fixed offset inside it. The all-gather is in
place (this rank's segment of the output is the input), so an unshard allocates one buffer; copy-out
is one ``split_with_sizes_copy`` into the unsharded parameters (``QuantizedAllGather``: the segment is
int8 blocks + scales packed as bytes, dequantized before that copy; quantize.py). The k-rank partial all-gather
(reshard_after_forward=k) is the same call over a ``SubgroupInfo`` of k ranks. Control plane: the
structure check at fully_shard() time, gradient-norm sums (clip.py) and meta-init broadcasts (init.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core import quantize
from ..core.layout import FlatLayout
from ..core.param import ShardedParam
from ..core.quantize import BlockLayout
from ..parallel.mesh import SubgroupInfo

AVG: dist.ReduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]  # NCCL and gloo both average


def _all_gather_fn():  # torch >= 2.13 renamed all_gather_into_tensor to all_gather_single
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


Alloc = Callable[..., torch.Tensor]  # a custom comm's ``allocate(size, *, dtype, device)``


def allocate(alloc: Alloc | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat communication buffer: from a ``set_custom_all_gather``/``set_custom_reduce_scatter``
    object's ``allocate`` (torch's ``Comm`` protocol) when given, else ``torch.empty``."""
    if alloc is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = alloc((numel,), dtype=dtype, device=device)
    if buf.numel() != numel or buf.dtype != dtype or not buf.is_contiguous():
        raise ValueError(f"custom comm allocate(({numel},), dtype={dtype}, device={device}) returned a "
                         f"{'' if buf.is_contiguous() else 'non-contiguous '}{buf.dtype} tensor of "
                         f"{buf.numel()} elements. Fix: return a contiguous tensor of that size and dtype.")
    return buf.view(-1)


def _segment(buffer: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rank``'s share of a flat buffer split evenly over ``world`` ranks."""
    block = buffer.numel() // world
    return buffer.narrow(0, rank * block, block)


# --- all-gather ------------------------------------------------------------------------------------
def all_gather_copy_in(params: Sequence[ShardedParam], flat: FlatLayout, rank: int, dtype: torch.dtype,
                       device: torch.device, *, alloc: Alloc | None = None) -> torch.Tensor:
    """Allocate the gathered buffer and write this rank's padded shards (cast to ``dtype``) into
    its own segment. Returns the whole ``world * shard_numel`` buffer."""
    out = allocate(alloc, flat.total_numel, dtype, device)
    parts = [part for p in params for part in p.copy_in_parts()]
    if parts and parts[0].device != device:  # CPU offload: shards live on the host
        parts = [part.to(device, non_blocking=True) for part in parts]
    if parts:
        torch.cat(parts, out=_segment(out, rank, flat.world))
    return out


def partial_all_gather_copy_in(block: torch.Tensor, flat: FlatLayout, over: SubgroupInfo, dtype: torch.dtype,
                               device: torch.device, *, alloc: Alloc | None = None) -> torch.Tensor:
    """reshard_after_forward=k: allocate the gathered buffer and write the block this rank kept
    (``partial_shard_copy_in``) into its k-subgroup segment."""
    out = allocate(alloc, flat.total_numel, dtype, device)
    _segment(out, over.rank, over.world).copy_(block)
    return out


def all_gather(out: torch.Tensor, over: SubgroupInfo, async_op: bool, *, comm: Any = None) -> dist.Work | None:
    """In-place all-gather over ``over`` (the shard group or a k-subgroup) of this rank's segment of
    ``out`` into the whole of ``out``, by ``comm(output_tensor=, input_tensor=, group=, async_op=)`` when
    a custom all-gather is set. Over one rank the segment is the whole buffer: no collective
    (as torch's FSDP2; NO_SHARD's one-rank shard groups too)."""
    if over.world == 1:
        return None
    inp = _segment(out, over.rank, over.world)
    if comm is not None:
        return comm(output_tensor=out, input_tensor=inp, group=over.group, async_op=async_op)
    return all_gather_into(out, inp, over.group, async_op=async_op)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, *,
                    async_op: bool = False) -> dist.Work | None:
    """``out`` = every rank's ``inp`` back to back (the one call of torch's tensor all-gather)."""
    return _all_gather_fn()(out, inp, group=group, async_op=async_op)


def all_gather_object(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj`` (pickled; error paths, and the extension layout check at lazy init)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_copy_out(out: torch.Tensor, params: Sequence[ShardedParam], flat: FlatLayout) -> None:
    """Scatter the gathered buffer into each parameter's (padded) unsharded storage: one op."""
    _scatter_rows(out.view(flat.world, flat.shard_numel), params, flat.sizes)


def _scatter_rows(rows: torch.Tensor, params: Sequence[ShardedParam], sizes: Sequence[int],
                  pads: Sequence[int] | None = None) -> None:
    """``rows`` ``(world, ...)`` holds each parameter's ``sizes[i]`` values per rank, followed by
    ``pads[i]`` values to drop; copy them into the unsharded storages with one split."""
    world = rows.shape[0]
    outs, split, staged = [], [], []
    for i, (p, size) in enumerate(zip(params, sizes)):
        if p.staged_gather:
            staged.append((p, rows.new_empty((world, size))))
        outs.append(staged[-1][1] if p.staged_gather else p.unsharded_write.view(world, size))
        split.append(size)
        if pads is not None and pads[i]:
            outs.append(rows.new_empty((world, pads[i])))
            split.append(pads[i])
    if outs:
        torch.split_with_sizes_copy(rows, split, dim=1, out=outs)
    for p, dst in staged:  # 0-dim or Shard(d > 0): one more copy into the contiguous parameter
        p.write_unsharded(dst)


def quantized_all_gather_copy_in(params: Sequence[ShardedParam], blocks: BlockLayout, rank: int, world: int,
                                 device: torch.device, *, alloc: Alloc | None = None) -> torch.Tensor:
    """QuantizedAllGather: allocate the gathered uint8 buffer (``world`` packed segments) and quantize
    this rank's padded shards, each padded to whole blocks, into its own segment (quantize.py)."""
    out = allocate(alloc, world * blocks.packed_nbytes, torch.uint8, device)
    parts = []
    for p, block_pad in zip(params, blocks.pieces[1::2]):
        parts += p.copy_in_parts()
        if block_pad:
            parts.append(parts[-1].new_zeros(block_pad))
    if parts and parts[0].device != device:  # CPU offload: shards live on the host
        parts = [part.to(device, non_blocking=True) for part in parts]
    if parts:
        quantize.pack(torch.cat(parts), blocks, _segment(out, rank, world))
    return out


def quantized_all_gather_copy_out(out: torch.Tensor, params: Sequence[ShardedParam], blocks: BlockLayout,
                                  dtype: torch.dtype) -> None:
    """Dequantize every rank's packed segment into ``dtype`` and copy it into the unsharded storages
    (one dequantize into a ``(world, blocked_numel)`` buffer, one split that drops the block padding)."""
    rows = out.view(-1, blocks.packed_nbytes)
    values = quantize.dequantize(quantize.data_view(rows, blocks), quantize.scales_view(rows, blocks),
                                 blocks.block_size, dtype)
    _scatter_rows(values, params, blocks.pieces[0::2], blocks.pieces[1::2])


def partial_shard_copy_in(params: Sequence[ShardedParam], flat: FlatLayout,
                          over: SubgroupInfo) -> torch.Tensor:
    """The block of the gathered buffer a rank keeps after a partial reshard: segments
    ``[r * W/k, (r + 1) * W/k)`` for its rank ``r`` in the k-subgroup ``over``, rebuilt from the
    unsharded params (one cat)."""
    world = flat.world
    per = world // over.world
    rows = slice(over.rank * per, (over.rank + 1) * per)
    parts = [p.unsharded_write.view(1, 1).expand(per, 1) if p.layout.replicated
             else p.unsharded_rows(world, size)[rows] for p, size in zip(params, flat.sizes)]
    return torch.cat(parts, dim=1).view(-1)


# --- reduce-scatter and all-reduce -------------------------------------------------------------------
def reduce_scatter_copy_in(grads: Sequence[torch.Tensor | None], params: Sequence[ShardedParam],
                           flat: FlatLayout, dtype: torch.dtype, device: torch.device, *,
                           alloc: Alloc | None = None) -> torch.Tensor:
    """Pack unsharded grads into a ``(world, shard_numel)`` buffer of ``dtype``; row r goes to rank r.

    One ``torch.cat`` along dim 1 of ``(world, size)`` views (it casts to ``dtype`` on the way); only a
    grad whose rows do not fill the padded layout is copied once to pad it. Missing grads are zeros.
    A replicated (0-dim) parameter's grad is written into every rank's row, so the reduce-scatter sums
    it over ranks like an all-reduce would.
    """
    world = flat.world
    pieces = []
    for grad, p, size in zip(grads, params, flat.sizes):
        if grad is None:
            pieces.append(torch.zeros(world, size, dtype=dtype, device=device))
        elif p.layout.replicated:
            pieces.append(grad.reshape(1, 1).expand(world, 1))
        else:
            src = p.moved(grad).reshape(-1)  # shard dim first (a no-op for Shard(0))
            pad = world * size - src.numel()
            pieces.append((F.pad(src, (0, pad)) if pad else src).view(world, size))
    buf = allocate(alloc, world * flat.shard_numel, dtype, device).view(world, flat.shard_numel)
    if pieces:
        torch.cat(pieces, dim=1, out=buf)
    return buf.view(-1)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp,
                   async_op: bool, *, comm: Any = None) -> dist.Work | None:
    """``out`` = this rank's segment of ``inp`` reduced over ``group`` (by ``comm(output_tensor=,
    input_tensor=, group=, op=, async_op=)`` when a custom reduce-scatter is set); over one rank
    (``inp`` is one segment) a copy, no collective."""
    if out.numel() == inp.numel():
        out.copy_(inp)
        return None
    if comm is not None:
        return comm(output_tensor=out, input_tensor=inp, group=group, op=op, async_op=async_op)
    return _reduce_scatter_fn()(out, inp, op=op, group=group, async_op=async_op)


def reduce_scatter_is_all_reduce(group: dist.ProcessGroup) -> bool:
    """gloo's reduce-scatter is an all-reduce of a copy of the input (then a copy-out of this rank's
    segment at ``wait``): on gloo the library all-reduces its own reduce input in place instead, same
    bits and bytes on the wire, one input-sized copy less, and the input is the only buffer in flight
    (design/data-path.md)."""
    return str(dist.get_backend(group)) == "gloo"


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None,
               op: dist.ReduceOp | dist.ReduceOp.RedOpType, *, async_op: bool = False) -> dist.Work | None:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Synchronous broadcast from global rank ``src`` (meta-init of replicated tensors)."""
    dist.broadcast(tensor, src=src, group=group)

