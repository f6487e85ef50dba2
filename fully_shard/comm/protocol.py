"""Custom collectives (torch's ``Comm`` objects) for the all-gather/reduce-scatter overrides: checks and
process-group allocation.

torch 2.13's ``Comm`` protocol (``set_custom_all_gather`` / ``set_custom_reduce_scatter``): an object
with ``allocate(size, *, dtype, device) -> Tensor`` for the communication buffer and ``__call__``
running the collective, ``(output_tensor, input_tensor, group, async_op)`` for an all-gather and
``(output_tensor, input_tensor, group, op, async_op)`` for a reduce-scatter, returning a ``Work`` (or
None when done). Objects written against torch's ``AllGather`` / ``ReduceScatter`` classes work as
they are; this module never imports them. See design/data-path.md, "Overriding the collectives".
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import collectives

_WARNED: set[tuple[str, str, str]] = set()


def check_custom(custom: Any, method: str, call: str) -> None:
    """A custom collective (the object given to ``set_custom_all_gather``/``set_custom_reduce_scatter``) must
    have a callable ``allocate`` and be callable itself."""
    if callable(getattr(custom, "allocate", None)) and callable(custom):
        return
    raise TypeError(f"{method} expects an object with allocate(size, *, dtype, device) and __call__({call}) "
                    f"(torch's Comm protocol), got {type(custom).__name__}: {custom!r}. Fix: implement both methods.")


def warn_once(method: str, device: torch.device, backend: str, what: str) -> None:
    """One warning per method, device type and backend: the call cannot do anything here."""
    key = (method, device.type, backend)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"{method} has no effect on device {device.type!r} with the {backend!r} backend: {what}",
                  UserWarning, stacklevel=3)


def backend_name(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group))


def supports_tensor_alloc(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend on ``device`` allocates communication tensors itself (NCCL's
    zero-copy buffers). ``ProcessGroup._get_backend`` is the only way torch exposes the backend object
    whose ``supports_tensor_alloc``/``allocate_tensor`` answer this; used here and in ``PGAllocAllGather``."""
    backend = group._get_backend(device)
    return bool(getattr(backend, "supports_tensor_alloc", lambda _: False)(device))


class _PGAlloc:
    """Buffers from the process group's own allocator (``set_allocate_memory_from_process_group_for_comm``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        backend = self.group._get_backend(device)  # see supports_tensor_alloc
        return backend.allocate_tensor(math.prod(int(s) for s in size), dtype=dtype, device=device)


class PGAllocAllGather(_PGAlloc):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return collectives.all_gather_into(output_tensor, input_tensor, group, async_op=async_op)


class PGAllocReduceScatter(_PGAlloc):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp, async_op: bool = False) -> dist.Work | None:
        return collectives.reduce_scatter_into(output_tensor, input_tensor, group, op, async_op=async_op)


def is_builtin(custom: Any) -> bool:
    """None (torch.empty + the plain collective) or this module's process-group allocation."""
    return custom is None or isinstance(custom, _PGAlloc)
