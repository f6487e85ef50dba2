"""Checks at root lazy init, before the first collective: same model on every rank, nothing on meta.

See design/hooks.md (lazy init). A model that differs across ranks would make the collectives hang
or mix up bytes; a meta tensor would be all-gathered as garbage.
"""

from __future__ import annotations

import difflib
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

from . import collectives


def check_same_structure(module: nn.Module, device: torch.device, group: dist.ProcessGroup) -> None:
    """Every rank must shard the same parameters with the same shapes, or the collectives would hang
    or mix up bytes; compare a digest across ranks once, at lazy init, and show a diff if it differs."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    desc = [f"{name}: {tuple(p.shape)} {p.dtype}" for name, p in module.named_parameters()]
    digest = int.from_bytes(hashlib.blake2b("\n".join(desc).encode(), digest_size=7).digest(), "little")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = torch.empty(world, dtype=torch.int64, device=device)
    collectives.all_gather_into(every, mine, group)
    if bool((every == every[0]).all()):
        return
    descs = collectives.all_gather_object(desc, group)  # error path only: fetch the structures to show a diff
    bad = next(r for r, d in enumerate(descs) if d != descs[0])
    diff = "\n".join(difflib.unified_diff(descs[0], descs[bad], "rank 0", f"rank {bad}", lineterm=""))
    raise RuntimeError(
        f"the model differs across ranks (group rank {bad} vs group rank 0): fully_shard needs every rank to build the "
        f"same parameters with the same shapes and dtypes ({world} ranks in this mesh dimension).\n{diff}\n"
        "Fix: build the model identically on every rank (same config; seed only the init).")


def check_not_meta(module: nn.Module) -> None:
    meta = [name for name, p in module.named_parameters() if p.is_meta]
    meta += [name for name, b in module.named_buffers() if b.is_meta]
    if meta:
        shown = ", ".join(meta[:8]) + (f", ... ({len(meta)} in all)" if len(meta) > 8 else "")
        raise RuntimeError(
            f"forward on a module whose parameters/buffers are still on the meta device: {shown}. "
            "Fix: after fully_shard, call model.to_empty(device=...) and initialize them "
            "(e.g. reset_parameters() per module, or fully_shard.init.materialize_meta_module(model)).")
