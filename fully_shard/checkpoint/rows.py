"""Row math: dim-0 rows of a tensor, whole-tensor write assignment, and format-2 row-range coverage (pure).

Multi-dim blocks (what ranks hold, write and read) are boxes.py's job. What stays here: a 0-dim tensor
counts as one row; tensors written whole by one rank are balanced over the ranks; and version-2
indexes (chunks as dim-0 row ranges) are checked with ``coverage_problem`` before they are read as
boxes. Pure functions of plain values (no I/O, no torch), property-tested in tests/checkpoint/test_format.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence


def rows_of(shape: Sequence[int]) -> int:
    """Number of dim-0 rows; a 0-dim tensor is one row."""
    return int(shape[0]) if len(shape) else 1


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


def coverage_problem(rows: int, spans: Sequence[tuple[int, int]]) -> str | None:
    """None if the row ranges ``spans`` cover rows [0, rows) exactly once with non-empty ranges, else what is wrong."""
    pos = 0
    for start, end in sorted(spans):
        if not 0 <= start < end <= rows:
            return f"chunk rows [{start}, {end}) are empty or outside the tensor's rows [0, {rows})"
        if start < pos:
            return f"chunk rows [{start}, {end}) overlap rows already covered up to {pos}"
        if start > pos:
            return f"rows [{pos}, {start}) are covered by no chunk"
        pos = end
    if pos != rows:
        return f"rows [{pos}, {rows}) are covered by no chunk"
    return None
