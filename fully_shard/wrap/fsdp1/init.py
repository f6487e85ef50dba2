"""FSDP1's unit initialization before sharding: meta materialization (param_init_fn) and sync_module_states.

As FSDP1 does it per unit, before the unit is sharded: the modules of the unit (a breadth-first walk
that stops at units inside and at ignored modules) that still hold meta tensors are materialized on the
compute device at full size, by ``param_init_fn(module)`` if given, else ``to_empty`` + the module's own
``reset_parameters()``; then ``sync_module_states`` broadcasts rank 0's parameters and buffers of the
unit (staged on the accelerator when the backend cannot send CPU tensors), the low-RAM loading path
accelerate uses (rank 0 holds the weights, the other ranks build the model on the meta device).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...comm import collectives
from ...core.init import broadcast_from_rank0

__all__ = ["materialize", "sync_module_states", "unit_modules"]


def unit_modules(root: nn.Module, *, ignored_modules: set[nn.Module],
                 is_wrapped: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """``root`` and the modules below it that belong to its unit, breadth first (FSDP1's order)."""
    out: list[nn.Module] = []
    queue = deque([root])
    seen = {id(root)}
    while queue:
        module = queue.popleft()
        out.append(module)
        for child in module.children():
            if id(child) not in seen and not is_wrapped(child) and child not in ignored_modules:
                seen.add(id(child))
                queue.append(child)
    return out


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from (p for p in module._parameters.values() if p is not None)
    yield from (b for b in module._buffers.values() if b is not None)


def materialize(modules: list[nn.Module], *, param_init_fn: Callable[[nn.Module], None] | None,
                device: torch.device, ignored_params: set[int]) -> bool:
    """Materialize the unit's meta tensors (see module docstring); True if anything was on meta."""
    if not any(t.is_meta for m in modules for t in _own_tensors(m) if id(t) not in ignored_params):
        return False
    if param_init_fn is not None:
        for module in modules:
            param_init_fn(module)
    else:
        with torch.no_grad():
            for module in modules:
                if not any(True for _ in _own_tensors(module)):
                    continue
                reset = getattr(module, "reset_parameters", None)
                if not callable(reset):
                    raise ValueError(
                        f"FullyShardedDataParallel: {type(module).__name__} has parameters or buffers on the meta "
                        "device but no reset_parameters() to initialize them. Fix: pass param_init_fn=... (e.g. "
                        "lambda m: m.to_empty(device=..., recurse=False) followed by your init), or give the "
                        "module a reset_parameters().")
                module.to_empty(device=device, recurse=False)
                reset()
    still = [f"{type(m).__name__}.{n}" for m in modules for n, t in [*m._parameters.items(), *m._buffers.items()]
             if t is not None and t.is_meta and id(t) not in ignored_params]
    if still:
        raise ValueError(f"FullyShardedDataParallel: param_init_fn left {len(still)} tensor(s) on the meta device: "
                         f"{', '.join(still[:6])}. Fix: param_init_fn(module) must materialize the module it is "
                         "given, e.g. module.to_empty(device=..., recurse=False) then initialize it.")
    return True


def sync_module_states(modules: list[nn.Module], *, mesh: DeviceMesh, ignored_params: set[int]) -> None:
    """Broadcast rank 0's parameters and buffers of the unit to the other ranks of ``mesh``."""
    tensors = [t for m in modules for t in _own_tensors(m) if id(t) not in ignored_params]
    if any(t.is_meta for t in tensors):
        raise ValueError("FullyShardedDataParallel(sync_module_states=True): a parameter or buffer is still on the "
                         "meta device, so there is nothing to broadcast into. Fix: pass param_init_fn (e.g. lambda m: "
                         "m.to_empty(device=..., recurse=False)) so the other ranks allocate before rank 0's values "
                         "arrive.")
    with torch.no_grad():
        if mesh.size() == dist.get_world_size():
            for t in tensors:
                broadcast_from_rank0(t.data, "FullyShardedDataParallel(sync_module_states=True)")
            return
        group = mesh.get_group(mesh.ndim - 1) if mesh.ndim == 1 else None
        if group is None:
            raise NotImplementedError("sync_module_states over a 2-D mesh that does not cover the world is not "
                                      "supported. Fix: build the mesh over every rank.")
        src = dist.get_global_rank(group, 0)
        for t in tensors:
            collectives.broadcast(t.data, src, group)
