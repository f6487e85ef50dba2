"""Shared pieces of the FSDP1 tests: the torch reference beside ours, and comparisons."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fully_shard import FullyShardedDataParallel as FSDP
from fully_shard import compat
from tests.wrap.note import note_code, run_note


def torch_fsdp() -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    return TorchFSDP


def both_note_models(*, strategy: str = "FULL_SHARD", dtype: str | None = "bfloat16", mesh: Any = None,
                     extra: str = "", scope: dict[str, Any] | None = None) -> tuple[nn.Module, nn.Module]:
    """(ours: the note's code with this library's imports, torch's: the same code with torch's FSDP1,
    which needs ``device_id`` to start without a GPU). ``extra``: more arguments, naming ``scope``'s."""
    assert not compat.is_patched()
    names = {"mesh": mesh, **(scope or {})}
    mesh_arg = ", device_mesh=mesh" if mesh is not None else ""
    ours = run_note(note_code(strategy=strategy, dtype=dtype, ours=True,
                              extra=(extra + mesh_arg).lstrip(", ")), **names)
    theirs = run_note(note_code(strategy=strategy, dtype=dtype,
                                extra=f"device_id=torch.device('cpu'){mesh_arg}{', ' + extra if extra else ''}"),
                      **names)
    assert isinstance(ours, FSDP) and type(theirs) is torch_fsdp()
    return ours, theirs


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """FULL_STATE_DICT of either FSDP (torch's enum: ours reads it too)."""
    from torch.distributed.fsdp import StateDictType

    with type(model).state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@contextlib.contextmanager
def shared_dir() -> Generator[str, None, None]:
    """A directory every rank sees (rank 0 makes it, removes it after every rank is done)."""
    path = [tempfile.mkdtemp(prefix="fsdp1-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def rel_diffs(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
