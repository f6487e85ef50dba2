"""Checks that keep ranks from running mismatched collectives: same fully_shard calls on every rank
(at fully_shard() time), nothing on meta (at root lazy init).

See design/hooks.md (structure check). A model built or wrapped differently on one rank would make
the collectives abort (gloo), hang (NCCL) or mix up bytes; a meta tensor would be all-gathered as
garbage.
"""

from __future__ import annotations

import difflib
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import collectives
from ..parallel.mesh import MeshInfo


def describe_call(modules: tuple[nn.Module, ...], owners: dict[int, str], *, title: str) -> list[str]:
    """One line per parameter under ``modules`` (FQN, shape, dtype, the unit that manages it and how)
    after ``title`` (the call and its settings): everything every rank's collectives depend on.

    ``owners``: id(parameter) -> ``unit=<name> Shard(d)`` for this call's and nested units' params."""
    lines = [title]
    for i, module in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for name, p in module.named_parameters():
            lines.append(f"{prefix}{name}: {tuple(p.shape)} {p.dtype} {owners.get(id(p), 'not managed')}")
    return lines


def check_same_call(desc: list[str], mesh_info: MeshInfo, device: torch.device) -> None:
    """Every rank of the mesh must make the same fully_shard call: compare an 8-byte digest of
    ``desc`` across the shard group, then (with the shard group's verdict) across the replicate
    group: one tiny fixed-size all-gather per mesh dim of more than one rank, at fully_shard() time.
    Every rank reaches the same verdict (see design/hooks.md), so a mismatch raises a diff on every
    rank instead of hanging some of them."""
    digest = int.from_bytes(hashlib.blake2b("\n".join(desc).encode(), digest_size=7).digest(), "little")
    ok = True
    if mesh_info.shard_world > 1:
        every = _gather([digest], mesh_info.shard_group, mesh_info.shard_world, device)
        ok = bool((every[:, 0] == digest).all())
    if mesh_info.replicate_group is not None and mesh_info.replicate_world > 1:
        every = _gather([digest, int(ok)], mesh_info.replicate_group, mesh_info.replicate_world, device)
        ok = bool((every[:, 0] == every[0, 0]).all() and every[:, 1].all())
    if not ok:
        _raise_diff(desc, mesh_info)


def _gather(values: list[int], group: dist.ProcessGroup, world: int, device: torch.device) -> torch.Tensor:
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = torch.empty(world * len(values), dtype=torch.int64, device=device)
    collectives.all_gather_into(every, mine, group)
    return every.view(world, len(values)).cpu()


def _raise_diff(desc: list[str], mesh_info: MeshInfo) -> None:
    """Error path only: every rank fetches the descriptions over each group of its mesh (the same
    calls on every rank) and raises with the first difference it can see."""
    diff, where = "", ""
    for group, world, axis in ((mesh_info.shard_group, mesh_info.shard_world, "shard"),
                               (mesh_info.replicate_group, mesh_info.replicate_world, "replicate")):
        if group is None or world == 1:
            continue
        descs = collectives.all_gather_object(desc, group)
        bad = next((r for r, d in enumerate(descs) if d != descs[0]), None)
        if bad is not None and not diff:
            where = f"{axis} group rank {bad} vs rank 0 of {world}"
            diff = "\n".join(difflib.unified_diff(descs[0], descs[bad], "rank 0", f"rank {bad}", lineterm=""))
    raise RuntimeError(
        f"fully_shard was called differently across ranks "
        f"({where or 'in another group of this mesh; the ranks of that group show the diff'}): "
        "every rank must build the same parameters (shapes, dtypes) and make the same fully_shard calls, "
        f"in the same order, with the same unit boundaries, or the collectives would abort or hang.\n{diff}\n"
        "Fix: build and wrap the model identically on every rank (same config, same fully_shard calls, "
        "children first then the root; seed only the init).")


def check_not_meta(module: nn.Module) -> None:
    meta = [name for name, p in module.named_parameters() if p.is_meta]
    meta += [name for name, b in module.named_buffers() if b.is_meta]
    if meta:
        shown = ", ".join(meta[:8]) + (f", ... ({len(meta)} in all)" if len(meta) > 8 else "")
        raise RuntimeError(
            f"forward on a module whose parameters/buffers are still on the meta device: {shown}. "
            "Fix: after fully_shard, call model.to_empty(device=...) and initialize them "
            "(e.g. reset_parameters() per module, or fully_shard.init.materialize_meta_module(model)).")
