"""Mesh handling: which ranks a unit shards and replicates over, its k-rank subgroups, and its device.

See design/hsdp-and-partial-reshard.md. ``MeshInfo`` is what every unit reads of its mesh (a 1-D
``(shard,)`` or 2-D ``(replicate, shard)`` ``DeviceMesh``). The process groups and meshes made here
(``dist.new_group`` and ``DeviceMesh`` construction are collectives) are made once per rank set and kept
in ``_Made``, one per world process group and rank: several ranks living in one process (a threaded
process group) each get their own groups instead of sharing one by accident.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
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
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data parallel (torch 2.13's ``DataParallelMeshDims``).

    Passed as ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))``: the
    parameters are DTensors on ``full_mesh`` with ``Replicate()`` on these dims; FSDP shards over
    ``shard`` and (HSDP) all-reduces gradients over ``replicate``. torch's own object is accepted too.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims(shard=None, replicate=None): at least one of shard or "
                             "replicate must name a mesh dim. Fix: DataParallelMeshDims(shard='dp').")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)

    @classmethod
    def coerce(cls, dims: Any) -> DataParallelMeshDims:
        """Ours, or anything with ``shard``/``replicate`` attributes (torch's dataclass)."""
        if isinstance(dims, cls):
            return dims
        if not (hasattr(dims, "shard") and hasattr(dims, "replicate")):
            raise TypeError(f"dp_mesh_dims must be a DataParallelMeshDims(shard=..., replicate=...), got "
                            f"{dims!r}. Fix: from fully_shard import DataParallelMeshDims.")
        return cls(shard=dims.shard, replicate=dims.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _check_world(mesh: DeviceMesh) -> None:
    world = dist.get_world_size()
    if mesh.size() > world:
        raise ValueError(f"mesh of shape {tuple(mesh.shape)} has {mesh.size()} ranks but the world has "
                         f"{world}. Fix: build the mesh from the launched world, e.g. "
                         f"init_device_mesh(device, ({world},)).")


def _check_dp_names(mesh: DeviceMesh, dims: DataParallelMeshDims) -> None:
    """The combinations torch 2.13 accepts (it refuses the others with a KeyError/RuntimeError from
    DeviceMesh slicing or concatenation): existing dim names, each used once, each tuple in mesh order,
    several shard names adjacent in the mesh."""
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"dp_mesh_dims={dims} names mesh dims, but the mesh of shape {tuple(mesh.shape)} has "
                         "no mesh_dim_names. Fix: init_device_mesh(..., mesh_dim_names=('dp', 'tp')).")
    used = (*dims.shard_names, *dims.replicate_names)
    for name in used:
        if name not in names:
            raise ValueError(f"dp_mesh_dims={dims} names mesh dim {name!r}, but the mesh's dims are {names}. "
                             "Fix: name existing dims of the mesh passed to fully_shard.")
    twice = sorted({n for n in used if used.count(n) > 1})
    if twice:
        raise ValueError(f"dp_mesh_dims={dims} names mesh dim(s) {twice} more than once (a dim is either sharded "
                         "or replicated over, once). Fix: name each data-parallel dim once, e.g. "
                         "DataParallelMeshDims(shard='dp_shard', replicate='dp_replicate').")
    for field, group in (("shard", dims.shard_names), ("replicate", dims.replicate_names)):
        index = [names.index(n) for n in group]
        if index != sorted(index):
            raise ValueError(f"dp_mesh_dims={dims}: the {field} dims {group} are not in the mesh's order {names} "
                             f"(torch refuses this too). Fix: {field}={tuple(sorted(group, key=names.index))}.")
        if field == "shard" and index and index[-1] - index[0] != len(index) - 1:
            raise ValueError(f"dp_mesh_dims={dims}: the shard dims {group} are not adjacent in the mesh {names}, so "
                             "they cannot be flattened into one shard axis of the sharded parameter (torch refuses "
                             "this too). Fix: order the mesh so the shard dims are next to each other, e.g. "
                             "mesh_dim_names=('dp_replicate', 'dp_shard', 'cp', 'tp').")


def flatten_dims(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh over the dims ``names`` of ``mesh`` (one of them: that dim; several: flattened, named
    ``"_".join(names)`` as torch's fully_shard names it, so both libraries share one mesh and group).

    ``DeviceMesh._flatten`` is torch's only way to merge mesh dims into one (its process group is created
    once and cached on the root mesh by name); this is its one use."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


_Grid = tuple[tuple[int, ...], ...]


@dataclass(eq=False)
class _Made:
    """The process groups and meshes this rank made in its world, each made once and then shared by every
    fully_shard call (so a model's parameters share one mesh object, and no group is made twice)."""

    singleton: dist.ProcessGroup | None = None  # this rank alone (singleton_group)
    # k-rank subgroups by (the shard groups' grid, k): this rank's, None where it is in none (subgroup)
    subgroups: dict[tuple[_Grid, int], dist.ProcessGroup | None] = dataclasses.field(default_factory=dict)
    # (W, 1) meshes by (device type, ranks) (replicate_mesh)
    replicate_meshes: dict[tuple[str, tuple[int, ...]], DeviceMesh] = dataclasses.field(default_factory=dict)
    # dp x tp meshes by (dp, tp) (concatenate_meshes); joined slices by the list (concatenate)
    combined: dict[tuple[DeviceMesh, DeviceMesh], DeviceMesh] = dataclasses.field(default_factory=dict)
    concatenated: dict[tuple[DeviceMesh, ...], DeviceMesh] = dataclasses.field(default_factory=dict)
    # other meshes made once by a caller's key (mesh_once: the FSDP1 front end's hybrid meshes)
    meshes: dict[tuple[Any, ...], DeviceMesh] = dataclasses.field(default_factory=dict)


# Module-level because process groups are process-wide: ``new_group`` is a collective that every rank of the
# world calls alike, so what one fully_shard call made must be found by the next (design/overview.md,
# "Module-level state"). Keyed by the world's default process group (a new ``init_process_group`` starts
# empty; a destroyed world's entry goes with its object) and by rank (a threaded process group).
_WORLDS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, _Made]] = weakref.WeakKeyDictionary()


def _made() -> _Made:
    """What this rank has made in its world so far."""
    world = dist.group.WORLD
    assert world is not None, "fully_shard's meshes need torch.distributed initialized"
    return _WORLDS.setdefault(world, {}).setdefault(dist.get_rank(), _Made())


def mesh_once(key: tuple[Any, ...], make: Callable[[], DeviceMesh]) -> DeviceMesh:
    """The mesh ``make()`` builds, made once per ``key`` in this rank's world and shared afterwards (every
    rank calls this alike: making a mesh can be a collective)."""
    meshes = _made().meshes
    if key not in meshes:
        meshes[key] = make()
    return meshes[key]


def singleton_group() -> dist.ProcessGroup:
    """A process group of this rank alone (the shard group of a DDP-like unit: no collective runs on
    it), created locally once per rank: only its one member takes part."""
    made = _made()
    if made.singleton is None:
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        assert group is not None
        made.singleton = group
    return made.singleton


@dataclass(frozen=True)
class SubgroupInfo:
    """The ranks one all-gather runs over: a unit's whole shard group, or the k-rank subgroup a
    partially resharded unit gathers in (reshard_after_forward=k)."""

    group: dist.ProcessGroup
    rank: int
    world: int


@dataclass(frozen=True)
class MeshInfo:
    """The mesh a group shards over: a 1-D ``(shard,)`` or HSDP 2-D ``(replicate, shard)`` mesh (with
    ``dp_mesh_dims``: those dims of ``spmd_mesh``, the full mesh the parameters are DTensors on, several
    names flattened into one dim; ``replicate`` only: the 1-D replicate mesh and a one-rank shard group)."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_world: int
    replicate_group: dist.ProcessGroup | None = None
    replicate_world: int = 1
    spmd_mesh: DeviceMesh | None = None  # dp_mesh_dims: the full mesh the parameters live on
    dp_mesh_dims: DataParallelMeshDims | None = None

    @classmethod
    def of(cls, mesh: DeviceMesh, dp_mesh_dims: Any = None) -> MeshInfo:
        """Check that ``mesh`` is one fully_shard supports and read its groups (``dp_mesh_dims``: ``mesh``
        is the full SPMD mesh and the named dims are the data-parallel ones)."""
        if dp_mesh_dims is not None:
            return cls._of_spmd(mesh, DataParallelMeshDims.coerce(dp_mesh_dims))
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"fully_shard supports a 1-D mesh (FSDP) or a 2-D mesh ('replicate', 'shard') (HSDP); got a "
                f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Fix: pass the FSDP sub-mesh, e.g. "
                "mesh['dp'] or mesh['dp_replicate', 'dp_shard'] (tensor-parallel dims stay on the parameters' "
                "DTensors), or pass the full mesh with dp_mesh_dims=DataParallelMeshDims(shard='dp').")
        _check_world(mesh)
        if mesh.ndim == 1:
            return cls(mesh, mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0))
        return cls(mesh, mesh.get_group(1), mesh.get_local_rank(1), mesh.size(1),
                   replicate_group=mesh.get_group(0), replicate_world=mesh.size(0))

    @classmethod
    def _of_spmd(cls, mesh: DeviceMesh, dims: DataParallelMeshDims) -> MeshInfo:
        """torch 2.13's meaning: several shard (or replicate) names are flattened into one shard (or
        replicate) axis; ``replicate`` alone is DDP-like (a one-rank shard group: parameters stay whole,
        gradients are all-reduced over the replicate axis)."""
        _check_dp_names(mesh, dims)
        _check_world(mesh)
        shard_names, replicate_names = dims.shard_names, dims.replicate_names
        if not shard_names:  # DDP-like
            replicate = flatten_dims(mesh, replicate_names)
            return cls(replicate, singleton_group(), 0, 1, replicate_group=replicate.get_group(0),
                       replicate_world=replicate.size(0), spmd_mesh=mesh, dp_mesh_dims=dims)
        shard = flatten_dims(mesh, shard_names)
        if not replicate_names:
            return cls(shard, shard.get_group(0), shard.get_local_rank(0), shard.size(0),
                       spmd_mesh=mesh, dp_mesh_dims=dims)
        replicate = flatten_dims(mesh, replicate_names)
        dp = concatenate([replicate, shard])
        return cls(dp, shard.get_group(0), shard.get_local_rank(0), shard.size(0),
                   replicate_group=replicate.get_group(0), replicate_world=replicate.size(0),
                   spmd_mesh=mesh, dp_mesh_dims=dims)

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


# --- the groups and meshes made once (_Made) ------------------------------------------------------
def subgroup(mesh: DeviceMesh, info: MeshInfo,
             reshard_after_forward: bool | int | None) -> SubgroupInfo | None:
    """Create (collectively, once per mesh and k) the k-rank subgroups of every shard group; return
    this rank's, or None when ``reshard_after_forward`` needs none."""
    k = reshard_after_forward
    if k is None or isinstance(k, bool) or k in (1, info.shard_world):
        return None
    grid = mesh.mesh.reshape(-1, info.shard_world).tolist()
    key = (tuple(tuple(row) for row in grid), k)
    me = dist.get_rank()
    subgroups = _made().subgroups
    if key not in subgroups:
        mine = None
        for row in grid:
            for start in range(0, len(row), k):
                ranks = row[start:start + k]
                pg = dist.new_group(ranks)
                if me in ranks:
                    mine = pg
        subgroups[key] = mine
    pg = subgroups[key]
    assert pg is not None
    return SubgroupInfo(pg, dist.get_rank(pg), k)


def replicate_mesh(base: DeviceMesh) -> DeviceMesh:
    """The (W, 1) ('replicate', 'shard') mesh over the ranks of ``base`` (created once per rank set)."""
    ranks = tuple(int(r) for r in base.mesh.reshape(-1).tolist())
    key = (base.device_type, ranks)
    meshes = _made().replicate_meshes
    if key not in meshes:
        meshes[key] = DeviceMesh(base.device_type, base.mesh.reshape(-1, 1), mesh_dim_names=("replicate", "shard"))
    return meshes[key]


def concatenate_meshes(dp: DeviceMesh, tp: DeviceMesh, fqn: str) -> DeviceMesh:
    """The mesh ``dp`` x ``tp`` (dp dims first) of two sub-meshes of one root mesh, created once per pair
    so every parameter of a model shares one object (and its process groups: no new group is made).

    ``concatenate`` joins them; ``root_mesh`` tells whether they share a root. Errors name the parameter
    ``fqn`` and the fix."""
    made = _made()
    if (dp, tp) in made.combined:
        return made.combined[dp, tp]
    dp_names, tp_names = dp.mesh_dim_names or (), tp.mesh_dim_names or ()
    overlap = sorted(set(dp_names) & set(tp_names))
    shared_ranks = set(dp.mesh.reshape(-1).tolist()) & set(tp.mesh.reshape(-1).tolist())
    if overlap or shared_ranks != {dist.get_rank()}:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on the mesh {describe_mesh(tp)} and fully_shard was given the mesh "
            f"{describe_mesh(dp)}: they overlap (shared dims {overlap or 'by ranks'}), so the data-parallel mesh "
            "would shard what tensor "
            "parallelism already splits. Fix: pass only the data-parallel dims, e.g. fully_shard(block, "
            "mesh=mesh['dp']) with parallelize_module(block, mesh['tp'], ...), or the full mesh with "
            "dp_mesh_dims=DataParallelMeshDims(shard='dp').")
    # equal, not identical: torch treats value-equal meshes as one (a DTensor may hold an equal copy)
    if root_mesh(dp) != root_mesh(tp) or not dp_names or not tp_names:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on the mesh {describe_mesh(tp)}, which is not a sub-mesh of the same root "
            f"mesh as the fully_shard mesh {describe_mesh(dp)} (both need dim names, sliced from one "
            "init_device_mesh). Fix: mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); "
            "parallelize_module(block, mesh['tp'], plan); fully_shard(block, mesh=mesh['dp']).")
    try:
        combined = concatenate([dp, tp])
    except RuntimeError as e:
        raise ValueError(f"parameter {fqn!r}: cannot combine the fully_shard mesh {describe_mesh(dp)} with its "
                         f"DTensor's mesh {describe_mesh(tp)} ({e}). Fix: slice both from one init_device_mesh(...), "
                         "data-parallel "
                         "dims first.") from None
    made.combined[dp, tp] = combined
    return combined


def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """The mesh ``meshes[0]`` x ``meshes[1]`` x ... of slices of one root mesh, one object per list (no
    process group is created: each dim keeps its slice's group). ``DeviceMesh._concatenate`` is the only
    way torch offers to join slices of one root (its own fully_shard uses it for TP and dp_mesh_dims
    parameters); this is its one use. Raises torch's RuntimeError for overlapping slices."""
    if len(meshes) == 1:
        return meshes[0]
    key, concatenated = tuple(meshes), _made().concatenated
    if key not in concatenated:
        concatenated[key] = DeviceMesh._concatenate(list(meshes))
    return concatenated[key]


def describe_mesh(mesh: DeviceMesh) -> str:
    """``(dp=2, tp=2)``: a mesh's dim names and sizes, for error messages."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) + ")"


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (itself if it is a root). ``_get_root_mesh`` is torch's only
    accessor; this is its one use."""
    return mesh._get_root_mesh()
