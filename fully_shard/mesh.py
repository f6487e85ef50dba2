"""Mesh handling: which ranks a unit shards and replicates over, its k-rank subgroups, and its device.

See design/hsdp-and-partial-reshard.md. ``MeshInfo`` is what every unit reads of its mesh (a 1-D
``(shard,)`` or 2-D ``(replicate, shard)`` ``DeviceMesh``). The two caches below create process groups
(``dist.new_group`` and ``DeviceMesh`` construction are collectives), so each is filled once per rank
set. They are keyed by the world process group and this rank as well: several ranks living in one
process (a threaded process group) each get their own groups instead of sharing one by accident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

_ACCELERATOR_BACKENDS = ("nccl", "xccl", "hccl")


def device_of(where: DeviceMesh | str) -> torch.device:
    """The device this rank computes on for a mesh (or a device type): the current device of that
    type, e.g. ``cuda:3``; the CPU for ``"cpu"``."""
    device_type = where if isinstance(where, str) else where.device_type
    if device_type == "cpu":
        return torch.device("cpu")
    module: Any = getattr(torch, device_type)
    return torch.device(device_type, module.current_device())


def default_device_type() -> str:
    """The device type the default process group's backend communicates on: the accelerator's for
    NCCL-like backends (``"cuda"`` if none is visible), ``"cpu"`` otherwise (gloo)."""
    backend = str(dist.get_backend()).lower()
    if not any(name in backend for name in _ACCELERATOR_BACKENDS):
        return "cpu"
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else "cuda"


def default_device() -> torch.device:
    """Where a tensor must live to go through a collective on the default process group."""
    return device_of(default_device_type())


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group on the default device (like torch's)."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed: call dist.init_process_group(...) first "
                           "(torchrun sets the environment), or pass mesh=init_device_mesh(...).")
    return init_device_mesh(default_device_type(), (dist.get_world_size(),))


@dataclass(frozen=True)
class SubgroupInfo:
    """The ranks one all-gather runs over: a unit's whole shard group, or the k-rank subgroup a
    partially resharded unit gathers in (reshard_after_forward=k)."""

    group: dist.ProcessGroup
    rank: int
    world: int


@dataclass(frozen=True)
class MeshInfo:
    """The mesh a group shards over: a 1-D ``(shard,)`` or HSDP 2-D ``(replicate, shard)`` mesh."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_world: int
    replicate_group: dist.ProcessGroup | None = None
    replicate_world: int = 1

    @classmethod
    def of(cls, mesh: DeviceMesh) -> MeshInfo:
        """Check that ``mesh`` is one fully_shard supports and read its groups."""
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"fully_shard supports a 1-D mesh (FSDP) or a 2-D mesh ('replicate', 'shard') (HSDP); got a "
                f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Fix: pass the FSDP sub-mesh, e.g. "
                "mesh['dp'] or mesh['dp_replicate', 'dp_shard'].")
        world = dist.get_world_size()
        if mesh.size() > world:
            raise ValueError(f"mesh of shape {tuple(mesh.shape)} has {mesh.size()} ranks but the world has "
                             f"{world}. Fix: build the mesh from the launched world, e.g. "
                             f"init_device_mesh(device, ({world},)).")
        if mesh.ndim == 1:
            return cls(mesh, mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0))
        return cls(mesh, mesh.get_group(1), mesh.get_local_rank(1), mesh.size(1),
                   replicate_group=mesh.get_group(0), replicate_world=mesh.size(0))

    def sharded_placements(self, dim: int = 0) -> tuple[Placement, ...]:
        return (Replicate(), Shard(dim)) if self.mesh.ndim == 2 else (Shard(dim),)

    @property
    def replicated_placements(self) -> tuple[Placement, ...]:
        return (Replicate(),) * self.mesh.ndim

    @property
    def device(self) -> torch.device:
        return device_of(self.mesh)

    @property
    def shard_subgroup(self) -> SubgroupInfo:
        """The whole shard group, as the ranks a full all-gather runs over."""
        return SubgroupInfo(self.shard_group, self.shard_rank, self.shard_world)


# --- the two process-group caches ----------------------------------------------------------------
_Grid = tuple[tuple[int, ...], ...]
_SUBGROUPS: dict[tuple[object, int, _Grid, int], dist.ProcessGroup | None] = {}
_REPLICATE_MESHES: dict[tuple[object, int, str, tuple[int, ...]], DeviceMesh] = {}


def _world_key() -> tuple[object, int]:
    """This rank in its world: the default process group object and the global rank."""
    return dist.group.WORLD, dist.get_rank()


def subgroup(mesh: DeviceMesh, info: MeshInfo,
             reshard_after_forward: bool | int | None) -> SubgroupInfo | None:
    """Create (collectively, once per mesh and k) the k-rank subgroups of every shard group; return
    this rank's, or None when ``reshard_after_forward`` needs none."""
    k = reshard_after_forward
    if k is None or isinstance(k, bool) or k in (1, info.shard_world):
        return None
    grid = mesh.mesh.reshape(-1, info.shard_world).tolist()
    key = (*_world_key(), tuple(tuple(row) for row in grid), k)
    me = dist.get_rank()
    if key not in _SUBGROUPS:
        mine = None
        for row in grid:
            for start in range(0, len(row), k):
                ranks = row[start:start + k]
                pg = dist.new_group(ranks)
                if me in ranks:
                    mine = pg
        _SUBGROUPS[key] = mine
    pg = _SUBGROUPS[key]
    assert pg is not None
    return SubgroupInfo(pg, dist.get_rank(pg), k)


def replicate_mesh(base: DeviceMesh) -> DeviceMesh:
    """The (W, 1) ('replicate', 'shard') mesh over the ranks of ``base`` (created once per rank set)."""
    ranks = tuple(int(r) for r in base.mesh.reshape(-1).tolist())
    key = (*_world_key(), base.device_type, ranks)
    if key not in _REPLICATE_MESHES:
        _REPLICATE_MESHES[key] = DeviceMesh(base.device_type, base.mesh.reshape(-1, 1),
                                            mesh_dim_names=("replicate", "shard"))
    return _REPLICATE_MESHES[key]
