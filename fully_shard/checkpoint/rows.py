"""Row math: which global dim-0 rows a rank holds, which it writes, and which stored chunks it reads.

See design/checkpoint-format.md section 1. Every tensor is cut along dim 0 into chunks of whole rows;
a 0-dim tensor counts as one row. Pure functions of plain values (no I/O, no torch), property-tested in
tests/checkpoint/test_format.py.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from ..layout import DimZeroLayout

SHARD = "shard"
REPLICATE = "replicate"


class RowSpan(Protocol):
    """Anything that covers global rows [start, end) of a tensor (format.Chunk)."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...


S = TypeVar("S", bound=RowSpan)


def rows_of(shape: Sequence[int]) -> int:
    """Number of dim-0 rows; a 0-dim tensor is one row."""
    return int(shape[0]) if len(shape) else 1


def row_numel(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) else 1


def held_rows(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[str]) -> tuple[int, int]:
    """[start, end) of the global rows a rank at ``coord`` holds (DTensor ``Shard(0)`` = torch.chunk).

    Several ``shard`` mesh dims split the rows one after the other, left to right, as DTensor does.
    """
    if not (len(mesh_shape) == len(coord) == len(placements)):
        raise ValueError(f"mesh_shape {mesh_shape}, coord {coord} and placements {placements} differ in length")
    start, end = 0, rows_of(shape)
    for size, c, placement in zip(mesh_shape, coord, placements):
        if placement == SHARD:
            if not len(shape):
                raise ValueError("a 0-dim tensor cannot be sharded along dim 0")
            s, e = DimZeroLayout((end - start,), size).row_range(c)
            start, end = start + s, start + e
        elif placement != REPLICATE:
            raise ValueError(f"unknown placement {placement!r}")
    return start, end


def write_rows(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
               placements: Sequence[str]) -> tuple[int, int]:
    """[start, end) of the rows this rank writes: its held rows, split evenly among the replicas.

    The ranks that hold the same rows (they differ only on ``replicate`` mesh dims) each write one
    torch.chunk part of those rows, so replicated data is written exactly once and the bytes are spread
    over all ranks. A 0-dim tensor is written by replica 0.
    """
    start, end = held_rows(shape, mesh_shape, coord, placements)
    replicas, index = 1, 0
    for size, c, placement in zip(mesh_shape, coord, placements):
        if placement == REPLICATE:
            replicas, index = replicas * size, index * size + c
    s, e = DimZeroLayout((end - start,), replicas).row_range(index)
    return start + s, start + e


def assign_whole(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Balance tensors that must be written whole by one rank: largest first onto the least-loaded rank.

    Deterministic in its inputs, so every rank computes the same assignment without communication.
    """
    heap = [(0, rank) for rank in range(world)]
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        out[name] = rank
        heapq.heappush(heap, (load + max(sizes[name], 1), rank))
    return out


def coverage_problem(rows: int, chunks: Sequence[RowSpan]) -> str | None:
    """None if ``chunks`` cover rows [0, rows) exactly once with non-empty chunks, else what is wrong."""
    pos = 0
    for c in sorted(chunks, key=lambda c: (c.start, c.end)):
        if not 0 <= c.start < c.end <= rows:
            return f"chunk rows [{c.start}, {c.end}) are empty or outside the tensor's rows [0, {rows})"
        if c.start < pos:
            return f"chunk rows [{c.start}, {c.end}) overlap rows already covered up to {pos}"
        if c.start > pos:
            return f"rows [{pos}, {c.start}) are covered by no chunk"
        pos = c.end
    if pos != rows:
        return f"rows [{pos}, {rows}) are covered by no chunk"
    return None


def overlaps(chunks: Sequence[S], start: int, end: int) -> list[tuple[S, int, int]]:
    """The parts of ``chunks`` inside global rows [start, end), as (chunk, global_start, global_end).

    Read chunk rows [global_start - chunk.start, global_end - chunk.start) into target rows
    [global_start - start, global_end - start).
    """
    out = []
    for c in chunks:
        s, e = max(c.start, start), min(c.end, end)
        if s < e:
            out.append((c, s, e))
    return sorted(out, key=lambda t: t[1])
