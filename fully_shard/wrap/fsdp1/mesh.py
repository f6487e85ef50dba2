"""FSDP1's process_group / device_mesh / device_id / sharding_strategy as one unit's mesh and reshard_after_forward.

FSDP1 takes its data-parallel ranks as a process group (a pair ``(intra_node, inter_node)`` for the hybrid
strategies) or a device mesh; this library shards over a ``DeviceMesh``. ``Placement`` is resolved once
by the outermost ``FullyShardedDataParallel`` and handed to the units its ``auto_wrap_policy`` creates,
so every unit shares one mesh (creating a 2-D mesh creates process groups). See design/fsdp1.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ...comm.collectives import all_gather_object
from ...core.policy import ShardingStrategy
from ...parallel.mesh import default_device_type, mesh_once
from ..strategy import strategy_kwargs

__all__ = ["Placement", "check_group", "compute_device_type", "resolve_placement"]

_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


@dataclass(frozen=True)
class Placement:
    """Where one FSDP1 unit's parameters live: the mesh and the strategy's reshard_after_forward (for
    the root unit the core keeps the parameters from forward to backward, as FSDP1's root does)."""

    strategy: ShardingStrategy  # what the user asked for
    mesh: DeviceMesh
    reshard_after_forward: bool
    process_group: Any  # FSDP1's ``process_group`` attribute: the shard group
    inter_node_group: Any  # the replica group (hybrid strategies), else None


def compute_device_type(device_id: int | torch.device | None) -> str:
    """The device type units compute on: ``device_id``'s, else the default process group's (``cuda``
    for NCCL, ``cpu`` for gloo), as ``fully_shard`` picks it."""
    if device_id is None:
        return default_device_type()
    device = device_id if isinstance(device_id, torch.device) else torch.device(device_id)
    return device.type


def resolve_placement(strategy: ShardingStrategy, *, process_group: Any, device_mesh: DeviceMesh | None,
                      device_type: str) -> Placement:
    """The mesh for ``strategy``: ``device_mesh`` if given, else one built over ``process_group`` (a
    pair ``(intra, inter)`` for the hybrid strategies), else over the default process group (hybrid:
    shards of the ranks on one node, ``LOCAL_WORLD_SIZE`` or the accelerator count)."""
    if device_mesh is not None and process_group is not None:
        raise ValueError("FullyShardedDataParallel: pass either process_group or device_mesh, not both. Fix: "
                         "drop process_group (device_mesh names the same ranks).")
    hybrid = strategy in _HYBRID
    if device_mesh is not None:
        mesh = device_mesh
    elif process_group is not None:
        mesh = _mesh_of_groups(process_group, hybrid, device_type)
    elif hybrid:
        mesh = _default_hybrid_mesh(device_type)
    else:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    if hybrid and mesh.ndim == 2 and mesh.size(0) == 1:
        # one replica: what FSDP1 runs is the same math as the 1-D strategy over the shard ranks
        flat = DeviceMesh.from_group(mesh.get_group(1), mesh.device_type)
        zero3 = strategy is ShardingStrategy.HYBRID_SHARD
        kwargs = strategy_kwargs(ShardingStrategy.FULL_SHARD if zero3 else ShardingStrategy.SHARD_GRAD_OP, mesh=flat)
    elif hybrid and mesh.ndim == 2 and mesh.size(1) == 1:  # one rank per replica: DDP
        kwargs = strategy_kwargs(ShardingStrategy.NO_SHARD, mesh=mesh)
    elif process_group is not None and not hybrid and mesh.size() != dist.get_world_size():
        if strategy is ShardingStrategy.NO_SHARD:
            raise NotImplementedError("FullyShardedDataParallel(sharding_strategy=NO_SHARD) over a process group "
                                      "that is not the whole world is not supported. Fix: pass a device_mesh of "
                                      "shape (n, 1) over those ranks with HYBRID_SHARD, or use the default group.")
        kwargs = {"mesh": mesh, "reshard_after_forward": strategy is ShardingStrategy.FULL_SHARD}  # a sub-group
    else:
        kwargs = strategy_kwargs(strategy, mesh=mesh)
    out_mesh: DeviceMesh = kwargs["mesh"]
    if out_mesh.device_type != device_type:
        raise ValueError(f"FullyShardedDataParallel: the mesh is on {out_mesh.device_type!r} but the module computes "
                         f"on {device_type!r} (device_id or the process group's backend). Fix: build the mesh on "
                         f"{device_type!r} or pass a matching device_id.")
    if out_mesh.ndim == 2 and out_mesh.size(1) == 1:  # NO_SHARD's (W, 1): FSDP1's group is the W ranks
        shard_group, inter = out_mesh.get_group(0), None
    else:
        shard_group = out_mesh.get_group(out_mesh.ndim - 1)
        inter = out_mesh.get_group(0) if out_mesh.ndim == 2 else None
    return Placement(strategy, out_mesh, bool(kwargs["reshard_after_forward"]), shard_group, inter)


def check_group(group: Any, what: str) -> None:
    """``group`` is a c10d process group of this job: the units issue real collectives over it."""
    try:
        ok = isinstance(group, dist.ProcessGroup) and bool(dist.get_process_group_ranks(group))
    except (ValueError, RuntimeError, KeyError):
        ok = False
    if not ok:
        raise ValueError(
            f"FullyShardedDataParallel: {what} must be a torch.distributed.ProcessGroup of this job (the world's "
            f"default group, or one from dist.new_group), got {type(group).__name__} {group!r}. Per-parameter "
            "sharding runs real collectives over it, so an object that only records a rank and a size (torch's "
            "FSDP1 tests' DummyProcessGroup) cannot stand in for one. Fix: pass dist.new_group(ranks), or "
            "process_group=None for the whole world.")


def _mesh_of_groups(process_group: Any, hybrid: bool, device_type: str) -> DeviceMesh:
    if not hybrid:
        if isinstance(process_group, tuple):
            raise ValueError("FullyShardedDataParallel: a (intra_node, inter_node) process_group pair is for "
                             "HYBRID_SHARD/_HYBRID_SHARD_ZERO2. Fix: pass one ProcessGroup for this strategy.")
        return DeviceMesh.from_group(process_group, device_type)  # (checked by the class: check_group)
    if not (isinstance(process_group, tuple) and len(process_group) == 2):
        raise ValueError("FullyShardedDataParallel: a hybrid sharding strategy takes process_group=(intra_node_group, "
                         f"inter_node_group), got {process_group!r}. Fix: pass the pair, or "
                         "device_mesh=init_device_mesh(device, (num_nodes, ranks_per_node)).")
    intra, inter = process_group
    check_group(intra, "process_group[0] (the intra-node shard group)")
    check_group(inter, "process_group[1] (the inter-node replicate group)")

    def make() -> DeviceMesh:
        world = dist.group.WORLD
        assert world is not None  # (the default group exists: the pair was made from it)
        rows = all_gather_object(dist.get_process_group_ranks(intra), world)  # every rank's shard group: the rows
        by_rank = {rank: tuple(row) for row in rows for rank in row}
        grid = torch.tensor([by_rank[r] for r in dist.get_process_group_ranks(inter)], dtype=torch.int)
        return DeviceMesh.from_group([inter, intra], device_type, mesh=grid, mesh_dim_names=("replicate", "shard"))
    # once per pair (the groups themselves are the key): nested wrappers get the same pair, one exchange
    return mesh_once(("fsdp1 hybrid pair", intra, inter, device_type), make)


def _default_hybrid_mesh(device_type: str) -> DeviceMesh:
    """FSDP1's default hybrid layout: shard over the ranks of one node, replicate across nodes."""
    world = dist.get_world_size()
    acc = torch.accelerator.current_accelerator() if device_type != "cpu" else None
    per_node = torch.accelerator.device_count() if acc is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if per_node < 1 or world % per_node:
        raise ValueError(f"FullyShardedDataParallel(HYBRID_SHARD): {world} ranks do not split into nodes of "
                         f"{per_node} ranks. Fix: pass device_mesh=init_device_mesh(device, (num_nodes, "
                         "ranks_per_node), mesh_dim_names=('replicate', 'shard')).")
    return mesh_once(("fsdp1 hybrid default", device_type, world, per_node),
                     lambda: init_device_mesh(device_type, (world // per_node, per_node),
                                              mesh_dim_names=("replicate", "shard")))
