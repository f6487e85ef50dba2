"""fully_shard(): validate the input, pick the managed parameters, build the group, attach the state.

See design/overview.md. Same signature as ``torch.distributed.fsdp.fully_shard`` so users switch by
changing one import.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard

from ..parallel.mesh import DataParallelMeshDims, MeshInfo, default_mesh, describe_mesh, subgroup
from . import registry
from .checks import check_same_call, describe_call
from .composable import check_not_replicated, mark_fully_shard
from .dynamo import mark_managed
from .group import ParamGroup
from .module import FSDPModule
from .param import ShardedParam
from .placement import MeshGroups, ShardPlacement
from .policy import (
    AllGatherPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizedAllGather,
    check_all_gather_policy,
    check_reshard_after_forward,
)
from .state import FSDPState, get_state, states_under
from .tree import join_fqn

M = TypeVar("M", nn.Module, list)

_CLASS_CACHE: dict[type, type] = {}
_PIN_WARNED = False


def fully_shard(module: M, *, mesh: DeviceMesh | None = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Placement | ShardPlacement | None] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None,
                dp_mesh_dims: DataParallelMeshDims | None = None,
                all_gather_policy: AllGatherPolicy = AllGatherPolicy()) -> M:
    """Shard ``module``'s parameters (not those of nested fully_shard units) along dim 0 over ``mesh``.

    A list makes one unit of several modules (the fix for tied parameters, e.g. an embedding and an
    lm_head sharing one weight). Returns the same module object, its class swapped to ``FSDP<Name>``.
    ``all_gather_policy=QuantizedAllGather(block_size=256)`` (not in torch's signature) gathers int8
    blocks + scales instead of ``param_dtype`` values (design/quantized-all-gather.md).

    Parameters that are already DTensors on a TP/EP sub-mesh of the same root mesh are sharded locally
    (2-D/3-D DTensors on the combined mesh, design/2d-params.md). ``shard_placement_fn(param)`` returns
    None, ``Shard(d)``, or ``ShardPlacement(Shard(d), mesh=other)`` (torch's ``ShardPlacementResult`` too):
    per-parameter meshes, e.g. experts on ``efsdp`` and the rest on ``mesh``; one group (all-gather,
    reduce-scatter) per mesh, every group's gradients divided by ``mesh``'s ranks (design/experts.md).
    ``dp_mesh_dims``: ``mesh`` is the full mesh the parameters are DTensors on and the named dims are the
    data-parallel ones (as torch's).
    """
    modules = _as_modules(module)
    mesh = mesh if mesh is not None else default_mesh()
    mesh_info = MeshInfo.of(mesh, dp_mesh_dims)
    device = mesh_info.device
    check_reshard_after_forward(reshard_after_forward, mesh_info.shard_world)
    check_all_gather_policy(all_gather_policy, reshard_after_forward, mesh_info.shard_world)
    storage_device = _storage_device(offload_policy, device)
    ignored = {id(p) for p in (ignored_params or ())}
    slots = _managed_slots(modules, ignored)
    pin = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
    meshes = MeshGroups(mesh_info)
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    params = _shard_params(slots, meshes, device, storage_device, shard_placement_fn, pin, offload, mp_policy)
    _check_dtensor_params(params, reshard_after_forward, mesh_info)
    _check_groups(params, meshes, reshard_after_forward, all_gather_policy, device)
    for (orig, where), sp in zip(slots, params):  # only once every parameter was accepted: a failed call
        registry.set_owner(orig, f"{type(where[0][0]).__name__} (param {sp.fqn!r})")  # leaves the module as it was
    for m in modules:
        _move_buffers(m, device)
    k_subgroup = subgroup(mesh, mesh_info, reshard_after_forward)
    unit_name = ", ".join(type(m).__name__ for m in modules)
    world = mesh_info.shard_world * mesh_info.replicate_world  # the default divisor of every group (experts.md)
    groups = [ParamGroup([p for p in params if p.mesh_info is info], "", info, device, mp_policy,
                         k_subgroup if info is mesh_info else None, all_gather_policy=all_gather_policy,
                         data_parallel_world=world)
              for info in meshes.used]
    for group in groups:
        group.register_sharded()
    for p in params:
        registry.set_owner(p.sharded_param, f"{unit_name} (param {p.fqn!r})")
    registry.announce_sharded(params, [p for p, _ in slots])  # e.g. the local-shard optimizer step (optim/)
    state = FSDPState(modules, groups, mesh_info, device, mp_policy, reshard_after_forward)
    for m in modules:
        m.__dict__["_fsdp_state"] = state
        m.__class__ = _fsdp_class(type(m))
        mark_fully_shard(m)  # torch's replicate() above it leaves these params alone (composable.py)
    mark_managed(sub for m in modules for _, sub in _walk_unowned(m))  # what Dynamo looks for (dynamo.py)
    title = (f"fully_shard({unit_name}) mesh={tuple(mesh.shape)} reshard_after_forward={reshard_after_forward} "
             f"param_dtype={mp_policy.param_dtype} reduce_dtype={mp_policy.reduce_dtype}")
    if len(groups) > 1 or (groups and groups[0].mesh_info is not mesh_info):
        title += " groups=" + ", ".join(f"{describe_mesh(g.mesh_info.mesh)}:{len(g.params)}" for g in groups)
    check_same_call(describe_call(modules, _unit_owners(modules, state), title=title), mesh_info, device)
    return module


def _unit_owners(modules: tuple[nn.Module, ...], state: FSDPState) -> dict[int, str]:
    """id(sharded parameter) -> which unit manages it (FQN relative to the call) and along which dim."""
    owners: dict[int, str] = {}
    for i, m in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for fqn, unit in states_under(m):
            name = "<this call>" if unit is state else prefix + fqn
            for p in (p for g in unit.groups for p in g.params):
                how = "Replicate()" if p.layout.replicated else f"Shard({p.shard_dim})"
                if p.spec.is_dtensor:
                    how = p.spec.describe() if not p.layout.replicated else f"{p.spec.replicated}"
                if unit.mp_policy.param_dtype_override_fn is not None:  # what it returned decides the gather
                    how += f" param_dtype={p.param_dtype}"
                owners[id(p.sharded_param)] = f"unit={name} {how}"
    return owners


def _as_modules(module: Any) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard expects a module or a non-empty list of modules, got an empty list")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}: {m!r:.80}")
        check_not_replicated(m)
        if get_state(m) is not None:
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__.removeprefix('FSDP')} (now "
                f"{type(m).__name__}); applying it twice would "
                "shard the shards. Fix: call fully_shard once per module (children first, then parents).")
    return modules


def _storage_device(offload_policy: OffloadPolicy, device: torch.device) -> torch.device:
    global _PIN_WARNED
    if not isinstance(offload_policy, CPUOffloadPolicy):
        return device
    if offload_policy.pin_memory and not torch.accelerator.is_available() and not _PIN_WARNED:
        _PIN_WARNED = True
        warnings.warn("CPUOffloadPolicy(pin_memory=True): no accelerator to pin host memory for; "
                      "using pageable CPU memory.", stacklevel=3)
    return torch.device("cpu")


def _managed_slots(modules: tuple[nn.Module, ...],
                   ignored: set[int]) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]]:
    """Parameters under ``modules`` not owned by nested units: [(param, [(module, name, fqn), ...])]."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    for root in modules:
        for prefix, sub in _walk_unowned(root):
            for name, p in sub._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                fqn = join_fqn(prefix, name)
                owner = registry.owner_of(p)
                if owner is not None:
                    raise ValueError(
                        f"parameter {fqn!r} of {type(root).__name__} is already managed by another "
                        f"fully_shard unit: {owner}. A parameter shared between two units would be "
                        f"sharded twice and silently untied. Fix: shard the modules that share it as one "
                        f"unit, fully_shard([a, b]), or pass it in ignored_params.")
                found.setdefault(id(p), (p, []))[1].append((sub, name, fqn))
    return list(found.values())


def _walk_unowned(root: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        prefix, module = stack.pop()
        yield prefix, module
        for name, child in reversed(list(module._modules.items())):
            if child is not None and get_state(child) is None:
                stack.append((join_fqn(prefix, name), child))


def _shard_params(slots: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]], meshes: MeshGroups,
                  device: torch.device, storage_device: torch.device,
                  shard_placement_fn: Callable[[nn.Parameter], Any] | None,
                  pin_memory: bool, offload: bool, mp_policy: MixedPrecisionPolicy) -> list[ShardedParam]:
    params = []
    for p, where in slots:
        module, name, fqn = where[0]
        param_dtype = mp_policy.param_dtype_of(p)  # param_dtype_override_fn: once per parameter, here
        if p.device.type not in ("meta", "cpu", device.type):
            raise ValueError(f"parameter {fqn!r} is on {p.device} but the mesh's device type is "
                             f"{device.type!r}. Fix: build the mesh on {p.device.type!r} "
                             f"(init_device_mesh({p.device.type!r}, ...)) or move the module first.")
        placement, mesh_info = meshes.resolve(shard_placement_fn(p) if shard_placement_fn else None, fqn)
        if mesh_info.device.type != device.type:
            raise ValueError(f"parameter {fqn!r}: shard_placement_fn chose a {mesh_info.device.type!r} mesh "
                             f"{describe_mesh(mesh_info.mesh)}, but the fully_shard mesh is on {device.type!r}. "
                             "Fix: build every mesh of one unit on one device type.")
        shard_dim = _shard_dim(placement, p, fqn)
        sp = ShardedParam(module, name, fqn, p, mesh_info, storage_device,  # meta stays meta until to_empty
                          pin_memory=pin_memory, offload=offload, shard_dim=shard_dim, param_dtype=param_dtype)
        sp.slots = [(m, n) for m, n, _ in where]
        params.append(sp)
    return params


def _check_groups(params: list[ShardedParam], meshes: MeshGroups, reshard_after_forward: bool | int | None,
                  all_gather_policy: AllGatherPolicy, device: torch.device) -> None:
    """Per-parameter meshes (several groups, or one group on another mesh than the call's): a mesh that does
    not reduce over the call's data-parallel ranks, and what they do not support, refused with the fix."""
    others = [info for info in meshes.used if info is not meshes.default]
    if not others:
        return
    _check_data_parallel_ranks(params, meshes.default)
    k = reshard_after_forward
    fqns = [p.fqn for p in params if p.mesh_info is not meshes.default][:4]
    if k is not None and not isinstance(k, bool):
        raise NotImplementedError(
            f"reshard_after_forward={k} (keep a shard over a {k}-rank subgroup) with per-parameter meshes "
            f"(shard_placement_fn put {fqns} on {describe_mesh(others[0].mesh)}): one k cannot fit shard groups "
            "of different sizes. Fix: reshard_after_forward=True or False for this unit.")
    if isinstance(all_gather_policy, QuantizedAllGather):
        raise NotImplementedError(
            f"all_gather_policy={all_gather_policy!r} with per-parameter meshes (shard_placement_fn put {fqns} on "
            f"{describe_mesh(others[0].mesh)}). Fix: drop the policy for this unit, or shard those parameters "
            "in their own fully_shard call.")


def _check_data_parallel_ranks(params: list[ShardedParam], default: MeshInfo) -> None:
    """A parameter on another mesh than the call's must have its gradient reduced over exactly the call's
    data-parallel ranks, which the default divisor (their count) assumes (design/experts.md, "Which meshes
    a parameter may take"): a plain parameter's mesh holds exactly those ranks; a DTensor parameter's (an
    expert's) mesh times its own mesh covers them (efsdp x ep = dp: the expert dispatch's autograd sums over
    ep). Anything else trains silently wrong: the gradient is a partial sum divided by the whole world and
    each group of ranks holds another one (the replicas diverge), so it is refused with the arithmetic.
    This rank's slices of the meshes decide (no collective): every rank of meshes built by
    ``init_device_mesh`` reaches the same verdict."""
    dp = _ranks(default.mesh)
    world = len(dp)
    for p in params:
        info = p.mesh_info
        if info is default:
            continue
        own = _ranks(info.mesh)
        where = (f"this fully_shard call's data-parallel ranks are {sorted(dp)} (mesh {describe_mesh(default.mesh)}), "
                 f"and the default divisor is their count, {world}")
        if not p.spec.is_dtensor:
            if own == dp:
                continue
            raise ValueError(
                f"parameter {p.fqn!r}: shard_placement_fn put it on {describe_mesh(info.mesh)}, ranks {sorted(own)}, "
                f"but {where}: its gradient would be summed over {len(own)} ranks and divided by {world} "
                f"({len(own)}/{world} of the mean gradient), and every group of {len(own)} ranks would hold another "
                "sum, so the replicas diverge. A plain parameter is reduced over exactly the data-parallel ranks; "
                "only an expert-parallel DTensor may take a smaller mesh (its dispatch sums over the rest). Fix: "
                "return None (the fully_shard mesh) for this parameter, or a mesh over exactly those ranks.")
        covered = _ranks(p.spec.mesh)
        if dp <= covered:
            continue
        assert p.spec.unsharded_mesh is not None
        summed = len(covered & dp)
        raise ValueError(
            f"parameter {p.fqn!r} is a DTensor on {describe_mesh(p.spec.unsharded_mesh)} and shard_placement_fn put "
            f"it on {describe_mesh(info.mesh)}: together ranks {sorted(covered)}, which miss ranks "
            f"{sorted(dp - covered)}, "
            f"but {where}: its gradient would be summed over {summed} ranks and divided by {world} ({summed}/{world} "
            "of the mean gradient), and the replicas in the other groups diverge. Fix: give the expert an FSDP mesh "
            "that, times its expert-parallel mesh, covers the data-parallel ranks (torchtitan's efsdp = dp // ep, "
            "both sliced from one mesh).")


def _ranks(mesh: DeviceMesh) -> set[int]:
    """The global ranks of this rank's slice of ``mesh``."""
    return {int(r) for r in mesh.mesh.flatten().tolist()}


def _check_dtensor_params(params: list[ShardedParam], reshard_after_forward: bool | int | None,
                          mesh_info: MeshInfo) -> None:
    """What DTensor (TP/EP, dp_mesh_dims) parameters do not support yet, refused with the fix."""
    k = reshard_after_forward
    partial = k is not None and not isinstance(k, bool) and 1 < k < mesh_info.shard_world
    tp = [p.fqn for p in params if p.spec.is_dtensor]
    if partial and tp:
        raise NotImplementedError(
            f"reshard_after_forward={k} (keep a shard over a {k}-rank subgroup) is not supported for DTensor "
            f"(tensor/expert parallel) parameters, found {tp[:4]}{' ...' if len(tp) > 4 else ''} (torch refuses "
            "it too). Fix: reshard_after_forward=True or False for this unit.")


def _shard_dim(placement: Placement | None, p: nn.Parameter, fqn: str) -> int:
    """The tensor dim ``shard_placement_fn`` chose (default 0); 0-dim parameters are replicated."""
    if placement is None or p.dim() == 0:
        return 0
    if not isinstance(placement, Shard) or not -p.dim() <= placement.dim < p.dim():
        raise ValueError(f"shard_placement_fn returned {placement!r} for {fqn!r} of shape {tuple(p.shape)}; "
                         f"expected None or Shard(d) with -{p.dim()} <= d < {p.dim()}. Fix: return Shard(0) "
                         "(the default) or a Shard of an existing dim.")
    return placement.dim % p.dim()


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)


def _fsdp_class(cls: type) -> type:
    if issubclass(cls, FSDPModule):  # a class that is one already (the FSDP1 wrapper: type(m) is its class)
        return cls
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASS_CACHE[cls]
