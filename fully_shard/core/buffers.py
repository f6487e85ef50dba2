"""The flat buffers of a group's collectives: pack shards in, unpack gathered rows out (no collective here).

See design/data-path.md. A group's tensors are laid out by ``layout.FlatLayout``: every rank owns one
segment of ``shard_numel`` elements, each tensor's padded shard at a fixed offset inside it. The
all-gather is in place (this rank's segment of the output is the input), so an unshard allocates one
buffer; copy-out is one ``split_with_sizes_copy`` into the unsharded parameters (``QuantizedAllGather``:
the segment is int8 blocks + scales packed as bytes, dequantized before that copy; quantize.py). The
k-rank partial all-gather (reshard_after_forward=k) packs the block a rank kept. The reduce side packs
unsharded gradients into a ``(world, shard_numel)`` buffer whose row r goes to rank r. The collectives
themselves are in ``comm/collectives.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..comm.collectives import Alloc, allocate, segment
from ..parallel.mesh import SubgroupInfo
from . import quantize
from .layout import ByteLayout, FlatLayout
from .param import ShardedParam
from .quantize import BlockLayout

# private (design/private-torch.md): without it the all-gather copy-in flattens each shard with one view
# per unshard, and the reduce copy-in pads with one copy per padded grad
_chunk_cat = getattr(torch, "_chunk_cat", None)

__all__ = [
    "all_gather_copy_in", "all_gather_copy_out", "mixed_all_gather_copy_in", "mixed_all_gather_copy_out",
    "mixed_partial_shard_copy_in", "partial_all_gather_copy_in", "partial_shard_copy_in",
    "quantized_all_gather_copy_in", "quantized_all_gather_copy_out", "reduce_scatter_copy_in",
]


# --- all-gather ------------------------------------------------------------------------------------
def all_gather_copy_in(params: Sequence[ShardedParam], flat: FlatLayout, rank: int, dtype: torch.dtype,
                       device: torch.device, *, alloc: Alloc | None = None) -> torch.Tensor:
    """Allocate the gathered buffer and write this rank's padded shards (cast to ``dtype``) into
    its own segment. Returns the whole ``world * shard_numel`` buffer.

    One ``torch._chunk_cat`` with one chunk where every piece is a non-empty ``Shard(0)`` shard (or its
    padding zeros) of one dtype: it flattens each in C++, so no flattened view per parameter is made
    per unshard nor kept between them (each kept view is host memory for the process's lifetime).
    Else one ``torch.cat`` of flattened pieces (``ShardedParam.copy_in_parts``)."""
    out = allocate(alloc, flat.total_numel, dtype, device)
    if not params:
        return out
    own = segment(out, rank, flat.world)
    if _chunk_cat is not None:
        sources: list[torch.Tensor] = []
        source_dtype = None
        for p in params:
            pieces = p.copy_in_sources(device)
            if pieces is None or (source_dtype is not None and pieces[0].dtype is not source_dtype):
                break  # (a shard's padding zeros share its dtype)
            source_dtype = pieces[0].dtype
            sources += pieces
        else:
            _chunk_cat(sources, 0, 1, out=own.view(1, -1))
            return out
    torch.cat([part for p in params for part in p.copy_in_parts(device)], out=own)
    return out


def partial_all_gather_copy_in(block: torch.Tensor, flat: FlatLayout | ByteLayout, over: SubgroupInfo,
                               dtype: torch.dtype, device: torch.device, *, alloc: Alloc | None = None) -> torch.Tensor:
    """reshard_after_forward=k: allocate the gathered buffer and write the block this rank kept
    (``partial_shard_copy_in``) into its k-subgroup segment."""
    out = allocate(alloc, flat.total_numel, dtype, device)
    segment(out, over.rank, over.world).copy_(block)
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
        outs.append(staged[-1][1] if p.staged_gather else p.gather_rows(world, size))
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
        parts += p.copy_in_parts(device)
        if block_pad:
            parts.append(parts[-1].new_zeros(block_pad))
    if parts:
        quantize.pack(torch.cat(parts), blocks, segment(out, rank, world))
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


# --- several dtypes in one all-gather (param_dtype_override_fn) ----------------------------------------
def mixed_all_gather_copy_in(params: Sequence[ShardedParam], dtypes: Sequence[torch.dtype], layout: ByteLayout,
                             rank: int, device: torch.device, *, alloc: Alloc | None = None) -> torch.Tensor:
    """``all_gather_copy_in`` for a group gathering its parameters at different dtypes: a ``uint8`` buffer,
    this rank's segment the bytes of each padded shard cast to its own dtype, back to back (torch 2.15's
    byte all-gather). One ``torch.cat``."""
    out = allocate(alloc, layout.total_numel, torch.uint8, device)
    parts = [part.to(dtype).view(torch.uint8) for p, dtype in zip(params, dtypes) for part in p.copy_in_parts(device)]
    if parts:
        torch.cat(parts, out=segment(out, rank, layout.world))
    return out


def mixed_all_gather_copy_out(out: torch.Tensor, params: Sequence[ShardedParam], dtypes: Sequence[torch.dtype],
                              layout: ByteLayout) -> None:
    """Scatter the gathered bytes into each parameter's unsharded storage (its own dtype): one split of the
    ``(world, segment bytes)`` rows into byte views of the storages (staged parameters: a buffer of their
    dtype, copied once more as ``all_gather_copy_out`` does)."""
    world = layout.world
    outs, staged = [], []
    for p, dtype, size in zip(params, dtypes, layout.flat.sizes):
        if p.staged_gather:
            dst = torch.empty((world, size), dtype=dtype, device=out.device)
            staged.append((p, dst))
        else:
            dst = p.gather_rows(world, size)
        outs.append(dst.view(torch.uint8))
    if outs:
        torch.split_with_sizes_copy(out.view(world, layout.shard_numel), list(layout.sizes), dim=1, out=outs)
    for p, dst in staged:
        p.write_unsharded(dst)


def mixed_partial_shard_copy_in(params: Sequence[ShardedParam], layout: ByteLayout,
                                over: SubgroupInfo) -> torch.Tensor:
    """``partial_shard_copy_in`` in bytes: the block a rank keeps after a partial reshard of a group gathered
    at several dtypes (``partial_all_gather_copy_in`` then writes it into a ``uint8`` buffer)."""
    world = layout.world
    per = world // over.world
    rows = slice(over.rank * per, (over.rank + 1) * per)
    parts = [(p.unsharded_write.view(1, 1).expand(per, 1).contiguous() if p.layout.replicated
              else p.unsharded_rows(world, size)[rows].contiguous()).view(torch.uint8)
             for p, size in zip(params, layout.flat.sizes)]
    return torch.cat(parts, dim=1).view(-1)


# --- reduce-scatter -------------------------------------------------------------------------------


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


def reduce_scatter_copy_in(grads: Sequence[torch.Tensor | None], params: Sequence[ShardedParam],
                           flat: FlatLayout, dtype: torch.dtype, device: torch.device, *,
                           alloc: Alloc | None = None) -> torch.Tensor:
    """Pack unsharded grads into a ``(world, shard_numel)`` buffer of ``dtype``; row r goes to rank r.

    Where every grad is present, non-empty, of one dtype and sharded along dim 0: one ``torch._chunk_cat``
    (each grad's rows split per rank, padded and cast in the same kernel, torch's FSDP2 copy-in); on CPU
    only where some grad needs padding (else ``torch.cat`` of views is one copy too, and the CPU kernel
    measured a higher peak RSS: design/data-path.md). Else one
    ``torch.cat`` along dim 1 of ``(world, size)`` views (it casts to ``dtype`` on the way); only a grad
    whose rows do not fill the padded layout is copied once to pad it. Missing grads are zeros.
    A replicated (0-dim) parameter's grad is written into every rank's row, so the reduce-scatter sums
    it over ranks like an all-reduce would.
    """
    world = flat.world
    buf = allocate(alloc, world * flat.shard_numel, dtype, device).view(world, flat.shard_numel)
    if _chunk_cat is not None and _chunk_catable(grads, params) and (
            device.type != "cpu" or _needs_padding(grads, world)):
        _chunk_cat(grads, 0, world, out=buf)  # pads each grad's rows per rank and casts: one kernel
        return buf.view(-1)
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
    if pieces:
        torch.cat(pieces, dim=1, out=buf)
    return buf.view(-1)
