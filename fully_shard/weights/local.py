"""iter_local: each rank's local shards, with their placements, mesh and global offset (no communication).

For engines that reshard themselves (vLLM's ``DTensorModuleSource``, M2N transfers): ``LocalShard.tensor``
is this rank's block of the global tensor, starting at ``offset`` (one block per rank for every placement
this library makes: ``Shard(d)``, ``_StridedShard``, ``Replicate``). Plain tensors (buffers,
ignored_params) are held whole by every rank (``placements`` empty, ``mesh`` None).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from ..checkpoint.errors import CheckpointError
from ..checkpoint.views import box_of
from . import naming
from .errors import WeightSyncError


@dataclass(frozen=True)
class LocalShard:
    """This rank's block ``tensor`` of the global tensor ``name`` (of ``shape``), at global index ``offset``."""

    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh: DeviceMesh | None


def iter_local(model: nn.Module) -> Iterator[LocalShard]:
    """Every state_dict tensor of ``model`` (plain names, tied tensors once) as this rank holds it. The
    tensors share storage with the model's: copy what you keep across optimizer steps."""
    for e in naming.entries_of(model):
        t = e.tensor
        if isinstance(t, DTensor):
            try:
                box = box_of(e.name, t)
            except CheckpointError as err:
                raise WeightSyncError(f"iter_local: {err}") from None
            local = t.to_local().detach()
            yield LocalShard(e.name, local, tuple(t.shape), box.offsets, tuple(t.placements), t.device_mesh)
        else:
            yield LocalShard(e.name, t.detach(), tuple(t.shape), (0,) * t.dim(), (), None)
