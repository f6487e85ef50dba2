"""Owner plan for distributed Muon: which rank orthogonalizes which matrix, in which bucket (pure, no process group).

Every rank builds the plan from the same inputs (the global shapes of the Muon matrices sharded over one
process group, in optimizer order), so every rank gets the same plan without communicating; the optimizer
checks that once per plan (``digest``). Assignment is greedy longest-processing-time on the Newton-Schulz
cost ``steps * s^2 * (2l + s)`` (``s``/``l``: the short/long side; two matmuls of the Gram form per
step), which keeps the most loaded owner within 4/3 of the optimum. Buckets are the owners' lists read
column by column: bucket ``k`` holds each owner's ``k``-th matrix (``per_bucket`` of them per owner), so a
bucket's all-to-all moves about ``1/W`` of every owner's rows and its Newton-Schulz work is balanced.
See design/muon.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Bucket", "MatrixSpec", "OwnerPlan", "chunk_rows", "ns_cost", "plan_owners"]


@dataclass(frozen=True)
class MatrixSpec:
    """One Muon matrix as the plan sees it: ``rows`` x ``cols`` sharded by rows over ``world`` ranks;
    ``blocks`` independent row blocks (per-head Newton-Schulz) share one owner."""

    name: str
    rows: int
    cols: int
    blocks: int = 1


@dataclass(frozen=True)
class Bucket:
    """Matrices exchanged by one all-to-all pair: indices into the plan's specs, and each one's owner."""

    index: int
    matrices: tuple[int, ...]
    owners: tuple[int, ...]


@dataclass(frozen=True)
class OwnerPlan:
    world: int
    specs: tuple[MatrixSpec, ...]
    owner: tuple[int, ...]  # per spec
    buckets: tuple[Bucket, ...]
    load: tuple[int, ...]  # Newton-Schulz cost per rank (ns_cost units)

    @property
    def digest(self) -> str:
        """What must agree across ranks: the specs, the owners and the buckets."""
        text = repr((self.world, self.specs, self.owner, [(b.matrices, b.owners) for b in self.buckets]))
        return hashlib.sha256(text.encode()).hexdigest()

    def rows_of(self, matrix: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` rows of matrix ``matrix`` held by ``rank`` (torch's ``Shard(0)`` chunking)."""
        return chunk_rows(self.specs[matrix].rows, self.world, rank)

    def elements_sent(self, rank: int) -> int:
        """Elements ``rank`` sends per step in both all-to-alls together (its rows of others' matrices,
        then the owned matrices' rows back to their holders)."""
        total = 0
        for i, spec in enumerate(self.specs):
            if self.owner[i] == rank:
                total += (spec.rows - _held(spec.rows, self.world, rank)) * spec.cols
            else:
                total += _held(spec.rows, self.world, rank) * spec.cols
        return total


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """torch ``Shard(0)``: ``ceil(rows / world)`` rows per rank, the last ranks get fewer or none."""
    per = -(-rows // world)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def _held(rows: int, world: int, rank: int) -> int:
    start, end = chunk_rows(rows, world, rank)
    return end - start


def ns_cost(spec: MatrixSpec) -> int:
    """Newton-Schulz work of one step on ``spec`` (per block; summed over blocks)."""
    rows = spec.rows // spec.blocks
    s, long = min(rows, spec.cols), max(rows, spec.cols)
    return spec.blocks * s * s * (2 * long + s)


def _shape(spec: MatrixSpec) -> tuple[int, int, int]:
    return (spec.rows, spec.cols, spec.blocks)


def plan_owners(specs: Sequence[MatrixSpec], world: int, *, per_bucket: int = 1) -> OwnerPlan:
    """Assign each matrix an owner rank and cut the owners' lists into buckets of ``per_bucket`` matrices
    per owner. Largest ``ns_cost`` first; each to the rank owning the fewest matrices of its shape, then
    the least loaded (LPT), then the lower rank: repeated shapes (a transformer's layers) spread evenly,
    which balances both the Newton-Schulz work and the bytes each rank moves."""
    if world < 1:
        raise ValueError(f"plan_owners: expected world >= 1, found world={world}. Fix: pass the process "
                         "group's size.")
    if per_bucket < 1:
        raise ValueError(f"plan_owners: expected per_bucket >= 1, found per_bucket={per_bucket}. Fix: pass a "
                         "positive number of matrices per owner per bucket.")
    specs = tuple(specs)
    for spec in specs:
        if spec.rows < 0 or spec.cols < 0 or spec.blocks < 1 or spec.rows % spec.blocks:
            raise ValueError(f"plan_owners: matrix {spec.name!r} has rows={spec.rows}, cols={spec.cols}, "
                             f"blocks={spec.blocks}; expected non-negative sides and blocks dividing rows. Fix: "
                             "choose a block count that divides the matrix's rows.")
    order = sorted(range(len(specs)), key=lambda i: (-ns_cost(specs[i]), _shape(specs[i]), i))
    load = [0] * world
    owner = [0] * len(specs)
    lists: list[list[int]] = [[] for _ in range(world)]
    copies: dict[tuple[int, int, int], list[int]] = {}  # per shape: how many of its matrices each rank owns
    for i in order:
        have = copies.setdefault(_shape(specs[i]), [0] * world)
        # the ranks with fewest matrices of this shape, then least loaded: each shape spread evenly (so the
        # bytes each rank moves stay ~2/W, not only the work), the remainders to the least loaded ranks
        rank = min(range(world), key=lambda r: (have[r], load[r], len(lists[r]), r))
        owner[i] = rank
        have[rank] += 1
        load[rank] += ns_cost(specs[i])
        lists[rank].append(i)
    buckets = []
    depth = max((len(mine) for mine in lists), default=0)
    for k, start in enumerate(range(0, depth, per_bucket)):
        members = sorted(i for mine in lists for i in mine[start:start + per_bucket])
        buckets.append(Bucket(k, tuple(members), tuple(owner[i] for i in members)))
    return OwnerPlan(world, specs, tuple(owner), tuple(buckets), tuple(load))
