"""A trainer rank's own parts of the yielded tensors: the elements it sends in a delta, each exactly once.

For each state_dict entry the rank's share is the box ``checkpoint.boxes.write_box`` gives it (its held
shard for ``Shard(d)``/``_StridedShard`` placements, any mesh; replicas share a held box, each sending
one part of it), and of a DTensor on a sub-mesh (TP model: norms on ``dp`` only) only the copy holding
the root mesh's first rank sends. Plain tensors (buffers, ignored_params) are sent by the leader alone.
Each share is cut by the key map's links into parts of the yielded tensors (``Part.box``: where in the
yielded tensor, which the receiver fills). No collective: every rank decides from its own placements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..checkpoint import boxes
from ..checkpoint.boxes import Box
from ..checkpoint.hf_keys import STACK, TRANSPOSE, Link
from ..checkpoint.views import View, describe
from ..parallel.mesh import root_mesh
from . import naming


@dataclass
class Part:
    """Box ``box`` of yielded tensor ``output`` is box ``model_box`` (global) of entry ``view``, via ``link``."""

    output: int
    box: Box
    model_box: Box
    view: View
    link: Link
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return self.box.numel

    def current(self) -> torch.Tensor:
        """The part's values now, flat, in the wire dtype, in the yielded tensor's layout: a view of the model's
        own storage where that is all it takes (the same dtype, a contiguous block), else a new tensor. The
        local shard is read at every call (a ``swap_tensors`` or ``.data =`` between sends is seen)."""
        t = self.view.tensor
        held = t.to_local() if isinstance(t, DTensor) else t
        piece = held.detach()[self.model_box.slices(self.view.held)]
        if self.link.op == TRANSPOSE:
            piece = piece.t()
        elif self.link.op == STACK:
            piece = piece.squeeze(self.link.dim)
        if piece.dtype == self.dtype and piece.is_contiguous():
            return piece.view(-1)
        out = torch.empty(self.box.sizes, dtype=self.dtype, device=piece.device)
        out.copy_(piece.reshape(self.box.sizes))
        return out.view(-1)

    def values(self) -> torch.Tensor:
        """``current()`` as a new tensor (a snapshot)."""
        now = self.current()
        return now.clone() if _shares_storage(now, self.view.tensor) else now


def _shares_storage(a: torch.Tensor, t: torch.Tensor) -> bool:
    held = t.to_local() if isinstance(t, DTensor) else t
    return a.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()


def _first_copy(tensor: DTensor) -> bool:
    """A DTensor on a sub-mesh is held by every copy of that mesh in its root mesh: only the copy holding
    the root's first rank sends."""
    mesh = tensor.device_mesh
    root = root_mesh(mesh)
    if root.mesh.numel() == mesh.mesh.numel():
        return True
    return int(root.mesh.min()) in set(mesh.mesh.flatten().tolist())


def own_parts(plan: naming.Plan, *, leader: bool) -> list[Part]:
    """This rank's parts, in plan order."""
    out = []
    first: dict[int, bool] = {}  # per mesh (reading a mesh's ranks is slow: once per mesh, not per tensor)
    for e in plan.entries:
        if e.hidden:
            continue
        view = describe(e.name, e.tensor)
        if isinstance(e.tensor, DTensor):
            mesh = e.tensor.device_mesh
            if id(mesh) not in first:
                first[id(mesh)] = _first_copy(e.tensor)
            write = view.write if first[id(mesh)] else None
        else:
            write = boxes.full_box(view.shape) if leader and view.held.numel else None
        if write is None:
            continue
        for index, link in plan.links_of.get(e.name, []):
            part = write.intersect(link.model_box) if write.sizes else write
            if part is None:
                continue
            if link.model_box.sizes and part.sizes:
                hf = link.to_hf(part)
            else:
                hf = link.hf_box
            out.append(Part(index, hf, part, view, link, plan.outputs[index].dtype))
    return out
