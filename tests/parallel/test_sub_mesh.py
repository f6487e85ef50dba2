"""Which meshes a parameter may take with ``shard_placement_fn`` (design/experts.md): its gradient must be
reduced over exactly the call's data-parallel ranks, which the default divisor assumes (4 gloo ranks).

A plain parameter on ``sparse["efsdp"]`` (2 of the 4 dense ranks) would get the sum over 2 ranks divided by
4, a different sum on each efsdp group (the replicas diverge): refused at ``fully_shard()``, with the
arithmetic, the module left as it was. torch's fully_shard accepts that call (it averages over efsdp)
and its ranks' gradients differ from the mean and from each other: checked side by side, as the reason.
Accepted: a plain parameter on another mesh over the same ranks (an HSDP (2, 2) mesh over the 4 dense
ranks), which gives the mean gradient. An expert whose FSDP mesh times its expert-parallel mesh misses
ranks is refused too; the legitimate expert layouts run in test_experts.py."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fully_shard import ShardPlacement, fully_shard
from tests.distributed.harness import distributed
from tests.parallel.moe_common import MoEModel, expert_parallel, sparse_meshes
from tests.torch_ref import lacks_name

TORCH_NO_PLACEMENT_RESULT = lacks_name("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult")


def _attempt(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _mean_grad(base: nn.Linear, shard: Callable[[nn.Linear], Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's full weight gradient of ``base`` sharded by ``shard``, the single-process gradient of the
    mean of the 4 ranks' mean losses)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    xs = torch.randn(world, 3, 4, generator=torch.Generator().manual_seed(7))
    ref = copy.deepcopy(base)
    torch.stack([ref(x).pow(2).mean() for x in xs]).mean().backward()
    model = shard(copy.deepcopy(base))
    model(xs[rank]).pow(2).mean().backward()
    grad = model.weight.grad
    assert ref.weight.grad is not None and grad is not None
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad), ref.weight.grad


@distributed(world_size=4)
def _sub_meshes() -> dict[str, Any]:
    dense, efsdp, _ = sparse_meshes(2, 2)  # dense dp=4; efsdp: ranks {0, 2} and {1, 3}
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    base = nn.Linear(4, 4)

    lin = copy.deepcopy(base)
    weight = lin.weight
    out["plain"] = _attempt(lambda: fully_shard(lin, mesh=dense, shard_placement_fn=lambda p: (
        ShardPlacement(Shard(0), mesh=efsdp) if p is weight else None)))
    out["unchanged"] = (type(lin) is nn.Linear and lin.weight is weight and not isinstance(weight, DTensor)
                        and torch.equal(weight, base.weight))

    if not TORCH_NO_PLACEMENT_RESULT:  # torch's fully_shard runs the same call
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

        info = _get_mesh_info(efsdp)

        def torch_shard(m: nn.Linear) -> Any:
            return torch_fully_shard(m, mesh=dense, shard_placement_fn=lambda p: (
                ShardPlacementResult(Shard(0), info) if p.dim() == 2 else None))

        out["torch"] = _mean_grad(base, torch_shard)

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # the same 4 ranks

    def same_ranks(m: nn.Linear) -> Any:
        return fully_shard(m, mesh=dense, shard_placement_fn=lambda p: (
            ShardPlacement(Shard(0), mesh=hsdp) if p.dim() == 2 else None))

    out["same_ranks"] = _mean_grad(base, same_ranks)

    # an expert on an EP mesh of 2 ranks with a one-rank FSDP mesh: 2 of the 4 data-parallel ranks (dim names
    # of their own: torch hands out a cached sub-mesh of an equal earlier root for equal names and ranks)
    root = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("sub_x", "sub_ep", "sub_one"))
    moe = expert_parallel(MoEModel(4, 1), root["sub_ep"])
    out["expert"] = _attempt(lambda: fully_shard(moe.layers[0], mesh=dense, shard_placement_fn=lambda p: (
        ShardPlacement(Shard(0), mesh=root["sub_one"]) if isinstance(p, DTensor) else None)))
    return out


def test_parameter_on_a_mesh_that_misses_data_parallel_ranks_is_refused() -> None:
    results = _sub_meshes()
    for rank, out in enumerate(results):
        plain = out["plain"]
        mine = sorted({0, 2} if rank % 2 == 0 else {1, 3})
        assert plain.startswith("parameter 'weight': shard_placement_fn put it on (efsdp=2)"), (rank, plain)
        for part in (f"ranks {mine}", "data-parallel ranks are [0, 1, 2, 3]", "summed over 2 ranks and divided by 4",
                     "(2/4 of the mean gradient)", "the replicas diverge", "Fix: return None"):
            assert part in plain, (rank, part, plain)
        assert out["unchanged"], rank
        expert = out["expert"]
        for part in ("parameter 'experts.w1' is a DTensor on (sub_ep=2)", "put it on (sub_one=1)", "miss ranks",
                     "summed over 2 ranks and divided by 4", "efsdp = dp // ep"):
            assert part in expert, (rank, part, expert)
        grad, ref = out["same_ranks"]
        torch.testing.assert_close(grad, ref)
    if TORCH_NO_PLACEMENT_RESULT:
        pytest.skip(TORCH_NO_PLACEMENT_RESULT)
    torch_grads = [out["torch"][0] for out in results]
    ref = results[0]["torch"][1]
    for rank, grad in enumerate(torch_grads):  # torch: not the mean, and another value per efsdp group
        assert (grad - ref).abs().max() > 1e-2, (rank, grad, ref)
    assert torch.equal(torch_grads[0], torch_grads[2]) and torch.equal(torch_grads[1], torch_grads[3])
    assert (torch_grads[0] - torch_grads[1]).abs().max() > 1e-2
