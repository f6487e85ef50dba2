"""Collective counts side by side with torch's fully_shard (dispatcher level): forward and backward
issue exactly torch's collectives, at world size 2, on a (2, 1) NO_SHARD-like mesh, and none at all
at world size 1; the same-call check runs at fully_shard() time (design/hooks.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import fully_shard
from tests.core.common import local_slice
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


def _run(fs: Any, raf: bool | int | None, hsdp: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")) \
        if hsdp else None
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2, zero_dim=False)  # torch's fully_shard shards no 0-dim parameter
    with CountCollectives() as build:
        for blk in model.blocks:
            fs(blk, reshard_after_forward=raf, mesh=mesh)
        fs(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps, grads = [], {}
    for i, (x, y) in enumerate(batches(2, batch=4)):
        with CountCollectives() as fwd:
            loss = loss_fn(model(local_slice(x)), local_slice(y))
        with CountCollectives() as bwd:
            loss.backward()
        if i == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        steps.append((dict(fwd.counts), dict(bwd.counts), loss.item()))
    return {"build": dict(build.counts), "steps": steps, "grads": grads}


def _side_by_side(raf: bool | int | None, hsdp: bool = False) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    return {"ours": _run(fully_shard, raf, hsdp), "torch": _run(torch_fully_shard, raf, hsdp)}


@distributed(world_size=2)
def _w2(raf: bool | int | None, hsdp: bool) -> dict[str, Any]:
    return _side_by_side(raf, hsdp)


@distributed(world_size=1)
def _w1(raf: bool | int | None) -> dict[str, Any]:
    return _side_by_side(raf)


def _check(r: dict[str, Any]) -> None:
    ours, ref = r["ours"], r["torch"]
    for (fwd, bwd, loss), (t_fwd, t_bwd, t_loss) in zip(ours["steps"], ref["steps"]):
        assert fwd == t_fwd and bwd == t_bwd, (ours["steps"], ref["steps"])
        assert abs(loss - t_loss) < 1e-6, (loss, t_loss)
    assert ours["grads"].keys() == ref["grads"].keys()
    for name, g in ours["grads"].items():
        t = ref["grads"][name]
        assert g.dtype == t.dtype and g.is_contiguous() == t.is_contiguous(), name
        torch.testing.assert_close(g, t, atol=1e-6, rtol=0)
    assert ref["build"] == {}, ref["build"]


@pytest.mark.parametrize("raf", [True, False, None])
def test_counts_equal_torch_at_world_size_2(raf: bool | None) -> None:
    for r in _w2(raf, False):
        _check(r)
        fwd, _, _ = r["ours"]["steps"][0]
        assert fwd == {"all_gather": 3}, fwd  # 2 blocks + root, torch's count (was 4 with lazy init's check)
        assert r["ours"]["build"] == {"all_gather": 3}, r["ours"]["build"]  # the same-call check, per call


def test_no_collective_at_world_size_1() -> None:
    for raf in (True, None):
        for r in _w1(raf):
            _check(r)
            assert r["ours"]["build"] == {}, r["ours"]["build"]
            for fwd, bwd, _ in r["ours"]["steps"]:
                assert fwd == {} and bwd == {}, (fwd, bwd)


def test_one_rank_shard_groups_only_all_reduce() -> None:
    for r in _w2(True, True):
        _check(r)
        for fwd, bwd, _ in r["ours"]["steps"]:
            assert fwd == {} and bwd == {"all_reduce": 3}, (fwd, bwd)
        assert r["ours"]["build"] == {"all_gather": 3}, r["ours"]["build"]  # over the replicate group
