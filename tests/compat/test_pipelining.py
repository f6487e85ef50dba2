"""torch.distributed.pipelining with FSDP inside each stage, after ``patch_torch()``: a 2-stage
pipeline x 2-way data parallel (4 gloo ranks), the same pipeline over torch's fully_shard side by
side, and an unsharded one-process reference of the whole model.

Pipelining drives each stage's FSDP root itself: before every microbatch's backward it turns off
``set_is_last_backward`` / ``set_reshard_after_backward`` / ``set_requires_gradient_sync``, and after
the last one (``perform_reduce_grad``) turns them on, calls ``post_backward()`` on every param group
of ``fully_shard.state(root)._state_ctx.all_states`` and runs ``_root_post_backward_final_callback()``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fully_shard import FSDPModule, compat
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed

TOL = 1e-6
DIM, BATCH, MICRO, STEPS = 16, 8, 2, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Stage(nn.Module):
    """One pipeline stage: two residual blocks (the last stage adds a head)."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 3) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.head(x) if self.head is not None else x


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 3, generator=g)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in module.named_parameters() if p.grad is not None}


def _run_pipeline(shard: Any, schedule_name: str, stages: list[Stage], mesh: Any) -> dict[str, Any]:
    """Build this rank's stages with ``shard`` (imported from torch.distributed.fsdp by the caller),
    train STEPS steps; return the last stage's losses and this rank's stages' grads after every step.
    Single-stage schedules: stage ``pp_rank``; looped ones: stages ``pp_rank, pp_rank + 2, ...``."""
    import torch.distributed.fsdp as torch_fsdp  # its FSDPModule is ours while patched
    from torch.distributed import pipelining

    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    indices = list(range(pp_rank, len(stages), 2))
    models = [copy.deepcopy(stages[i]) for i in indices]
    for model in models:
        for blk in model.blocks:
            shard(blk, mesh=mesh["dp"], reshard_after_forward=False)
        shard(model, mesh=mesh["dp"])
    built = [pipelining.PipelineStage(m, i, len(stages), torch.device("cpu"), group=mesh["pp"].get_group())
             for m, i in zip(models, indices)]
    cls = getattr(pipelining, schedule_name)
    schedule = cls(built if len(stages) > 2 else built[0], n_microbatches=MICRO, loss_fn=_loss)
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    out: dict[str, Any] = {"losses": [], "grads": [], "counts": [],
                           "fsdp": all(isinstance(m, torch_fsdp.FSDPModule) for m in models),
                           "ours": all(isinstance(m, FSDPModule) for m in models)}
    per = BATCH // 2
    for step in range(STEPS):
        x, y = _data(step)
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        losses: list[torch.Tensor] = []
        with CountCollectives() as counted:
            if pp_rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
        out["counts"].append(dict(counted.counts))
        out["losses"].append([loss.item() for loss in losses])
        out["grads"].append({f"{i}.{k}": v for i, m in zip(indices, models) for k, v in _grads(m).items()})
        opt.step()
        opt.zero_grad()
    return out


def _reference(stages: list[Stage]) -> dict[str, Any]:
    """The whole model unsharded on the global batch: mean over microbatches of the mean losses is
    the global mean (equal sizes), so its grads are the pipeline's (averaged over dp)."""
    ref = nn.Sequential(*copy.deepcopy(stages))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out: dict[str, Any] = {"grads": []}
    for step in range(STEPS):
        x, y = _data(step)
        _loss(ref(x), y).backward()
        out["grads"].append({f"{i}.{k}": v for i in range(len(stages)) for k, v in _grads(ref[i]).items()})
        opt.step()
        opt.zero_grad()
    return out


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


@distributed(world_size=4)
def _pipeline_side_by_side(schedule_name: str, n_stages: int) -> dict[str, Any]:
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard

    assert not compat.is_patched()  # the pool's processes are reused: every test unpatches in finally
    torch.manual_seed(0)
    stages = [Stage(last=i == n_stages - 1) for i in range(n_stages)]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    want = _run_pipeline(torch_fully_shard, schedule_name, stages, mesh)
    compat.patch_torch()
    try:
        from torch.distributed.fsdp import fully_shard as patched

        assert patched is compat.fully_shard
        got = _run_pipeline(patched, schedule_name, stages, mesh)
    finally:
        compat.unpatch_torch()
    ref = _reference(stages)
    pp_rank = mesh["pp"].get_local_rank()
    assert got["fsdp"] and want["fsdp"]  # pipelining took its FSDP path in both runs
    assert got["ours"] and not want["ours"]
    loss_diff = max((abs(a - b) for ga, gb in zip(got["losses"], want["losses"]) for a, b in zip(ga, gb)),
                    default=0.0)
    grad_torch = max(_worst(g, w) for g, w in zip(got["grads"], want["grads"]))
    grad_ref = max(_worst(g, {k: v for k, v in r.items() if k in g}) for g, r in zip(got["grads"], ref["grads"]))
    if pp_rank == 1:
        assert len(got["losses"][0]) == MICRO
    # No-sync microbatches: one reduce-scatter per unit and step, as torch (step 1 carries the
    # pipeline's metadata inference and our lazy-init checks).
    assert got["counts"][1:] == want["counts"][1:], (got["counts"], want["counts"])
    result = {"counts": got["counts"][-1], "loss_vs_torch": loss_diff, "grad_vs_torch": grad_torch,
              "grad_vs_ref": grad_ref}
    assert max(loss_diff, grad_torch, grad_ref) < TOL, result
    dist.barrier()
    return result


@pytest.mark.parametrize(("schedule_name", "n_stages"), [("ScheduleGPipe", 2), ("Schedule1F1B", 2),
                                                         ("ScheduleInterleaved1F1B", 4),
                                                         ("ScheduleInterleavedZeroBubble", 4)])
def test_pipeline_with_fsdp_stages_matches_torch(schedule_name: str, n_stages: int) -> None:
    results = _pipeline_side_by_side(schedule_name, n_stages)
    print(schedule_name, results[0]["counts"], {k: max(r[k] for r in results) for k in results[0] if k != "counts"})
