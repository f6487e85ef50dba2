"""fp16 gradient reduction as torch 2.13 does it: SUM with the division split around the collective.

Side by side with torch's ``fully_shard`` on gloo (fp32 params, ``reduce_dtype=float16``): gradients
equal after one backward and parameters after three Adam steps; two ranks each holding a gradient of
40000 reduce to 40000 (an AVG that sums first, as gloo's, overflows fp16 to inf).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import MixedPrecisionPolicy
from tests.core.pairs import LIBS
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.policies.common import local_slice

FP16_REDUCE = MixedPrecisionPolicy(reduce_dtype=torch.float16)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(lib: str, ref: nn.Module, steps: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    shard = LIBS[lib]()
    model = copy.deepcopy(ref)
    for block in model.blocks:  # type: ignore[attr-defined]
        shard(block, mp_policy=FP16_REDUCE)
    shard(model, mp_policy=FP16_REDUCE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first: dict[str, torch.Tensor] = {}
    for step, (x, y) in enumerate(batches(steps, batch=8)):
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
        if step == 0:
            first = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return first, {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


@distributed(world_size=2)
def _side_by_side() -> dict[str, Any]:
    torch.manual_seed(0)
    ref = TinyGPT(zero_dim=False)  # torch's fully_shard refuses 0-dim parameters
    ours_grads, ours_params = _train("ours", ref, 3)
    torch_grads, torch_params = _train("torch", ref, 3)
    return {"grad_diff": max((ours_grads[n] - torch_grads[n]).abs().max().item() for n in torch_grads),
            "param_diff": max((ours_params[n] - torch_params[n]).abs().max().item() for n in torch_params),
            "names": sorted(ours_grads) == sorted(torch_grads)}


def test_fp16_reduction_equals_torch() -> None:
    for r in _side_by_side():
        assert r["names"], r
        assert r["grad_diff"] == 0.0, r
        assert r["param_diff"] == 0.0, r


@distributed(world_size=2)
def _large_gradients() -> dict[str, float]:
    out = {}
    for lib in ("ours", "torch"):
        model = nn.Linear(4, 4, bias=False)
        LIBS[lib]()(model, mp_policy=FP16_REDUCE)
        model(torch.full((1, 4), 40000.0)).sum().backward()  # every element of each rank's grad: 40000
        out[lib] = float(_full(model.weight.grad).max())
    dist.barrier()
    return out


def test_large_fp16_gradients_do_not_overflow() -> None:
    for r in _large_gradients():
        assert r["torch"] == 40000.0, r  # 2 ranks x 40000, divided by 2
        assert r["ours"] == r["torch"], r
