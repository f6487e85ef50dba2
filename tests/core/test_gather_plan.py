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


class _Mixed(nn.Module):
    """A bf16 unit keeping its norm and a 0-dim scale in fp32 (param_dtype_override_fn): 5 rows, padded on
    rank 1; the 0-dim scale is staged (one slot per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.norm = nn.LayerNorm(5)
        self.scale = nn.Parameter(torch.tensor(0.75))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x).float()) * self.scale


@distributed(world_size=2)
def _bytes_unshard() -> dict[str, Any]:
    from fully_shard import MixedPrecisionPolicy
    from fully_shard.core.gather_plan import GatherVariant

    torch.manual_seed(0)
    ref = _Mixed()
    with torch.no_grad():
        ref.norm.weight.uniform_(0.5, 1.5)  # (not all ones: a wrong byte offset would show)
        ref.norm.bias.uniform_(-1, 1)
    model = copy.deepcopy(ref)
    norm_ids = {id(p) for p in model.norm.parameters()} | {id(model.scale)}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  param_dtype_override_fn=lambda p: torch.float32 if id(p) in norm_ids else None)
    fully_shard(model, mp_policy=policy)
    model(torch.randn(3, 4)).sum().backward()  # lazy init, the plan built
    group = get_state(model).group  # type: ignore[union-attr]
    assert group is not None and group.gather_plan is not None
    files: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and "/fully_shard/" in frame.f_code.co_filename:
            files.append(frame.f_code.co_filename.rsplit("/fully_shard/", 1)[1] + ":" + frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        group.unshard()
        group.wait_for_unshard()
    finally:
        sys.setprofile(None)
    gathered = {n: (p.dtype, torch.equal(p.detach(), dict(ref.named_parameters())[n].detach().to(p.dtype)))
                for n, p in model.named_parameters()}
    nbytes = group.gather_plan.nbytes
    group.reshard()
    return {"variant": group.gather_plan.variant is GatherVariant.BYTES, "files": files, "gathered": gathered,
            "nbytes": nbytes}


def test_a_unit_of_several_dtypes_gathers_bytes() -> None:
    """param_dtype_override_fn keeping a norm and a 0-dim scale in fp32 in a bf16 unit: the plan is built as
    the bytes variant, an unshard calls no ShardedParam method, and every gathered parameter equals the
    original cast to its own dtype (padding and the staged 0-dim slot included); the buffer is each padded
    shard at its dtype: weight 3 rows x 4 + bias 3 at bf16, norm 3 + 3 and the scale at fp32, per rank."""
    bf16, fp32 = torch.bfloat16, torch.float32
    for rank, r in enumerate(_bytes_unshard()):
        assert r["variant"], (rank, r)
        assert not [f for f in r["files"] if f.startswith("core/param.py")], (rank, r["files"])
        assert r["gathered"] == {"lin.weight": (bf16, True), "lin.bias": (bf16, True), "norm.weight": (fp32, True),
                                 "norm.bias": (fp32, True), "scale": (fp32, True)}, (rank, r["gathered"])
        assert r["nbytes"] == 2 * ((12 + 3) * 2 + (3 + 3 + 1) * 4), (rank, r["nbytes"])
