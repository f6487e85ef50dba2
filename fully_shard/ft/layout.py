"""ShardLayout: what one rank holds of the model, to check that a peer's recovery state fits it.

A replica group heals from a live peer rank by rank (rank ``r`` of the joiner receives what rank ``r`` of
its source holds), so the received local shards fit only if both groups shard every parameter the same
way. The layout is the list, in a fixed order, of each transferred tensor's name, dtype, global shape,
placements, mesh shape, this rank's mesh coordinate and local shape, plus the group's rank and size. It is
plain tuples and strings on the wire (any checkpoint transport can carry it) and compared as a whole;
``differences`` words what differs for ``ShardLayoutError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ShardLayout", "ShardLayoutError", "TensorLayout", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


class ShardLayoutError(RuntimeError):
    """A replica group cannot heal from its peer: the peer's local shards are laid out differently."""


@dataclass(frozen=True)
class TensorLayout:
    """One transferred tensor as this rank holds it (a DTensor parameter's local shard, or a buffer)."""

    name: str  # "param:<fqn>" or "buffer:<fqn>"
    dtype: str
    shape: tuple[int, ...]  # global
    placements: str  # "(Shard(dim=0),)"; "local" for a plain tensor
    mesh: tuple[int, ...]  # the DTensor's mesh shape; () for a plain tensor
    coordinate: tuple[int, ...]  # this rank on that mesh; () for a plain tensor
    local_shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorLayout:
        if isinstance(tensor, DTensor):
            coordinate = tensor.device_mesh.get_coordinate()
            return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape), str(tuple(tensor.placements)),
                       tuple(tensor.device_mesh.shape), tuple(coordinate or ()), tuple(tensor.to_local().shape))
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape), "local", (), (), tuple(tensor.shape))

    def describe(self) -> str:
        if self.placements == "local":
            return f"{self.dtype}{list(self.shape)} (not sharded)"
        return (f"{self.dtype}{list(self.shape)} {self.placements} on mesh {list(self.mesh)} "
                f"at {list(self.coordinate)}: local {list(self.local_shape)}")


@dataclass(frozen=True)
class ShardLayout:
    """This rank's layout: its rank and size in the replica group and every transferred tensor, in order."""

    group_rank: int
    group_world_size: int
    tensors: tuple[TensorLayout, ...]

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]], *, group_rank: int, group_world_size: int) -> ShardLayout:
        return cls(group_rank, group_world_size, tuple(TensorLayout.of(name, t) for name, t in named))

    def to_wire(self) -> tuple[object, ...]:
        """Plain tuples and strings (no class of this library on the wire)."""
        return (self.group_rank, self.group_world_size, tuple(astuple(t) for t in self.tensors))

    @classmethod
    def from_wire(cls, wire: Any) -> ShardLayout:
        """The layout a peer sent; ``ValueError`` if ``wire`` is not one."""
        try:
            group_rank, group_world_size, tensors = wire
            return cls(int(group_rank), int(group_world_size),
                       tuple(TensorLayout(str(n), str(d), tuple(s), str(p), tuple(m), tuple(c), tuple(ls))
                             for n, d, s, p, m, c, ls in tensors))
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a shard layout: {type(wire).__name__} ({e})") from None

    def differences(self, found: ShardLayout, limit: int = 5) -> list[str]:
        """What differs between this (expected) layout and ``found``, one line each, at most ``limit``
        tensor lines plus a count of the rest."""
        lines = []
        if (self.group_rank, self.group_world_size) != (found.group_rank, found.group_world_size):
            lines.append(f"replica group rank/size: expected {self.group_rank}/{self.group_world_size}, "
                         f"received {found.group_rank}/{found.group_world_size}")
        ours = {t.name: t for t in self.tensors}
        theirs = {t.name: t for t in found.tensors}
        tensor_lines = [f"{name}: missing in the received state (expected {t.describe()})"
                        for name, t in ours.items() if name not in theirs]
        tensor_lines += [f"{name}: not in this model (received {t.describe()})"
                         for name, t in theirs.items() if name not in ours]
        tensor_lines += [f"{name}: expected {t.describe()}, received {theirs[name].describe()}"
                         for name, t in ours.items() if name in theirs and theirs[name] != t]
        if not tensor_lines and [t.name for t in self.tensors] != [t.name for t in found.tensors]:
            tensor_lines.append("the same tensors in another order (another model definition)")
        lines += tensor_lines[:limit]
        if len(tensor_lines) > limit:
            lines.append(f"... and {len(tensor_lines) - limit} more tensors differ")
        return lines
