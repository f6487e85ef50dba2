"""Box math: which block of a tensor's global index space a rank holds, writes and reads (pure).

See design/checkpoint-format.md section 1. A rank's local shard of any DTensor this library produces
(``Shard(d)`` for any d, ``_StridedShard(d, sf)``, ``Replicate()``, on meshes of any rank) is one *box*:
an offset and a size in every dim of the global tensor. Stored chunks are boxes too, so loading is
the intersection of the boxes a rank wants with the boxes that were saved, read as runs of
contiguous elements. Pure functions of plain values (no I/O, no torch), property-tested in
tests/checkpoint/test_multidim.py against DTensor's own local shapes and offsets.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

SHARD = "shard"
STRIDED = "strided"  # torch's _StridedShard(dim, split_factor): FSDP's dp axis over a TP-sharded dim
REPLICATE = "replicate"

# Work bound of coverage_problem (boxes visited): grid-like tilings, the only kind fully_shard writes,
# need about one visit per chunk; a hostile index cannot make the check run for hours.
MAX_COVERAGE_WORK = 10_000_000


class NotABox(ValueError):
    """A placement combination whose local shard is not one block of the global tensor (or not one we know)."""


@dataclass(frozen=True)
class Placement:
    """A DTensor placement as plain data: ``kind`` (SHARD, STRIDED, REPLICATE), tensor ``dim``, split factor."""

    kind: str
    dim: int = 0
    split_factor: int = 1


def shard(dim: int) -> Placement:
    return Placement(SHARD, dim)


def strided(dim: int, split_factor: int) -> Placement:
    return Placement(STRIDED, dim, split_factor)


def replicate() -> Placement:
    return Placement(REPLICATE)


@dataclass(frozen=True)
class Box:
    """Global indices ``[offsets[d], offsets[d] + sizes[d])`` in every dim d; a 0-dim tensor's box is ``((), ())``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property  # not functools.cached_property: before Python 3.12 it takes a lock on every access
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple([o + s for o, s in zip(self.offsets, self.sizes)])

    def slices(self, origin: Box | None = None) -> tuple[slice, ...]:
        """Index this box in a tensor whose element [0, ...] is global ``origin.offsets`` (default: 0)."""
        base = origin.offsets if origin is not None else (0,) * len(self.offsets)
        return tuple(slice(o - b, o - b + s) for o, s, b in zip(self.offsets, self.sizes, base))

    def relative_to(self, origin: Box) -> Box:
        return Box(tuple(o - b for o, b in zip(self.offsets, origin.offsets)), self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common part, or None when it has no element."""
        lo, sizes = [], []
        for a, s, b, t in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            start, end = max(a, b), min(a + s, b + t)
            if end <= start:
                return None
            lo.append(start)
            sizes.append(end - start)
        return Box(tuple(lo), tuple(sizes))

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}


def full_box(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(int(s) for s in shape))


def chunk_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part ``index`` of ``torch.chunk(range(length), parts)`` (empty parts at the end)."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


def _order(axes: list[tuple[int, Placement]], sizes: Sequence[int]) -> list[int]:
    """The order in which the mesh axes ``axes`` (all sharding one dim, in mesh order) split it.

    ``Shard`` splits left to right. ``_StridedShard(d, sf)`` is right-to-left sharding, as FSDP makes it
    over tensor parallelism: its axis splits *after* the following axes whose sizes multiply to ``sf``
    (FSDP chunks the TP-local tensor), so (_StridedShard(0, sf=tp), Shard(0)) on (dp, tp) is the tp
    chunk, then the dp chunk of that.
    """
    if not axes:
        return []
    (first, p), rest = axes[0], axes[1:]
    if p.kind == SHARD or p.split_factor == 1:
        return [first, *_order(rest, sizes)]
    k, product = 0, 1
    while product < p.split_factor and k < len(rest):
        product *= sizes[rest[k][0]]
        k += 1
    if product != p.split_factor:
        raise NotABox(f"_StridedShard(dim={p.dim}, sf={p.split_factor}) on mesh axis {first}: the later axes that "
                      f"shard dim {p.dim} have sizes {[sizes[i] for i, _ in rest]}, no leading run of which multiplies "
                      f"to {p.split_factor} (FSDP over tensor parallelism gives sf = their product)")
    return [*_order(rest[:k], sizes), first, *_order(rest[k:], sizes)]


def held_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
             placements: Sequence[Placement]) -> Box:
    """The box of the global tensor that the rank at ``coord`` holds.

    Each dim is cut with torch.chunk by the axes that shard it: ``Shard`` axes left to right (DTensor's
    rule, uneven sizes included), a ``_StridedShard`` axis after the axes its split factor stands for
    (``_order``). For even sizes this is exactly DTensor's own layout; for uneven ones it is what FSDP
    over TP stores (the dp chunk of the TP-local tensor). Raises NotABox for a ``_StridedShard`` whose
    split factor no later axes make up.
    """
    if not (len(mesh_shape) == len(coord) == len(placements)):
        raise ValueError(f"mesh_shape {mesh_shape}, coord {coord} and placements {placements} differ in length")
    by_dim: dict[int, list[tuple[int, Placement]]] = {}
    for axis, p in enumerate(placements):
        if p.kind == REPLICATE:
            continue
        if p.kind not in (SHARD, STRIDED) or not 0 <= p.dim < len(shape) or p.split_factor < 1:
            raise ValueError(f"placement {p} cannot split a tensor of shape {tuple(shape)}")
        by_dim.setdefault(p.dim, []).append((axis, p))
    offsets, sizes = [0] * len(shape), [int(s) for s in shape]
    for d, axes in by_dim.items():
        for axis in _order(axes, mesh_shape):
            s, e = chunk_range(sizes[d], mesh_shape[axis], coord[axis])
            offsets[d], sizes[d] = offsets[d] + s, e - s
    return Box(tuple(offsets), tuple(sizes))


def write_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[Placement]) -> Box | None:
    """The part of its held box this rank writes; None when it writes nothing of this tensor.

    The ranks that hold the same box (they differ only on ``Replicate()`` axes) each write one
    torch.chunk part of it along dim 0, so replicated data is written exactly once and the bytes are
    spread over all ranks. A 0-dim tensor is written by replica 0.
    """
    held = held_box(shape, mesh_shape, coord, placements)
    replicas, index = 1, 0
    for size, c, p in zip(mesh_shape, coord, placements):
        if p.kind == REPLICATE:
            replicas, index = replicas * size, index * size + c
    if not shape:
        return held if index == 0 else None
    s, e = chunk_range(held.sizes[0], replicas, index)
    out = Box((held.offsets[0] + s, *held.offsets[1:]), (e - s, *held.sizes[1:]))
    return out if out.numel else None


class HasBox(Protocol):
    """Anything that stores one box of a tensor (format.Chunk)."""

    @property
    def box(self) -> Box: ...


C = TypeVar("C", bound=HasBox)


def overlaps(chunks: Sequence[C], want: Box) -> list[tuple[C, Box]]:
    """The stored chunks that hold part of ``want``, each with that part (a box in global indices).

    Read ``part.relative_to(chunk.box)`` of the chunk into ``part.slices(want)`` of the target.
    """
    out = []
    for c in chunks:
        part = c.box.intersect(want)
        if part is not None:
            out.append((c, part))
    return out


def runs(sizes: Sequence[int], part: Box) -> tuple[int, list[int]]:
    """Contiguous runs of a C-ordered tensor of ``sizes`` that make up ``part`` (relative indices).

    Returns (elements per run, element offset of each run), in the C order of ``part``: read back to
    back, they fill a contiguous tensor of ``part.sizes``. Dims that ``part`` spans fully at the end merge
    into one run, so a block of whole rows is one run.
    """
    if not sizes:
        return 1, [0]
    if part.numel == 0:
        return 0, []
    strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    t = len(sizes) - 1
    while t >= 0 and part.offsets[t] == 0 and part.sizes[t] == sizes[t]:
        t -= 1
    if t < 0:
        return math.prod(sizes), [0]
    run = part.sizes[t] * strides[t]
    base = part.offsets[t] * strides[t]
    outer = [range(part.offsets[d], part.offsets[d] + part.sizes[d]) for d in range(t)]
    starts = [base + sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*outer)]
    return run, starts


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes, in C order, that tile elements ``[start, stop)`` of a C-ordered tensor of ``shape``.

    A contiguous byte range of a stored tensor (one block of a streamed file) is at most ``2 k - 1`` boxes
    for ``k`` dims: a partial row at each end of each dim around one box of whole rows. A 0-dim tensor's
    one element is the box ``((), ())``."""
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    head, tail = start - first * row, stop - last * row
    rest = tuple(shape[1:])

    def within(index: int, lo: int, hi: int) -> list[Box]:
        return [Box((index, *b.offsets), (1, *b.sizes)) for b in flat_boxes(rest, lo, hi)]

    if first == last:
        return within(first, head, tail)
    out = within(first, head, row) if head else []
    body = first + (1 if head else 0)
    end = last + (1 if tail == row else 0)
    if end > body:
        out.append(Box((body, *(0,) * len(rest)), (end - body, *rest)))
    if tail != row:
        out += within(last, 0, tail)
    return out


def span_read(run: int, starts: Sequence[int]) -> bool:
    """Whether to read runs ``(run, starts)`` as one range from the first to the end of the last.

    Yes when there are several runs and the gap bytes between them are at most the wanted bytes (a
    column block of at least half of each row): one read of at most twice the data instead of a read
    per run. A narrower block is read run by run, so no read is more than twice what the rank needs.
    """
    if len(starts) < 2:
        return False
    wanted = run * len(starts)
    return starts[-1] + run - starts[0] - wanted <= wanted


def slabs(part: Box, max_numel: int) -> list[Box]:
    """``part`` cut along its first dim longer than 1 into boxes of at most ``max_numel`` elements (at least one
    index of that dim each); the whole ``part`` when it fits or no dim is longer than 1."""
    d = next((i for i, s in enumerate(part.sizes) if s > 1), None)
    if d is None or part.numel <= max_numel:
        return [part]
    step = max(1, max_numel // (part.numel // part.sizes[d]))
    out = []
    for start in range(0, part.sizes[d], step):
        offsets, sizes = list(part.offsets), list(part.sizes)
        offsets[d] += start
        sizes[d] = min(step, part.sizes[d] - start)
        out.append(Box(tuple(offsets), tuple(sizes)))
    return out


def coverage_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None if ``boxes`` (each non-empty, inside ``shape``) tile the tensor exactly once, else what is wrong.

    A tensor with no element has no chunk; a 0-dim tensor has exactly one, ``((), ())``.
    """
    shape = tuple(shape)
    k = len(shape)
    for b in boxes:
        lo, hi = b.offsets, b.ends
        if len(lo) != k or len(b.sizes) != k or not all(
                lo[i] >= 0 and hi[i] > lo[i] and hi[i] <= shape[i] for i in range(k)):
            return (f"chunk at offsets {list(b.offsets)} with sizes {list(b.sizes)} is empty or outside the tensor's "
                    f"shape {list(shape)}")
    if math.prod(shape) == 0:
        return f"chunks listed for a tensor of shape {list(shape)}, which has no element" if boxes else None
    spans = [(b.offsets, b.ends) for b in boxes]
    return _cover(spans, shape, 0, (), [MAX_COVERAGE_WORK])


Span = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, ends) of a box


def _cover(spans: list[Span], shape: tuple[int, ...], d: int, at: tuple[int, ...], budget: list[int]) -> str | None:
    """Exact cover of dims d.. by ``spans`` (all of which cover position ``at`` in dims ..d-1): a sweep over dim d
    that checks each slab between chunk boundaries recursively (a slab like the previous one is skipped), so
    a grid of n chunks costs about n steps."""
    budget[0] -= len(spans)
    if budget[0] < 0:
        return f"the chunks are too fragmented to check (more than {MAX_COVERAGE_WORK} steps)"
    where = f"index {list(at)}" if at else "the tensor"
    if d == len(shape):
        return None if len(spans) == 1 else f"{len(spans)} chunks overlap at {where}"
    if all(lo[e] == 0 and hi[e] == shape[e] for lo, hi in spans for e in range(d + 1, len(shape))):
        return _cover_1d(spans, shape, d, where)  # nothing cuts the later dims: intervals of dim d
    order = sorted(spans, key=lambda sp: sp[0][d])
    bounds = sorted({0, shape[d], *(lo[d] for lo, _ in spans), *(hi[d] for _, hi in spans)})
    nxt = 0
    active: list[Span] = []
    previous: list[Span] = []
    for lo, hi in itertools.pairwise(bounds):
        while nxt < len(order) and order[nxt][0][d] <= lo:
            active.append(order[nxt])
            nxt += 1
        active = [sp for sp in active if sp[1][d] > lo]
        if not active:
            return f"indices [{lo}, {hi}) of dim {d} at {where} are covered by no chunk"
        if len(active) != len(previous) or any(a is not b for a, b in zip(active, previous)):
            problem = _cover(active, shape, d + 1, (*at, lo), budget)
            if problem:
                return problem
            previous = active
    return None


def _cover_1d(spans: list[Span], shape: tuple[int, ...], d: int, where: str) -> str | None:
    pos = 0
    for lo, hi in sorted(spans, key=lambda sp: sp[0][d]):
        if lo[d] < pos:
            return f"chunks overlap at indices [{lo[d]}, {min(pos, hi[d])}) of dim {d} at {where}"
        if lo[d] > pos:
            return f"indices [{pos}, {lo[d]}) of dim {d} at {where} are covered by no chunk"
        pos = hi[d]
    if pos != shape[d]:
        return f"indices [{pos}, {shape[d]}) of dim {d} at {where} are covered by no chunk"
    return None
