"""Packed all-gathers of ``torch.chunk``-sharded tensors: one collective for many tensors, any dtypes.

Two uses in this package (design/weights.md "What is gathered when"): a unit's shards over its shard group
(``all_gather_chunks``, called by ``unshard.py``: one collective per unit, in the wanted dtype), and the
second stage of a unit whose parameters are DTensors on a TP/EP mesh (``full_values``: one all-gather per
mesh dim that shards them, for all of the unit's such parameters at once). Every rank's pieces are
written (cast) as bytes into its segment of one buffer, each padded to the longest rank's piece,
gathered with one ``all_gather_into_tensor`` and cut into new full tensors (one ``torch.cat`` each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..checkpoint import boxes
from ..comm import collectives


@dataclass(frozen=True)
class Chunked:
    """This rank's ``torch.chunk`` piece ``local`` of a tensor whose extent along ``dim`` is ``length``, moved
    in ``dtype`` (default: its own; the copy-in casts, which commutes with gathering)."""

    local: torch.Tensor
    dim: int
    length: int
    dtype: torch.dtype | None = None

    @property
    def wire(self) -> torch.dtype:
        return self.dtype or self.local.dtype


class Scratch:
    """The byte buffer the packed all-gathers of one iteration share (grown to the largest, freed with the
    iteration): the gathered bytes of one collective live in it until they are cut into new tensors."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.device != device:
            self.buffer = None  # (the old one freed before the new one is allocated)
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.buffer[:nbytes]


def _chunk(length: int, world: int, rank: int) -> int:
    start, end = boxes.chunk_range(length, world, rank)
    return end - start


def all_gather_chunks(items: Sequence[Chunked], group: dist.ProcessGroup, order: Sequence[int] | None = None, *,
                      device: torch.device | None = None, scratch: Scratch | None = None,
                      keep: bool = True) -> list[torch.Tensor]:
    """The full tensors of ``items`` (same list on every rank of ``group``), with one all-gather.

    ``order[i]``: the chunk index held by group rank ``i`` (default: group rank ``i`` holds chunk ``i``).
    Every piece is written (cast to its ``wire`` dtype, moved to ``device``) straight into this rank's
    segment of the gathered buffer as bytes, padded to the longest chunk, so tensors of several dtypes share
    the collective; each full tensor is then cut out of the buffer by one ``torch.cat`` into a new tensor.
    ``keep=False``: the collective only (a rank that needs no values; returns ``[]``). Memory: the
    gathered buffer (``scratch``'s when given) and the outputs.
    """
    device = device if device is not None else (items[0].local.device if items else torch.device("cpu"))
    world = dist.get_world_size(group)
    if world == 1 or not items:
        return [it.local.to(device=device, dtype=it.wire, copy=True) for it in items] if keep else []
    chunk_of = list(order) if order is not None else list(range(world))
    me = dist.get_rank(group)
    slots = []  # per item: (bytes per padded piece, bytes per index of dim)
    for it in items:
        shape = list(it.local.shape)
        rest = math.prod(shape[:it.dim] + shape[it.dim + 1:]) * it.wire.itemsize
        slots.append((_chunk(it.length, world, 0) * rest, rest))
    segment = sum(_aligned(s) for s, _ in slots)
    if scratch is not None:
        buffer = scratch.take(world * segment, device)
    else:
        buffer = torch.empty(world * segment, dtype=torch.uint8, device=device)
    send = buffer[me * segment:(me + 1) * segment]  # in place: this rank's segment of the output
    offset = 0
    for it, (size, _) in zip(items, slots):
        n = it.local.numel()
        if n:  # (16-byte aligned offsets: a view in any dtype)
            send[offset:offset + n * it.wire.itemsize].view(it.wire).view(it.local.shape).copy_(it.local)
        offset += _aligned(size)
    collectives.all_gather_into(buffer, send, group)
    if not keep:
        return []
    rows = buffer.view(world, segment)
    # the chunk index -> the group rank that holds it
    holder = {c: r for r, c in enumerate(chunk_of)}
    out = []
    offset = 0
    for it, (size, rest) in zip(items, slots):
        parts = []
        for c in range(world):
            n = _chunk(it.length, world, c)
            shape = list(it.local.shape)
            shape[it.dim] = n
            raw = rows[holder[c], offset:offset + n * rest]
            parts.append(raw.view(it.wire).view(shape) if rest else torch.empty(shape, dtype=it.wire, device=device))
        out.append(torch.cat(parts, dim=it.dim))
        offset += _aligned(size)
    return out


def _aligned(n: int) -> int:
    return -(-n // 16) * 16


def dims_to_gather(value: DTensor) -> list[int] | None:
    """The mesh dims of ``value`` that shard it, right to left (the order to gather them in), or None
    when a placement is neither ``Shard`` nor ``Replicate`` (``_StridedShard``, ``Partial``)."""
    out = []
    for i, p in enumerate(value.placements):
        if type(p) is Shard:
            out.append(i)
        elif not isinstance(p, Replicate):
            return None
    return out[::-1]


def full_values(values: Sequence[DTensor], *, scratch: Scratch | None = None, keep: bool = True) -> list[torch.Tensor]:
    """Full tensors of DTensors (new tensors; the TP/EP parameters of one gathered unit): one packed all-gather per mesh
    dim that shards them, dims of one mesh taken right to left; DTensors sharing a mesh object share the
    collectives. A placement other than ``Shard``/``Replicate`` is gathered by ``full_tensor()``. ``keep=False``:
    the collectives only (returns ``[]``)."""
    out: list[torch.Tensor | None] = [None] * len(values)
    by_mesh: dict[int, list[int]] = {}
    for i, v in enumerate(values):
        if dims_to_gather(v) is None:
            full = v.full_tensor()
            out[i] = full.clone() if _shares_storage(full, v.to_local()) else full
        else:
            by_mesh.setdefault(id(v.device_mesh), []).append(i)
    for indices in by_mesh.values():
        mesh = values[indices[0]].device_mesh
        current = {i: values[i].to_local() for i in indices}
        coord = mesh.get_coordinate()
        assert coord is not None, "a DTensor of this rank always has a coordinate"
        for dim in reversed(range(mesh.ndim)):
            todo = [i for i in indices if type(values[i].placements[dim]) is Shard]
            if not todo:
                continue
            items = []
            for i in todo:
                v = values[i]
                d = v.placements[dim].dim  # type: ignore[attr-defined]
                # the extent along d once this mesh dim and every later one are gathered
                kept = [boxes.replicate() if j >= dim or not isinstance(p, Shard) else boxes.shard(p.dim)
                        for j, p in enumerate(v.placements)]
                length = boxes.held_box(tuple(v.shape), tuple(mesh.shape), coord, kept).sizes[d]
                items.append(Chunked(current[i], d, length))
            group = mesh.get_group(dim)
            last = not any(type(values[i].placements[d]) is Shard for i in indices for d in range(dim))
            fulls = all_gather_chunks(items, group, _order(mesh, dim, coord, group), scratch=scratch,
                                      keep=keep or not last)
            for i, full in zip(todo, fulls):
                current[i] = full
        for i in indices:
            out[i] = current[i] if dims_to_gather(values[i]) or not keep else current[i].clone()  # (replicated: new)
    if not keep:
        return []
    return [o for o in out if o is not None]  # (every entry set above)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _order(mesh: object, dim: int, coord: Sequence[int], group: dist.ProcessGroup) -> list[int] | None:
    """The coordinate along ``dim`` of each group rank (None when group rank i is coordinate i)."""
    index: list[Any] = [slice(None)] * len(coord)
    for d, c in enumerate(coord):
        if d != dim:
            index[d] = c
    ranks = [int(r) for r in mesh.mesh[tuple(index)].reshape(-1).tolist()]  # type: ignore[attr-defined]
    members = dist.get_process_group_ranks(group)
    order = [ranks.index(g) for g in members]
    return None if order == list(range(len(order))) else order
