"""fully_shard(): validate the input, pick the managed parameters, build the group, attach the state.

See design/overview.md. Same signature as ``torch.distributed.fsdp.fully_shard`` so users switch by
changing one import.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Shard

from .group import ParamGroup, SubgroupInfo
from .module import FSDPModule
from .optimizer import track as track_for_optimizer
from .param import MeshInfo, ShardedParam
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state import FSDPState, get_state

M = TypeVar("M", nn.Module, list)

# Which fully_shard unit owns a parameter (original or sharded object) is recorded as the tensor
# attribute _OWNER_ATTR = "<Class> (param 'name')". Not a weakref registry: a weakref on a parameter
# makes torch.utils.swap_tensors (module.to_empty()/.to() on DTensor params) refuse to swap it.
_OWNER_ATTR = "_fully_shard_owner"
_CLASS_CACHE: dict[type, type] = {}
_SUBGROUPS: dict[tuple[tuple[tuple[int, ...], ...], int], dist.ProcessGroup | None] = {}
_PIN_WARNED = False


def fully_shard(module: M, *, mesh: DeviceMesh | None = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: set[nn.Parameter] | None = None) -> M:
    """Shard ``module``'s parameters (not those of nested fully_shard units) along dim 0 over ``mesh``.

    A list makes one unit of several modules (the fix for tied parameters, e.g. an embedding and an
    lm_head sharing one weight). Returns the same module object, its class swapped to ``FSDP<Name>``.
    """
    modules = _as_modules(module)
    mesh = mesh if mesh is not None else default_mesh()
    mesh_info = _mesh_info(mesh)
    device = mesh_info.device
    validate_reshard_after_forward(reshard_after_forward, mesh_info, None)
    storage_device = _storage_device(offload_policy, device)
    ignored = {id(p) for p in (ignored_params or ())}
    slots = _managed_slots(modules, ignored)
    pin = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
    params = _shard_params(slots, mesh_info, device, storage_device, shard_placement_fn, pin)
    for m in modules:
        _move_buffers(m, device)
    subgroup = _subgroup(mesh, mesh_info, reshard_after_forward)
    unit_name = ", ".join(type(m).__name__ for m in modules)
    group = ParamGroup(params, "", mesh_info, device, mp_policy, subgroup) if params else None
    for p in params:
        p.register_sharded()
        _set_owner(p.sharded_param, f"{unit_name} (param {p.fqn!r})")
    track_for_optimizer(params, [p for p, _ in slots])  # the optimizer step on local shards; see design/optimizer-step.md
    state = FSDPState(modules, group, mesh_info, device, mp_policy, reshard_after_forward)
    for m in modules:
        m.__dict__["_fsdp_state"] = state
        m.__class__ = _fsdp_class(type(m))
    return module


def _as_modules(module: Any) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard expects a module or a non-empty list of modules, got an empty list")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module(s), got {type(m).__name__}: {m!r:.80}")
        if get_state(m) is not None:
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__.removeprefix('FSDP')} (now "
                f"{type(m).__name__}); applying it twice would "
                "shard the shards. Fix: call fully_shard once per module (children first, then parents).")
    return modules


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the default process group on the default device (like torch's)."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed: call dist.init_process_group(...) first "
                           "(torchrun sets the environment), or pass mesh=init_device_mesh(...).")
    backend = str(dist.get_backend()).lower()
    device_type = "cpu"
    if "nccl" in backend or "xccl" in backend or "hccl" in backend:
        acc = torch.accelerator.current_accelerator()
        device_type = acc.type if acc is not None else "cuda"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_info(mesh: DeviceMesh) -> MeshInfo:
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
        return MeshInfo(mesh, mesh.get_group(0), mesh.get_local_rank(0), mesh.size(0))
    return MeshInfo(mesh, mesh.get_group(1), mesh.get_local_rank(1), mesh.size(1),
                    replicate_group=mesh.get_group(0), replicate_world=mesh.size(0))


def validate_reshard_after_forward(value: Any, mesh_info: MeshInfo, group: ParamGroup | None) -> None:
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward must be None, a bool or an int, got {value!r}")
    world = mesh_info.shard_world
    if value < 1 or world % value:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group size {world} (it is the size of the "
            f"subgroup params stay sharded over between forward and backward). Fix: use one of "
            f"{[k for k in range(1, world + 1) if world % k == 0]}, or True/False.")
    if group is not None and (group.subgroup is None or group.subgroup.world != value) and 1 < value < world:
        raise ValueError(f"set_reshard_after_forward({value}) needs the {value}-rank subgroups created at "
                         f"fully_shard time. Fix: pass reshard_after_forward={value} to fully_shard.")


def _storage_device(offload_policy: OffloadPolicy, device: torch.device) -> torch.device:
    global _PIN_WARNED
    if not isinstance(offload_policy, CPUOffloadPolicy):
        return device
    if offload_policy.pin_memory and not torch.accelerator.is_available() and not _PIN_WARNED:
        _PIN_WARNED = True
        warnings.warn("CPUOffloadPolicy(pin_memory=True): no accelerator to pin host memory for; "
                      "using pageable CPU memory.", stacklevel=3)
    return torch.device("cpu")


def _managed_slots(modules: tuple[nn.Module, ...], ignored: set[int]) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]]:
    """Parameters under ``modules`` not owned by nested units: [(param, [(module, name, fqn), ...])]."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    for root in modules:
        for prefix, sub in _walk_unowned(root):
            for name, p in sub._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                fqn = f"{prefix}.{name}" if prefix else name
                owner = _owner_of(p)
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
                stack.append((f"{prefix}.{name}" if prefix else name, child))


def _shard_params(slots: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]], mesh_info: MeshInfo,
                  device: torch.device, storage_device: torch.device,
                  shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None,
                  pin_memory: bool) -> list[ShardedParam]:
    params = []
    for p, where in slots:
        module, name, fqn = where[0]
        if p.device.type not in ("meta", "cpu", device.type):
            raise ValueError(f"parameter {fqn!r} is on {p.device} but the mesh's device type is "
                             f"{device.type!r}. Fix: build the mesh on {p.device.type!r} "
                             f"(init_device_mesh({p.device.type!r}, ...)) or move the module first.")
        shard_dim = _shard_dim(shard_placement_fn(p) if shard_placement_fn else None, p, fqn)
        sp = ShardedParam(module, name, fqn, p, mesh_info, storage_device,  # meta stays meta until to_empty
                          pin_memory=pin_memory, shard_dim=shard_dim)
        sp.slots = [(m, n) for m, n, _ in where]
        _set_owner(p, f"{type(module).__name__} (param {fqn!r})")
        params.append(sp)
    return params


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


def _subgroup(mesh: DeviceMesh, mesh_info: MeshInfo, raf: bool | int | None) -> SubgroupInfo | None:
    """Create (collectively, once per mesh and k) the k-rank subgroups of every shard group."""
    if raf is None or isinstance(raf, bool) or raf in (1, mesh_info.shard_world):
        return None
    grid = mesh.mesh.reshape(-1, mesh_info.shard_world).tolist()
    key = (tuple(tuple(row) for row in grid), raf)
    me = dist.get_rank()
    if key not in _SUBGROUPS:
        mine = None
        for row in grid:
            for start in range(0, len(row), raf):
                ranks = row[start:start + raf]
                pg = dist.new_group(ranks)
                if me in ranks:
                    mine = pg
        _SUBGROUPS[key] = mine
    pg = _SUBGROUPS[key]
    assert pg is not None
    return SubgroupInfo(pg, dist.get_rank(pg), raf)


def _owner_of(p: torch.Tensor) -> str | None:
    return getattr(p, _OWNER_ATTR, None)


def _set_owner(p: torch.Tensor, description: str) -> None:
    setattr(p, _OWNER_ATTR, description)


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASS_CACHE[cls]
