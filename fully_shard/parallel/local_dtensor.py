"""A DTensor from a local tensor, kept where it lives and without ``DTensor.from_local``'s cost.

``DTensor.from_local`` runs an autograd Function and builds a new spec (placements normalised, shape
and stride checked) on every call, and copies a local tensor of another device type than the mesh's to
the mesh's device (CPU offload's host shards on a CUDA mesh would go back to the GPU). The reduce side
makes one gradient DTensor per parameter per step, always laid out like its parameter:
``like(local, model)`` builds it from ``model``'s spec directly (the construction torch's FSDP2 uses for
its gradients); ``wrap(local, mesh, placements, shape=, stride=)`` builds any other DTensor this package
keeps a local tensor in (sharded parameters, CPU state dicts, loaded shards). That needs private names,
``DTensor._spec``, ``DTensorSpec``/``TensorMeta`` and the ``DTensor.__new__(DTensor, local, spec,
requires_grad=)`` constructor (design/private-torch.md): looked up per call, and where one is missing or
the built DTensor does not match what ``from_local`` would give (checked on the first call of each
process), every call falls back to ``from_local``, which raises where it would move the tensor.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

__all__ = ["like", "local_of", "read_local", "wrap"]

# Whether torch's private constructor gives what from_local gives: a fact about the running torch, so
# module-level and checked once per process (design/overview.md, "Module-level state"); None: not yet
_direct: bool | None = None


def like(local: torch.Tensor, model: DTensor) -> DTensor:
    """``local`` (this rank's part, of ``model``'s local shape, dtype and device, contiguous) as a DTensor
    with ``model``'s mesh, placements, global shape and stride; it does not require grad."""
    spec: Any = getattr(model, "_spec", None)
    if _direct and spec is not None:  # the per-step path, once checked: no further Python frame per gradient
        return DTensor.__new__(DTensor, local, spec, requires_grad=False)  # type: ignore[call-arg]
    out = _construct(local, spec) if spec is not None else None
    if out is not None:
        return out
    return _from_local(local, model.device_mesh, tuple(model.placements), model.shape, model.stride())


def wrap(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], *, shape: torch.Size,
         stride: tuple[int, ...]) -> DTensor:
    """``local`` itself as this rank's part of a DTensor on ``mesh`` (global ``shape`` and ``stride``), on
    whatever device ``local`` lives; it does not require grad.

    ``DTensor.from_local`` copies a local tensor of another device type than the mesh's to the mesh's
    device: CPU offload's host shards and gradients, or a state dict's CPU copies, on a CUDA mesh would go
    back to the GPU. So every DTensor this package makes from a local tensor it keeps is made here."""
    spec = _spec(mesh, placements, shape, stride, local.dtype)
    out = _construct(local, spec) if spec is not None else None
    if out is not None:
        return out
    return _from_local(local, mesh, placements, shape, stride)


def _spec(mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size, stride: tuple[int, ...],
          dtype: torch.dtype) -> Any:
    """A DTensor spec (torch's private ``DTensorSpec``/``TensorMeta``; None where they moved)."""
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))
    except (ImportError, TypeError):  # pragma: no cover - torch moved them: from_local
        return None


def _construct(local: torch.Tensor, spec: Any) -> DTensor | None:
    """The DTensor of ``local`` and ``spec`` through torch's private constructor; None where it is
    missing or does not give what ``from_local`` gives (checked on the first call of each process)."""
    global _direct
    if _direct is False:
        return None
    try:
        # ``__new__`` alone: torch 2.13's ``DTensor.__init__`` only records the constructor for export
        # tracing (behind a Dynamo-disable wrapper, a third of the cost); 2.11 has no ``__init__``
        out = DTensor.__new__(DTensor, local, spec, requires_grad=False)  # type: ignore[call-arg]
    except TypeError:  # the private constructor changed: from_local from now on
        _direct = False
        return None
    if _direct is None:
        # from_local would move a local tensor of another device type: compare with it on meta there
        moved = local.device.type != spec.mesh.device_type and not local.is_meta
        ref = _from_local(local.to("meta") if moved else local, spec.mesh, tuple(spec.placements),
                          out.shape, out.stride())
        _direct = _same(out, ref, local, compare_data=not moved)
    return out if _direct else None


def local_of(dtensor: DTensor) -> torch.Tensor:
    """``dtensor``'s local tensor itself (``to_local()`` of a Parameter makes a new view per call, and
    runs a no_grad context). ``DTensor._local_tensor`` is private (design/private-torch.md)."""
    local = getattr(dtensor, "_local_tensor", None)
    if local is None:  # pragma: no cover - torch renamed it
        with torch.no_grad():
            return dtensor.to_local()
    return local


# ``local_of`` as a C attribute getter where DTensor keeps its local tensor in the slot ``_local_tensor``: a
# group's copy-in reads every parameter's local shard per unshard without a Python frame each (GatherPlan)
read_local: Callable[[DTensor], torch.Tensor] = (
    operator.attrgetter("_local_tensor") if "_local_tensor" in getattr(DTensor, "__slots__", ()) else local_of)


def _from_local(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: torch.Size,
                stride: tuple[int, ...]) -> DTensor:
    with torch.no_grad():
        out = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    if out._local_tensor.device != local.device and not local.is_meta:
        raise RuntimeError(
            f"fully_shard: DTensor.from_local moved a local tensor from {local.device} to "
            f"{out._local_tensor.device} (the mesh's device type) and this torch {torch.__version__} lacks the "
            "private DTensor constructor that keeps it in place (design/private-torch.md); CPU offload and "
            "CPU state dicts need it: report this torch version")
    return out


def _same(a: DTensor, b: DTensor, local: torch.Tensor, *, compare_data: bool) -> bool:
    return (a.device_mesh == b.device_mesh and a.placements == b.placements and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype and a.requires_grad == b.requires_grad
            and a._local_tensor is local and a._local_tensor.shape == b._local_tensor.shape
            and (not compare_data or a._local_tensor.data_ptr() == b._local_tensor.data_ptr()))
