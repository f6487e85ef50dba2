"""Meshes and placements: which ranks shard and replicate a parameter, and its TP/EP DTensor layout (no hooks)."""

from __future__ import annotations

from .mesh import DataParallelMeshDims, MeshInfo, SubgroupInfo, default_mesh, device_of
from .spmd import ParamSpec, spec_of

__all__ = ["DataParallelMeshDims", "MeshInfo", "ParamSpec", "SubgroupInfo", "default_mesh", "device_of", "spec_of"]
