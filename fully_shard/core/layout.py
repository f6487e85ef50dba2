"""Pure dim-0 sharding arithmetic: rows per rank, padding and offsets (no torch.distributed).

See design/sharding-layout.md. A tensor of global shape ``(R, *inner)`` sharded over ``W`` ranks
follows ``torch.chunk``: every rank owns ``chunk = ceil(R / W)`` rows except the last ranks, which
own fewer or none. Collectives need equal sizes on every rank, so each rank's shard is padded to
``chunk`` rows in the flat communication buffers; the padding never reaches the user.

0-dim tensors cannot be split along dim 0. They are *replicated*: every rank holds the value, and
in the flat buffers they occupy ``numel = 1`` slot on every rank (see design/sharding-layout.md).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass


def contiguous_stride(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (0-size dims count as 1, as torch's)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class DimZeroLayout:
    """Where one tensor's rows live when it is sharded along dim 0 over ``world`` ranks.

    Frozen, so the derived sizes are cached properties (they are read on every unshard and reduce)."""

    shape: tuple[int, ...]
    world: int

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        if any(s < 0 for s in self.shape):
            raise ValueError(f"shape must be non-negative, got {self.shape}")

    @functools.cached_property
    def replicated(self) -> bool:
        """0-dim tensors are replicated on every rank instead of sharded."""
        return len(self.shape) == 0

    @functools.cached_property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @functools.cached_property
    def row_numel(self) -> int:
        """Elements in one dim-0 row (product of the inner dims)."""
        return math.prod(self.shape[1:]) if self.shape else 1

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def chunk_rows(self) -> int:
        """Rows every rank reserves in the padded layout: ceil(rows / world) (torch.chunk)."""
        if self.replicated:
            return 1
        return -(-self.rows // self.world) if self.rows else 0

    def row_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the global rows owned by ``rank``; empty ranges are (R, R)."""
        self._check_rank(rank)
        if self.replicated:
            return (0, 1)
        start = min(rank * self.chunk_rows, self.rows)
        end = min(start + self.chunk_rows, self.rows)
        return (start, end)

    def local_rows(self, rank: int) -> int:
        start, end = self.row_range(rank)
        return end - start

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s unpadded shard (1 for a replicated tensor)."""
        return 1 if self.replicated else self.local_rows(rank) * self.row_numel

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s unpadded shard (what DTensor.to_local() returns)."""
        if self.replicated:
            return ()
        return (self.local_rows(rank), *self.shape[1:])

    @functools.cached_property
    def padded_shard_numel(self) -> int:
        """Elements every rank contributes to a flat collective buffer (local shard + padding)."""
        return self.chunk_rows * self.row_numel

    @functools.cached_property
    def padded_numel(self) -> int:
        """Elements of the padded unsharded tensor: world * padded_shard_numel (1 if replicated)."""
        return 1 if self.replicated else self.world * self.padded_shard_numel

    def padding_numel(self, rank: int) -> int:
        return self.padded_shard_numel - self.local_numel(rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank}")


@dataclass(frozen=True)
class FlatLayout:
    """Concatenation of several tensors' padded shards into one per-rank flat buffer.

    ``offsets[i]`` is where tensor ``i``'s padded shard starts inside one rank's segment of
    ``shard_numel`` elements. The all-gather output is ``world`` such segments back to back.
    """

    tensors: tuple[DimZeroLayout, ...]

    def __post_init__(self) -> None:
        worlds = {t.world for t in self.tensors}
        if len(worlds) > 1:
            raise ValueError(f"all tensors of one flat layout need one world size, got {sorted(worlds)}")

    @property
    def world(self) -> int:
        return self.tensors[0].world if self.tensors else 1

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(t.padded_shard_numel for t in self.tensors)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for size in self.sizes:
            out.append(acc)
            acc += size
        return tuple(out)

    @functools.cached_property
    def shard_numel(self) -> int:
        """Elements of one rank's segment (the input of all-gather, the output of reduce-scatter)."""
        return sum(self.sizes)

    @functools.cached_property
    def total_numel(self) -> int:
        """Elements of the gathered buffer (world segments)."""
        return self.world * self.shard_numel


@dataclass(frozen=True)
class ByteLayout:
    """A ``FlatLayout`` whose tensors are gathered at different dtypes (``param_dtype_override_fn``: e.g. bf16
    weights and fp32 norms in one unit), counted in bytes: one ``uint8`` all-gather moves every tensor's padded
    shard at its own dtype, as torch 2.15's does. The same attributes as ``FlatLayout``, in bytes."""

    flat: FlatLayout
    itemsizes: tuple[int, ...]  # per tensor: the byte width of the dtype it is gathered at

    def __post_init__(self) -> None:
        if len(self.itemsizes) != len(self.flat.tensors):
            raise ValueError(f"one itemsize per tensor: {len(self.itemsizes)} for {len(self.flat.tensors)} tensors")

    @property
    def world(self) -> int:
        return self.flat.world

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """Bytes of each tensor's padded shard in one rank's segment."""
        return tuple(size * width for size, width in zip(self.flat.sizes, self.itemsizes))

    @functools.cached_property
    def shard_numel(self) -> int:
        """Bytes of one rank's segment."""
        return sum(self.sizes)

    @functools.cached_property
    def total_numel(self) -> int:
        """Bytes of the gathered buffer (world segments)."""
        return self.world * self.shard_numel
