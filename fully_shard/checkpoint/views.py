"""Views: where each model/optimizer tensor's global rows live on this rank, as the writer and reader see them.

A View is one logical tensor (a state_dict entry or an optimizer state tensor) with its global
signature, the rows this rank holds and the rows it writes (rows.held_rows / rows.write_rows). Also
the FQN bookkeeping shared by the state-dict API and the checkpoint: which parameter of the model each
optimizer parameter is, and how optimizer state tensors are laid out like their parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..module import FSDPModule
from . import rows
from .codec import st_dtype
from .errors import CheckpointError


@dataclass
class View:
    """One logical tensor as seen by this rank: its global signature and the rows it holds/writes."""

    name: str
    tensor: torch.Tensor  # as held by the model/optimizer (DTensor or plain)
    local: torch.Tensor  # this rank's held rows, a plain tensor sharing storage with ``tensor``
    dtype: str
    shape: tuple[int, ...]
    held: tuple[int, int]
    write: tuple[int, int] | None  # rows this rank writes; None: written whole by one assigned rank

    @property
    def sharded(self) -> bool:
        return isinstance(self.tensor, DTensor)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """The held rows [start, end) (global indices) as a view of ``local``."""
        if not self.shape:
            return self.local
        return self.local[start - self.held[0]: end - self.held[0]]


def _placements(name: str, tensor: DTensor) -> list[str]:
    out = []
    for p in tensor.placements:
        if type(p) is Shard and p.dim == 0 and tensor.ndim > 0:
            out.append(rows.SHARD)
        elif isinstance(p, Replicate):
            out.append(rows.REPLICATE)
        else:
            raise CheckpointError(
                f"{name}: DTensor placement {p} (all placements {tuple(tensor.placements)}) is not supported; "
                "checkpoints handle Shard(0) and Replicate() placements (fully_shard's default); fix: shard "
                "this unit without a shard_placement_fn that picks another dim, or redistribute the tensor to "
                "Shard(0)/Replicate() before saving")
    return out


def describe(name: str, tensor: torch.Tensor) -> View:
    """Where ``tensor``'s rows live on this rank. Plain tensors are held whole by every rank."""
    dtype = st_dtype(tensor.dtype, name)
    shape = tuple(tensor.shape)
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            raise CheckpointError(f"{name}: this rank is not part of the tensor's device mesh {mesh}; fix: call "
                                  "checkpoint functions on the ranks of the model's mesh")
        placements = _placements(name, tensor)
        mesh_shape = tuple(mesh.shape)
        held = rows.held_rows(shape, mesh_shape, coord, placements)
        write = rows.write_rows(shape, mesh_shape, coord, placements)
        local = tensor.to_local()
        expected = () if not shape else (held[1] - held[0], *shape[1:])
        if tuple(local.shape) != expected:
            raise CheckpointError(
                f"{name}: local shard has shape {tuple(local.shape)}, but a torch.chunk Shard(0) layout of global "
                f"shape {shape} on mesh {mesh_shape} at {tuple(coord)} gives {expected}; fix: shard with "
                "torch.chunk semantics (unpadded local shards)")
        return View(name, tensor, local, dtype, shape, held, write)
    return View(name, tensor, tensor.detach(), dtype, shape, (0, rows.rows_of(shape)), None)


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
    """Cut this rank's rows of ``full`` (a plain tensor of param's global shape) into a DTensor like ``param``."""
    view = describe("param", param)
    local = full if not view.shape else full[view.held[0]: view.held[1]]
    local = local.detach().to(device=view.local.device, copy=True).contiguous()  # never alias the caller's
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def held_like(param: DTensor, shape: tuple[int, ...]) -> tuple[int, int]:
    """Rows of a tensor of global ``shape`` this rank holds when laid out like ``param``."""
    coord = param.device_mesh.get_coordinate()
    if coord is None:
        raise CheckpointError("this rank is not part of the parameter's device mesh")
    return rows.held_rows(shape, tuple(param.device_mesh.shape), coord, _placements("param", param))


def from_local_like(param: DTensor, local: torch.Tensor, shape: tuple[int, ...]) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)
