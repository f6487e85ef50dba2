"""clip_grad_norm_: the global gradient norm over sharded (DTensor) and plain gradients, and clipping.

Works across several meshes at once (e.g. HSDP units, plain FSDP units and ignored, unsharded
parameters in one model). Each gradient contributes ``sum(|g|^p)`` (or ``max(|g|)``) of its local
tensor, reduced only over the mesh dimensions it is *sharded* on: a ``Replicate()`` dimension (HSDP's
replica dimension, a 0-dim parameter's placement) already holds the whole value on every rank and
must not be counted twice. The result is a plain tensor with the same value on every rank, equal to
the unsharded model's total norm (torch's utility can return a DTensor with a ``Partial`` placement
that under-reports when logged with ``.item()``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..comm import collectives
from ..parallel.mesh import device_of

__all__ = ["clip_grad_norm_", "total_grad_norm"]

# Mesh dimensions a contribution is summed over: ((mesh id, dim), ...); () for plain tensors.
_ReduceKey = tuple[tuple[int, int], ...]


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their total ``norm_type``-norm is at most
    ``max_norm``; return the total norm before clipping (a plain tensor, identical on every rank).

    Same call as ``torch.nn.utils.clip_grad_norm_``. Every rank must pass the same parameters in the
    same order (as with any collective). Gradients of plain (non-DTensor) parameters are taken as
    replicated: all-reduce them yourself first if they differ across ranks.
    """
    max_norm = _check_positive("max_norm", max_norm,
                               "Fix: pass the largest total gradient norm to allow, e.g. max_norm=1.0.")
    params = _as_list(parameters)
    total = total_grad_norm(params, norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for (device, dtype), locals_ in _by_device_dtype(_local(g) for g in grads).items():
            torch._foreach_mul_(locals_, coef.to(device, dtype))  # one kernel per (device, dtype)
    return total


def total_grad_norm(parameters: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The total ``norm_type``-norm of all gradients of ``parameters`` (no clipping); see module doc."""
    norm_type = _check_norm_type(norm_type)
    params = _as_list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    out_device = _local(grads[0]).device
    inf = math.isinf(norm_type)
    # Per reduction key: the local tensors (in insertion order, the same on every rank, so the collectives
    # match; a key whose shards are all empty on this rank still takes part) and the groups to reduce over.
    locals_by_key: dict[_ReduceKey, list[torch.Tensor]] = {}
    groups: dict[_ReduceKey, list[tuple[dist.ProcessGroup, torch.device]]] = {}
    for g in grads:
        key, local, reduce_over = _local_and_groups(g)
        if key not in groups:
            locals_by_key[key], groups[key] = [], reduce_over
        if local.numel():  # an uneven dim-0 shard can be empty on the last ranks
            locals_by_key[key].append(local.detach())
    total: torch.Tensor | None = None
    for key, locals_ in locals_by_key.items():
        value = _contribution(locals_, norm_type, out_device)
        for group, device in groups[key]:
            value = value.to(device)
            collectives.all_reduce(value, group, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
        value = value.to(out_device)
        total = value if total is None else (torch.maximum(total, value) if inf else total + value)
    assert total is not None
    return total if inf else total ** (1.0 / norm_type)


def _contribution(locals_: list[torch.Tensor], norm_type: float, out_device: torch.device) -> torch.Tensor:
    """``sum(|g|^p)`` (``max |g|`` for p = inf) over ``locals_`` in float32: one ``_foreach_norm`` per
    (device, dtype), accumulating in float32 (float64 in its own precision)."""
    parts = []
    for device, dtype in (batch := _by_device_dtype(locals_)):
        wide = dtype.is_floating_point and dtype.itemsize > 4  # float64: its own precision, then float32
        norms = torch.stack(torch._foreach_norm(batch[(device, dtype)], norm_type,
                                                dtype=None if wide else torch.float32)).float()
        parts.append((norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()).to(out_device))
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=out_device)
    return torch.stack(parts).max() if math.isinf(norm_type) else torch.stack(parts).sum()


def _by_device_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def _local_and_groups(g: torch.Tensor) -> tuple[_ReduceKey, torch.Tensor,
                                                  list[tuple[dist.ProcessGroup, torch.device]]]:
    """The local tensor to take the norm of and the (group, device) pairs to sum it over."""
    if not isinstance(g, DTensor):
        return (), g, []
    if any(p.is_partial() for p in g.placements):  # resolve pending sums before taking |g|^p
        g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
    mesh = g.device_mesh
    device = device_of(mesh)
    # every non-Replicate dim splits the tensor: Shard(d), and _StridedShard (FSDP over a TP-sharded dim),
    # whose is_shard() is False
    dims = [d for d, p in enumerate(g.placements) if not p.is_replicate()]
    key = tuple((id(mesh), d) for d in dims)
    return key, g.to_local(), [(mesh.get_group(d), device) for d in dims]


def _as_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _check_positive(name: str, value: float, fix: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a positive number, got {value!r}. {fix}") from None
    if not number > 0 or math.isnan(number):
        raise ValueError(f"{name} must be > 0, got {value!r}: a non-positive limit would zero (or flip) "
                         f"every gradient. {fix}")
    return number


def _check_norm_type(norm_type: float) -> float:
    return _check_positive("norm_type", norm_type,
                           "Fix: use 2.0 (Euclidean), 1.0, float('inf') (max |g|) or another p > 0.")
