"""FSDP1's ShardingStrategy as fully_shard arguments: the mesh and reshard_after_forward each strategy means.

See design/hsdp-and-partial-reshard.md for the mapping.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.policy import ShardingStrategy
from ..parallel.mesh import default_mesh, replicate_mesh

__all__ = ["strategy_kwargs"]


def strategy_kwargs(strategy: ShardingStrategy, *, mesh: DeviceMesh | None = None) -> dict[str, Any]:
    """The ``fully_shard`` keyword arguments (``mesh``, ``reshard_after_forward``) of a non-root unit
    under an FSDP1/DeepSpeed ``ShardingStrategy``:

    ===============  ===============================  =====================  ==========================
    strategy         mesh                             reshard_after_forward  collectives per unit, step
    ===============  ===============================  =====================  ==========================
    FULL_SHARD       1-D (W,)                         True                   AG fwd + AG bwd + RS
    SHARD_GRAD_OP    1-D (W,)                         False                  AG fwd + RS
    NO_SHARD         2-D (W, 1) replicate x shard     False                  AR (AG/RS over 1 rank)
    HYBRID_SHARD     2-D (R, S) replicate x shard     True                   AG, AG (S) + RS (S) + AR (R)
    _HYBRID_SHARD_   2-D (R, S) replicate x shard     False                  AG (S) + RS (S) + AR (R)
    ZERO2
    ===============  ===============================  =====================  ==========================

    The root unit always keeps its parameters from forward to backward (it runs first in backward);
    ``auto_wrap`` passes ``reshard_after_forward=None`` for it. Raises ``ValueError`` when ``mesh``
    does not fit the strategy.
    """
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"strategy must be a ShardingStrategy, got {strategy!r}. Fix: e.g. "
                        "strategy=ShardingStrategy.FULL_SHARD.")
    name = f"ShardingStrategy.{strategy.name}"
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        if mesh is None or mesh.ndim != 2:
            found = "no mesh" if mesh is None else f"a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
            raise ValueError(
                f"{name} needs a 2-D mesh ('replicate', 'shard'), got {found}. Fix: mesh=init_device_mesh("
                "device, (num_nodes, gpus_per_node), mesh_dim_names=('replicate', 'shard')).")
        _check_covers_world(mesh, name)
        replicas, shards = mesh.size(0), mesh.size(1)
        if replicas == 1 or shards == 1:
            zero2 = strategy is ShardingStrategy._HYBRID_SHARD_ZERO2
            same = ("SHARD_GRAD_OP" if zero2 else "FULL_SHARD") if replicas == 1 else "NO_SHARD"
            raise ValueError(
                f"{name} on a mesh of shape ({replicas}, {shards}) is really {same}: one of its dimensions "
                f"has size 1. Fix: use ShardingStrategy.{same}, or a mesh with more than one replica and "
                "more than one shard, e.g. (num_nodes, gpus_per_node).")
        return {"mesh": mesh, "reshard_after_forward": strategy is ShardingStrategy.HYBRID_SHARD}
    if strategy is ShardingStrategy.NO_SHARD:
        return {"mesh": _replicate_mesh(mesh, name), "reshard_after_forward": False}
    if mesh is None:
        mesh = default_mesh()
    if mesh.ndim != 1:
        raise ValueError(
            f"{name} shards over a 1-D mesh, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Fix: use "
            "ShardingStrategy.HYBRID_SHARD for a ('replicate', 'shard') mesh, or pass a 1-D mesh.")
    _check_covers_world(mesh, name)
    return {"mesh": mesh, "reshard_after_forward": strategy is ShardingStrategy.FULL_SHARD}


def _replicate_mesh(mesh: DeviceMesh | None, name: str) -> DeviceMesh:
    """NO_SHARD: the (W, 1) ('replicate', 'shard') mesh over the ranks of ``mesh`` (default: world).

    A shard group of one rank keeps every parameter whole; the HSDP all-reduce across the W replicas
    is then exactly DDP's gradient all-reduce.
    """
    if mesh is not None and mesh.ndim == 2:
        if mesh.size(1) != 1:
            raise ValueError(
                f"{name} replicates parameters, but the mesh of shape {tuple(mesh.shape)} shards them over "
                f"{mesh.size(1)} ranks. Fix: pass a 1-D mesh (or a (W, 1) mesh), or use "
                "ShardingStrategy.HYBRID_SHARD for this mesh.")
        _check_covers_world(mesh, name)
        return mesh
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(f"{name} expects a 1-D mesh (or a (W, 1) mesh), got shape {tuple(mesh.shape)}.")
    base = mesh if mesh is not None else default_mesh()
    _check_covers_world(base, name)
    return replicate_mesh(base)  # creating a mesh creates process groups: once per rank set


def _check_covers_world(mesh: DeviceMesh, name: str) -> None:
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"{name} runs data parallel over every rank, but the mesh of shape {tuple(mesh.shape)} has "
            f"{mesh.size()} ranks and the world has {world}. Fix: build the mesh over the whole world, "
            f"e.g. init_device_mesh(device, ({world},)), or call fully_shard(mesh=...) directly for a "
            "sub-mesh (e.g. next to tensor parallelism).")
