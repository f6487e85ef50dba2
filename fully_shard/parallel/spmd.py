"""2-D/3-D parameters: how a managed parameter lies on the meshes (FSDP mesh, TP/EP mesh, full SPMD mesh).

See design/2d-params.md. A plain parameter is sharded over the FSDP mesh alone. A parameter that is
already a ``DTensor`` (``parallelize_module`` put it on a TP or EP mesh) is sharded *locally*: its TP
shard is split along ``shard_dim`` over the FSDP mesh, and the sharded parameter is a DTensor on the
combined mesh (FSDP dims first) with torch 2.13's placements::

    Colwise weight   TP (Shard(0),)   ->  (_StridedShard(0, split_factor=tp), Shard(0))
    Rowwise weight   TP (Shard(1),)   ->  (Shard(0), Shard(1))
    Replicate bias   TP (Replicate(),) -> (Shard(0), Replicate())
    HSDP adds a leading Replicate(); a 0-dim parameter is Replicate() on the FSDP dims.

With ``dp_mesh_dims`` the parameter is a DTensor on the full SPMD mesh, ``Replicate()`` on the
data-parallel dims; the FSDP shard dim's placement becomes ``Shard(d)`` (``_StridedShard`` when a later
mesh dim shards ``d`` too) and every other placement is kept. Several shard dims: the sharded
parameter's mesh has one flattened shard axis in their place (torch's); replicate only (DDP-like):
the parameter keeps its mesh and placements, gradients are all-reduced over the replicate dims.

The gathered (unsharded) parameter is the original DTensor again (local tensor: this rank's TP shard),
so the TP layouts of ``parallelize_module`` apply unchanged in forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

# torch's own placement for "FSDP shards a dim that TP already sharded" (the dp chunks are taken of
# each TP shard): only the private class exists; used here and nowhere else.
try:  # private (design/private-torch.md): needed only for TP/EP parameters whose FSDP dim is sharded by TP too
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch moved it
    _StridedShard = None  # type: ignore[assignment,misc]

from .mesh import MeshInfo, concatenate, concatenate_meshes, describe_mesh


@dataclass(frozen=True)
class ParamSpec:
    """One parameter's meshes and placements.

    ``mesh``/``sharded``: the sharded DTensor (and its gradient); ``replicated``: the same for a 0-dim
    parameter. ``unsharded_mesh``/``unsharded``: the gathered DTensor registered for forward (None: a plain
    tensor). ``dp_dims``: dims of ``unsharded_mesh`` that are data parallel (``dp_mesh_dims`` only): a
    gradient keeps its placements there, FSDP's reduce-scatter/all-reduce resolves them."""

    mesh: DeviceMesh
    sharded: tuple[Placement, ...]
    replicated: tuple[Placement, ...]
    unsharded_mesh: DeviceMesh | None = None
    unsharded: tuple[Placement, ...] | None = None
    dp_dims: frozenset[int] = frozenset()

    @property
    def is_dtensor(self) -> bool:
        return self.unsharded_mesh is not None

    def describe(self) -> str:
        """``(_StridedShard(dim=0, sf=2), Shard(dim=0)) on (dp=2, tp=2)`` (the same-call check, repr)."""
        return f"{tuple(self.sharded)} on {describe_mesh(self.mesh)}"


def plain_spec(mesh_info: MeshInfo, shard_dim: int) -> ParamSpec:
    return ParamSpec(mesh_info.mesh, mesh_info.sharded_placements(shard_dim), mesh_info.replicated_placements)


def spec_of(param: torch.Tensor, fqn: str, mesh_info: MeshInfo, shard_dim: int) -> tuple[ParamSpec, torch.Tensor]:
    """The spec of ``param`` and the tensor FSDP shards (the TP-local tensor of a DTensor parameter)."""
    if mesh_info.spmd_mesh is not None:
        if not isinstance(param, DTensor):
            raise ValueError(
                f"parameter {fqn!r} is a plain tensor, but fully_shard was given dp_mesh_dims: every managed "
                f"parameter must then be a DTensor on the full mesh {describe_mesh(mesh_info.spmd_mesh)}, "
                "Replicate() "
                "on the data-parallel dims. Fix: distribute it first (distribute_module / parallelize_module on "
                "the full mesh), or drop dp_mesh_dims and pass mesh=<the data-parallel sub-mesh>.")
        return _spmd_spec(param, fqn, mesh_info, shard_dim), param._local_tensor
    if not isinstance(param, DTensor):
        return plain_spec(mesh_info, shard_dim), param
    if param.device_mesh == mesh_info.mesh:  # already on the FSDP mesh (e.g. a re-wrapped shard): gather
        return plain_spec(mesh_info, shard_dim), param
    return _tp_spec(param, fqn, mesh_info, shard_dim), param._local_tensor


def _tp_spec(param: DTensor, fqn: str, mesh_info: MeshInfo, shard_dim: int) -> ParamSpec:
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    _check_no_partial(tp_placements, fqn, tp_mesh)
    if tp_mesh.device_type != mesh_info.mesh.device_type:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on a {tp_mesh.device_type!r} mesh but the FSDP mesh is on "
            f"{mesh_info.mesh.device_type!r}. Fix: build both from one init_device_mesh(...) call.")
    combined = concatenate_meshes(mesh_info.mesh, tp_mesh, fqn)
    fsdp = _fsdp_placement(shard_dim, param.dim(), [(tp_mesh.size(d), tp_placements[d]) for d in range(tp_mesh.ndim)])
    lead = (Replicate(),) if mesh_info.mesh.ndim == 2 else ()  # HSDP: replicated over the replica dim
    return ParamSpec(combined, (*lead, fsdp, *tp_placements), (*lead, Replicate(), *tp_placements),
                     tp_mesh, tp_placements)


def _spmd_spec(param: DTensor, fqn: str, mesh_info: MeshInfo, shard_dim: int) -> ParamSpec:
    full, placements = param.device_mesh, tuple(param.placements)
    assert mesh_info.spmd_mesh is not None and mesh_info.dp_mesh_dims is not None
    if full != mesh_info.spmd_mesh:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on {describe_mesh(full)}, not on the mesh passed to fully_shard with "
            f"dp_mesh_dims ({describe_mesh(mesh_info.spmd_mesh)}). Fix: distribute every parameter on that one "
            "full mesh, or pass it in ignored_params.")
    _check_no_partial(placements, fqn, full)
    names = full.mesh_dim_names or ()
    dims = mesh_info.dp_mesh_dims
    dp_index = {n: names.index(n) for n in (*dims.shard_names, *dims.replicate_names)}
    for name, idx in dp_index.items():
        if not placements[idx].is_replicate():
            raise ValueError(
                f"parameter {fqn!r} has placement {placements[idx]} on data-parallel mesh dim {name!r} (placements "
                f"{placements} on {describe_mesh(full)}); with dp_mesh_dims FSDP expects Replicate() there and "
                "does "
                f"the sharding itself. Fix: distribute it with Replicate() on {name!r}.")
    new = list(placements)
    for name in dims.shard_names:
        idx = dp_index[name]
        later = [(full.size(j), placements[j]) for j in range(idx + 1, full.ndim)]
        new[idx] = _fsdp_placement(shard_dim, param.dim(), later)
    dp_dims = frozenset(dp_index.values())
    if len(dims.shard_names) <= 1:  # the sharded parameter stays on the full mesh (DDP-like: placements kept)
        return ParamSpec(full, tuple(new), placements, full, placements, dp_dims)
    mesh, sharded, replicated = _flattened_spec(full, mesh_info, tuple(new), placements)
    return ParamSpec(mesh, sharded, replicated, full, placements, dp_dims)


def _flattened_spec(full: DeviceMesh, mesh_info: MeshInfo, new: tuple[Placement, ...],
                    placements: tuple[Placement, ...]) -> tuple[DeviceMesh, tuple[Placement, ...],
                                                              tuple[Placement, ...]]:
    """Several shard dims (adjacent, checked in mesh.py): the sharded parameter has one shard axis, the
    flattened FSDP mesh, where those dims were (HSDP: the (replicate, shard) FSDP mesh there, the
    replicate dims dropped from their places), as torch 2.13's; the other dims keep their placements."""
    dims = mesh_info.dp_mesh_dims
    assert dims is not None
    names = full.mesh_dim_names or ()
    hsdp = mesh_info.replicate_group is not None
    first = names.index(dims.shard_names[0])
    meshes: list[DeviceMesh] = []
    sharded: list[Placement] = []
    replicated: list[Placement] = []
    for i, name in enumerate(names):
        if (name in dims.shard_names and i != first) or name in dims.replicate_names:
            continue
        if i == first:
            meshes.append(mesh_info.mesh)
            lead = [Replicate()] if hsdp else []
            sharded += [*lead, new[i]]
            replicated += [*lead, Replicate()]
        else:
            meshes.append(full[name])
            sharded.append(new[i])
            replicated.append(placements[i])
    return concatenate(meshes), tuple(sharded), tuple(replicated)


def _fsdp_placement(shard_dim: int, ndim: int, later: list[tuple[int, Placement]]) -> Placement:
    """FSDP's placement on its shard axis: ``Shard(d)``, or ``_StridedShard(d, split_factor=n)`` when the
    mesh dims after it (``later``: their sizes and placements) also shard tensor dim ``d``, ``n`` the
    product of their sizes (the dp chunks are taken of each of their shards)."""
    split = 1
    for size, p in later:
        if _shard_dim_of(p) == shard_dim and ndim > 0:
            split *= size
    if split == 1:
        return Shard(shard_dim)
    if _StridedShard is None:
        raise NotImplementedError(
            f"this parameter's FSDP dim {shard_dim} is also sharded by tensor parallel, which needs torch's "
            "private _StridedShard placement; this torch has none at torch.distributed.tensor.placement_types. "
            "Fix: use the torch this library was tested with (docs/torch.md), or shard the parameter on another dim "
            "with shard_placement_fn.")
    return _StridedShard(shard_dim, split_factor=split)


def _shard_dim_of(p: Placement) -> int | None:
    if isinstance(p, Shard) or (_StridedShard is not None and isinstance(p, _StridedShard)):
        return int(p.dim)
    return None


def _check_no_partial(placements: tuple[Placement, ...], fqn: str, mesh: DeviceMesh) -> None:
    if any(p.is_partial() for p in placements):
        raise ValueError(
            f"parameter {fqn!r} is a DTensor with placements {placements} on {describe_mesh(mesh)}: a Partial() "
            "parameter holds pending sums, not values, so it cannot be sharded or all-gathered. Fix: "
            "redistribute it to Replicate() (or Shard(d)) before fully_shard, e.g. "
            "param.redistribute(placements=[Replicate()]), or pass it in ignored_params.")


def local_grad(grad: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    """The tensor FSDP reduces for a gradient of the unsharded parameter: a plain gradient as is; a
    DTensor gradient redistributed to the parameter's placements (e.g. a ``Partial`` gradient of a
    ``Replicate`` bias all-reduced over TP) except on data-parallel dims, then its local tensor."""
    if not isinstance(grad, DTensor):
        return grad
    assert spec.unsharded is not None
    target = tuple(g if i in spec.dp_dims else p for i, (g, p) in enumerate(zip(grad.placements, spec.unsharded)))
    if target != tuple(grad.placements):
        grad = grad.redistribute(placements=target)
    return grad.to_local()
