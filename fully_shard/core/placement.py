"""Per-parameter meshes: what ``shard_placement_fn`` returns, and the groups of one fully_shard call.

See design/experts.md. ``shard_placement_fn(param)`` may return ``None`` (``Shard(0)`` on the call's
mesh), a ``Shard(d)``, this library's ``ShardPlacement(placement, mesh)`` (``Shard(d)`` over another
mesh, e.g. experts over ``efsdp``), or torch 2.13's ``ShardPlacementResult(placement, mesh_info)``
(torchtitan's ``apply_fsdp_to_decoder``; its ``FSDPMeshInfo``/``HSDPMeshInfo`` read by duck typing).
Parameters are then grouped by (shard process group, replicate process group): one ``ParamGroup``, one
all-gather and one reduce-scatter per group. Two different meshes on the same process groups are
refused, as torch refuses two ``FSDPMeshInfo`` objects on one process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from ..parallel.mesh import DataParallelMeshDims, MeshInfo, describe_mesh

__all__ = ["MeshGroups", "ShardPlacement"]


@dataclass(frozen=True)
class ShardPlacement:
    """A parameter's placement and mesh, returned by ``shard_placement_fn`` (per-parameter meshes).

    ``placement``: ``Shard(d)`` (None: ``Shard(0)``). ``mesh``: the 1-D ``(shard,)`` or 2-D
    ``(replicate, shard)`` mesh this parameter is sharded over (None: the mesh passed to fully_shard);
    a parameter that is a DTensor on an expert-parallel mesh ``ep`` ends up on ``mesh`` x ``ep``.
    ``dp_mesh_dims``: ``mesh`` is a full SPMD mesh and these are its data-parallel dims (as fully_shard's)."""

    placement: Shard | None = None
    mesh: DeviceMesh | None = None
    dp_mesh_dims: DataParallelMeshDims | None = None


_GroupKey = tuple[dist.ProcessGroup, dist.ProcessGroup | None]


class MeshGroups:
    """The meshes of one fully_shard call: the call's own (``default``) and those ``shard_placement_fn``
    chose, one ``MeshInfo`` per (shard group, replicate group), in the order parameters first used them."""

    def __init__(self, default: MeshInfo) -> None:
        self.default = default
        self._by_source: dict[object, MeshInfo] = {("default",): default}
        self._keep: list[Any] = []  # torch's mesh-info objects, identified by id(): kept alive
        self._by_group: dict[_GroupKey, tuple[object, str]] = {}  # -> (source, description)
        self.used: list[MeshInfo] = []

    def resolve(self, result: Any, fqn: str) -> tuple[Placement | None, MeshInfo]:
        """The placement and mesh of parameter ``fqn`` from ``shard_placement_fn``'s ``result``."""
        if result is None or isinstance(result, Placement):
            return result, self._use(("default",), self.default, fqn, "the fully_shard mesh")
        if isinstance(result, ShardPlacement):
            if result.mesh is None or (result.mesh == self.default.mesh and result.dp_mesh_dims is None
                                       and self.default.dp_mesh_dims is None):
                return result.placement, self._use(("default",), self.default, fqn, "the fully_shard mesh")
            dims = DataParallelMeshDims.coerce(result.dp_mesh_dims) if result.dp_mesh_dims is not None else None
            source: object = ("mesh", result.mesh, dims)
            info = self._info(source, lambda: MeshInfo.of(result.mesh, dims), fqn)
            return result.placement, self._use(source, info, fqn, f"ShardPlacement(mesh={describe_mesh(result.mesh)})")
        info_obj: Any = getattr(result, "mesh_info", None)
        if not hasattr(result, "placement") or getattr(info_obj, "mesh", None) is None:
            raise TypeError(
                f"shard_placement_fn returned {result!r} for parameter {fqn!r}; expected None, Shard(d), "
                "ShardPlacement(placement, mesh) or torch's ShardPlacementResult(placement, mesh_info). Fix: "
                "return one of those (from fully_shard import ShardPlacement).")
        source = ("torch", id(info_obj))
        if source not in self._by_source:
            self._keep.append(info_obj)
        spmd, dims = getattr(info_obj, "spmd_mesh", None), getattr(info_obj, "dp_mesh_dims", None)
        mesh = spmd if dims is not None and spmd is not None else info_obj.mesh
        info = self._info(source, lambda: MeshInfo.of(mesh, dims), fqn)
        kind = type(info_obj).__name__
        return result.placement, self._use(source, info, fqn, f"{kind}(mesh={describe_mesh(info_obj.mesh)}) "
                                                              f"object at {id(info_obj):#x}")

    def _info(self, source: object, make: Any, fqn: str) -> MeshInfo:
        if source not in self._by_source:
            try:
                self._by_source[source] = make()
            except ValueError as e:
                raise ValueError(f"parameter {fqn!r}: shard_placement_fn chose a mesh fully_shard cannot use: {e}") \
                    from None
        return self._by_source[source]

    def _use(self, source: object, info: MeshInfo, fqn: str, what: str) -> MeshInfo:
        key = (info.shard_group, info.replicate_group)
        seen = self._by_group.get(key)
        if seen is None:
            self._by_group[key] = (source, what)
            self.used.append(info)
        elif seen[0] != source:
            raise ValueError(
                f"parameter {fqn!r}: shard_placement_fn put it on {what}, but an earlier parameter of this "
                f"fully_shard call is on {seen[1]}, another mesh object on the same process groups (torch refuses "
                "this too: one group of parameters per process group, one mesh per group). Fix: return the same "
                "mesh (torch: the same FSDPMeshInfo object) for every parameter on those ranks, e.g. build it "
                "once outside shard_placement_fn; for the fully_shard mesh itself return None or Shard(d).")
        return info
