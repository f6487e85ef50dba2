"""A DTensor from a local tensor laid out like an existing DTensor, without ``DTensor.from_local``'s cost.

``DTensor.from_local`` runs an autograd Function and builds a new spec (placements normalised, shape
and stride checked) on every call; the reduce side makes one gradient DTensor per parameter per step,
always laid out like its parameter. ``like(local, model)`` builds it from ``model``'s spec directly (the
construction torch's FSDP2 uses for its gradients). That needs two private names, ``DTensor._spec`` and
the ``DTensor.__new__(DTensor, local, spec, requires_grad=)`` constructor (design/private-torch.md): both are looked up
per call, and where either is missing or the built DTensor does not match what ``from_local`` would
give (checked on the first call of each process), every call falls back to ``from_local``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["like", "local_of", "read_local"]

# Whether torch's private constructor gives what from_local gives: a fact about the running torch, so
# module-level and checked once per process (design/overview.md, "Module-level state"); None: not yet
_direct: bool | None = None


def like(local: torch.Tensor, model: DTensor) -> DTensor:
    """``local`` (this rank's part, of ``model``'s local shape, dtype and device, contiguous) as a DTensor
    with ``model``'s mesh, placements, global shape and stride; it does not require grad."""
    global _direct
    spec: Any = getattr(model, "_spec", None)
    if _direct is not False and spec is not None:
        try:
            # ``__new__`` alone: torch 2.13's ``DTensor.__init__`` only records the constructor for export
            # tracing (behind a Dynamo-disable wrapper, a third of the cost); 2.11 has no ``__init__``
            out = DTensor.__new__(DTensor, local, spec, requires_grad=False)  # type: ignore[call-arg]
        except TypeError:  # the private constructor changed: from_local from now on
            _direct = False
        else:
            if _direct is None:
                _direct = _same(out, _from_local(local, model))
            if _direct:
                return out
    return _from_local(local, model)


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


def _from_local(local: torch.Tensor, model: DTensor) -> DTensor:
    with torch.no_grad():
        return DTensor.from_local(local, model.device_mesh, model.placements, run_check=False,
                                  shape=model.shape, stride=model.stride())


def _same(a: DTensor, b: DTensor) -> bool:
    return (a.device_mesh == b.device_mesh and a.placements == b.placements and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype and a.requires_grad == b.requires_grad
            and a._local_tensor.shape == b._local_tensor.shape
            and a._local_tensor.data_ptr() == b._local_tensor.data_ptr())
