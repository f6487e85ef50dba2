"""A group's ``GatherPlan`` (core/gather_plan.py): no ``ShardedParam`` method per unshard, the local shards read at
each copy-in (a ``swap_tensors`` is seen), and the plan built again when what it fixed changes (design/data-path.md,
"Unshard")."""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
import torch.nn as nn

from fully_shard import fully_shard
from fully_shard.core.state import get_state
from tests.distributed.harness import distributed


def _models() -> tuple[nn.Module, nn.Module]:
    """A 2-block model (5 rows: padded on rank 1) sharded per block and at the root, and its unsharded copy."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 4))
    model = copy.deepcopy(ref)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, ref


@distributed(world_size=2)
def _files_of_an_unshard() -> list[str]:
    model, _ = _models()
    x = torch.randn(3, 4)
    model(x).sum().backward()  # lazy init, the plans built
    group = get_state(model[0]).group  # type: ignore[union-attr]
    assert group is not None
    group.reshard()
    files: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and "/fully_shard/" in frame.f_code.co_filename:
            files.append(frame.f_code.co_filename.rsplit("/fully_shard/", 1)[1] + ":" + frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        group.unshard()
        group.wait_for_unshard()
        group.reshard()
    finally:
        sys.setprofile(None)
    return files


def test_an_unshard_calls_no_sharded_param_method() -> None:
    """Copy-in, copy-out, the storages' allocation and freeing and the modules' slots are the plan's and the
    group's own loops: no call into core/param.py per parameter."""
    for rank, files in enumerate(_files_of_an_unshard()):
        assert any(f.startswith("core/gather_plan.py:GatherPlan.copy_in") for f in files), (rank, files)
        assert not [f for f in files if f.startswith("core/param.py")], (rank, files)


@distributed(world_size=2)
def _after_swap() -> dict[str, Any]:
    model, ref = _models()
    x = torch.randn(3, 4)
    model(x).sum().backward()  # the plans built, holding the sharded parameters
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone() * 1.5))  # new local shards
            q.mul_(1.5)
    out = model(x)
    return {"same": torch.equal(out, ref(x)), "max_diff": float((out - ref(x)).abs().max())}


def test_the_copy_in_reads_the_local_shards_a_swap_put_in_place() -> None:
    """``torch.utils.swap_tensors`` on a sharded parameter after the plan was built: the next all-gather
    moves the new values (the plan holds the DTensor, not its local tensor)."""
    for rank, r in enumerate(_after_swap()):
        assert r["same"], (rank, r)


@distributed(world_size=2)
def _custom_all_gather_after_a_step() -> dict[str, Any]:
    model, ref = _models()
    x = torch.randn(3, 4)
    model(x).sum().backward()

    class Counting:
        def __init__(self) -> None:
            self.allocated = self.called = 0

        def allocate(self, size: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            self.allocated += 1
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            self.called += 1
            return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                                            async_op=async_op)

    comm = Counting()
    model[0].set_custom_all_gather(comm)  # type: ignore[operator]
    out = model(x)
    return {"allocated": comm.allocated, "called": comm.called, "same": torch.equal(out, ref(x))}


def test_set_custom_all_gather_after_a_step_takes_effect() -> None:
    """The plan binds the all-gather and its allocator: set after the first step, they are used from the
    next unshard on (the plan is built again)."""
    for rank, r in enumerate(_custom_all_gather_after_a_step()):
        assert r["allocated"] >= 1 and r["called"] >= 1 and r["same"], (rank, r)
