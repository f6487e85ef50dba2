"""Views: which block of each model/optimizer tensor this rank holds and writes, as the writer and reader see them.

A View is one logical tensor (a state_dict entry or an optimizer state tensor) with its global
signature, the box this rank holds and the box it writes (boxes.held_box / boxes.write_box), for any
DTensor this library produces: ``Shard(d)``, ``_StridedShard(d, sf)`` and ``Replicate()`` on meshes
of any rank. Also the FQN bookkeeping shared by the state-dict API and the checkpoint: which parameter
of the model each optimizer parameter is, and how optimizer state tensors are laid out like their
parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..core.module import FSDPModule
from ..parallel import local_dtensor
from . import boxes
from .boxes import Box
from .codec import st_dtype
from .errors import CheckpointError

try:  # torch's FSDP+TP placement; private in torch (no public name exists), needed only to recognise it
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = None  # type: ignore[assignment,misc]


@dataclass
class View:
    """One logical tensor as seen by this rank: its global signature and the boxes it holds/writes."""

    name: str
    tensor: torch.Tensor  # as held by the model/optimizer (DTensor or plain)
    local: torch.Tensor  # this rank's held box, a plain tensor sharing storage with ``tensor``
    dtype: str
    shape: tuple[int, ...]
    held: Box
    write: Box | None  # the part this rank writes (None: nothing); plain tensors: see ``whole``
    whole: bool = False  # a plain tensor: written whole by one assigned rank

    @property
    def sharded(self) -> bool:
        return isinstance(self.tensor, DTensor)

    def block(self, box: Box) -> torch.Tensor:
        """The held part ``box`` (global indices) as a view of ``local``."""
        return self.local[box.slices(self.held)]


def placements_of(name: str, tensor: DTensor) -> list[boxes.Placement]:
    """The DTensor's placements as plain data; Partial and unknown placements are refused."""
    out = []
    for p in tensor.placements:
        if _StridedShard is not None and isinstance(p, _StridedShard):
            out.append(boxes.strided(p.dim, int(p.split_factor)))
        elif type(p) is Shard:
            out.append(boxes.shard(p.dim))
        elif isinstance(p, Replicate):
            out.append(boxes.replicate())
        else:
            raise CheckpointError(
                f"{name}: DTensor placement {p} (all placements {tuple(tensor.placements)}) is not supported; "
                "checkpoints store Shard(d), _StridedShard(d) and Replicate() placements; fix: redistribute the "
                "tensor (a Partial one: reduce it, e.g. tensor.redistribute(placements=[Replicate()])) before saving")
    return out


def box_of(name: str, tensor: DTensor, shape: tuple[int, ...] | None = None) -> Box:
    """The box of a tensor of global ``shape`` (default: ``tensor``'s) this rank holds when laid out like ``tensor``."""
    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise CheckpointError(f"{name}: this rank is not part of the tensor's device mesh {mesh}; fix: call "
                              "checkpoint functions on the ranks of the model's mesh")
    shape = tuple(tensor.shape) if shape is None else shape
    try:
        return boxes.held_box(shape, tuple(mesh.shape), coord, placements_of(name, tensor))
    except (boxes.NotABox, ValueError) as e:
        raise CheckpointError(f"{name}: placements {tuple(tensor.placements)} on mesh {tuple(mesh.shape)} give this "
                              f"rank a local shard that is not one block of the global tensor ({e}); checkpoints "
                              "store one block per rank; fix: redistribute the tensor before saving") from None


def describe(name: str, tensor: torch.Tensor) -> View:
    """Where ``tensor``'s elements live on this rank. Plain tensors are held whole by every rank."""
    dtype = st_dtype(tensor.dtype, name)
    shape = tuple(tensor.shape)
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        held = box_of(name, tensor)
        coord = mesh.get_coordinate()
        assert coord is not None  # box_of checked it
        write = boxes.write_box(shape, tuple(mesh.shape), coord, placements_of(name, tensor))
        local = tensor.to_local()
        if tuple(local.shape) != held.sizes:
            raise CheckpointError(
                f"{name}: local shard has shape {tuple(local.shape)}, but placements {tuple(tensor.placements)} of "
                f"global shape {shape} on mesh {tuple(mesh.shape)} at {tuple(coord)} give {held.sizes} (torch.chunk "
                "semantics); fix: shard with torch.chunk semantics (unpadded local shards)")
        return View(name, tensor, local, dtype, shape, held, write)
    box = boxes.full_box(shape)
    return View(name, tensor, tensor.detach(), dtype, shape, box, box if box.numel else None, whole=True)


MeshKey = tuple[tuple[int, ...], tuple[int, ...]]  # (mesh shape, its global ranks in order)


def _mesh_key(mesh: Any) -> MeshKey:
    return tuple(mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist())


def mesh_roles(views: list[View]) -> dict[str, Any]:
    """This rank's meshes, numbered by first use, and which one each DTensor view uses (exchanged at save).

    A DTensor on a sub-mesh (torch's FSDP + TP puts non-TP parameters on the dp mesh alone) is held by
    every copy of that mesh, the copies differing on the axes the mesh leaves out: those ranks are
    replicas the placements do not show (``split_writes``)."""
    keys: dict[MeshKey, int] = {}
    uses = []
    for v in views:
        if isinstance(v.tensor, DTensor):
            uses.append(keys.setdefault(_mesh_key(v.tensor.device_mesh), len(keys)))
    return {"meshes": [list(k[1]) for k in keys], "uses": uses}


def split_writes(views: list[View], roles: list[dict[str, Any]], rank: int) -> None:
    """Share each DTensor's writing among all ranks that hold its box, copies of a sub-mesh included.

    ``roles``: every rank's ``mesh_roles``. Mesh number k plays the same part on every rank (the model
    code is the same); the distinct rank lists of mesh k are its copies, which must be disjoint.
    """
    if any(r["uses"] != roles[rank]["uses"] for r in roles):
        bad = [i for i, r in enumerate(roles) if r["uses"] != roles[0]["uses"]]
        raise CheckpointError(f"the model's DTensors use their device meshes differently on rank(s) {bad} than on "
                              "rank 0; fix: build the model and its meshes the same way on every rank")
    copies: dict[int, tuple[int, int]] = {}
    for k, mine in enumerate(roles[rank]["meshes"]):
        lists = sorted({tuple(r["meshes"][k]) for r in roles})
        if len({x for ranks in lists for x in ranks}) != sum(len(ranks) for ranks in lists):
            raise CheckpointError(f"device mesh {k} of the model's DTensors has overlapping copies {lists[:4]} across "
                                  "ranks; fix: build the meshes the same way on every rank (init_device_mesh and its "
                                  "sub-meshes)")
        copies[k] = (len(lists), lists.index(tuple(mine)))
    uses = iter(roles[rank]["uses"])
    for v in views:
        if isinstance(v.tensor, DTensor):
            n, i = copies[next(uses)]
            if n > 1:
                mesh = v.tensor.device_mesh
                coord = mesh.get_coordinate()
                assert coord is not None
                v.write = boxes.write_box(v.shape, (n, *mesh.shape), (i, *coord),
                                          [boxes.replicate(), *placements_of(v.name, v.tensor)])


def ensure_sharded(model: nn.Module) -> None:
    """Register every fully_shard unit's sharded DTensors (a unit left unsharded, e.g. after a forward
    with reshard_after_forward=False, would otherwise show plain full tensors in its state_dict)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def model_views(model: nn.Module) -> tuple[list[View], dict[str, str]]:
    """Views of every state_dict entry (shared tensors once) and {alias fqn: stored fqn}."""
    ensure_sharded(model)
    views: list[View] = []
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for fqn, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"model state_dict entry {fqn!r} is a {type(tensor).__name__}, not a tensor; "
                                  "checkpoints store tensors only; fix: keep such state in `extra`")
        if id(tensor) in seen:
            aliases[fqn] = seen[id(tensor)]
            continue
        seen[id(tensor)] = fqn
        views.append(describe(fqn, tensor))
    return views, aliases


def param_fqns(model: nn.Module) -> dict[int, str]:
    return {id(p): fqn for fqn, p in model.named_parameters()}


def optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[tuple[str, torch.Tensor]]]:
    """[(fqn, param)] per param group; every optimizer parameter must belong to ``model``."""
    ensure_sharded(model)
    fqns = param_fqns(model)
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        entries = []
        for p in group["params"]:
            if id(p) not in fqns:
                raise CheckpointError(
                    f"optimizer param_groups[{i}] holds a parameter of shape {tuple(p.shape)} that is not a "
                    "parameter of the model; optimizer state is keyed by the model's parameter names; fix: build "
                    "the optimizer from model.parameters() after wrapping the model")
            entries.append((fqns[id(p)], p))
        groups.append(entries)
    return groups


def group_hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def state_is_sharded(param: torch.Tensor, name: str, shape: tuple[int, ...], saved_sharded: bool | None,
                     existing: Any) -> bool:
    """Whether an optimizer state tensor should be a DTensor laid out like its parameter.

    Decided by the state the optimizer already holds if any, else by how it was saved, else by shape
    (``step`` counters stay plain tensors, as torch optimizers create them).
    """
    if not isinstance(param, DTensor) or shape != tuple(param.shape):
        return False
    if isinstance(existing, torch.Tensor):
        return isinstance(existing, DTensor)
    if saved_sharded is not None:
        return saved_sharded
    return name != "step"


def shard_like(param: DTensor, full: torch.Tensor) -> DTensor:
    """Cut this rank's box of ``full`` (a plain tensor of param's global shape) into a DTensor like ``param``."""
    view = describe("param", param)
    local = full[view.held.slices()]
    local = local.detach().to(device=view.local.device, copy=True).contiguous()  # never alias the caller's
    return local_dtensor.wrap(local, param.device_mesh, tuple(param.placements), shape=param.shape,
                              stride=param.stride())


def from_local_like(param: DTensor, local: torch.Tensor, shape: tuple[int, ...]) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return local_dtensor.wrap(local, param.device_mesh, tuple(param.placements), shape=torch.Size(shape),
                              stride=stride)
