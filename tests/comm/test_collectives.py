"""``collectives.issue_at_world_one``: one rank issues its all-gathers and reduce-scatters as collectives
(the GPU check's real NCCL kernels on the side streams at world 1), with the same results as without."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from fully_shard.comm import collectives
from tests.core.common import shard_gpt
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


@distributed(world_size=1)
def _world_one(issue: bool, hsdp: bool) -> dict[str, Any]:
    previous = collectives.issue_at_world_one(issue)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")) if hsdp else None
        model = shard_gpt(TinyGPT(), mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        with CountCollectives() as counted:
            for x, y in batches(2, batch=4):
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    finally:
        assert collectives.issue_at_world_one(previous) is issue
    return {"counts": dict(counted.counts), "losses": losses, "params": params}


def test_issue_at_world_one() -> None:
    for hsdp in (False, True):
        off, on = _world_one(False, hsdp)[0], _world_one(True, hsdp)[0]
        assert "all_gather" not in off["counts"] and "reduce_scatter" not in off["counts"], off["counts"]
        # 2 steps: 4 units gathered in forward, the 3 blocks again in backward; 4 reduce-scatters each
        assert on["counts"].get("all_gather") == 2 * (4 + 3), on["counts"]
        assert on["counts"].get("reduce_scatter") == 2 * 4, on["counts"]
        assert on["counts"].get("all_reduce", 0) == off["counts"].get("all_reduce", 0) == (8 if hsdp else 0)
        assert on["losses"] == off["losses"]
        for name, p in on["params"].items():
            assert torch.equal(p, off["params"][name]), name
