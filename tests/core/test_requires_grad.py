"""Freezing and unfreezing parameters between steps (``requires_grad_``), side by side with torch's fully_shard.

torch re-reads ``sharded_param.requires_grad`` at every unshard (the unsharded parameter takes it) and reduces
only the parameters that require grad; so does this library (design/param-lifecycle.md, "requires_grad"):
a parameter frozen after the first step gets no gradient and the optimizer leaves it alone, one unfrozen
after the first step trains from the next one on, and the group's reduce plan is rebuilt for the new set of
reduced parameters (design/data-path.md, "Host work per step")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fully_shard import fully_shard
from fully_shard.core.state import get_state
from tests.distributed.harness import distributed

STEPS = 3
# what changes after the first step: (parameters frozen from the start, parameters whose flag flips)
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "freeze": ((), ("0.weight",)),  # one parameter of a unit: the unit still reduces its bias
    "unfreeze": (("0.weight",), ("0.weight",)),
    "freeze_unit": ((), ("1.weight", "1.bias")),  # a whole unit: it reduces nothing
    "unfreeze_unit": (("1.weight", "1.bias"), ("1.weight", "1.bias")),
}


def _train(shard: Callable[..., Any], frozen: tuple[str, ...], flipped: tuple[str, ...]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 4))  # 3 units + the root (no params)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    for layer in model:
        shard(layer)
    shard(model)
    params = dict(model.named_parameters())  # the sharded parameters (the user flips these)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # every parameter, frozen or not (as fine-tuning code does)
    rank = dist.get_rank()
    steps: list[dict[str, Any]] = []
    plans: list[Any] = []
    for step in range(STEPS):
        if step == 1:
            for name in flipped:
                params[name].requires_grad_(not params[name].requires_grad)
        torch.manual_seed(10 * step + rank)  # another batch per rank and step
        loss = model(torch.randn(5, 6)).pow(2).mean()
        loss.backward()
        grads = {n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        steps.append({"loss": loss.detach(), "grads": grads,
                      "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
                      "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()}})
        state = get_state(model[0]) if shard is fully_shard else None
        if state is not None:
            plans.append(state.groups[0].reducer._plan)
    return {"steps": steps, "plans": plans}


@distributed(world_size=2)
def _side_by_side(case: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    frozen, flipped = CASES[case]
    ours = _train(fully_shard, frozen, flipped)
    plans = ours.pop("plans")
    # unit 0's plan: rebuilt when the set of its reduced parameters changed (after step 0), kept otherwise
    ours["plan_rebuilt"] = plans[1] is not plans[0]
    ours["plan_kept"] = plans[2] is plans[1]
    return {"ours": ours, "torch": _train(torch_fully_shard, frozen, flipped)}


@pytest.mark.parametrize("case", list(CASES))
def test_requires_grad_changed_between_steps_matches_torch(case: str) -> None:
    frozen, flipped = CASES[case]
    for rank, out in enumerate(_side_by_side(case)):
        ours, ref = out["ours"], out["torch"]
        for step, (mine, theirs) in enumerate(zip(ours["steps"], ref["steps"])):
            where = (case, rank, step)
            assert mine["requires_grad"] == theirs["requires_grad"], where
            assert torch.equal(mine["loss"], theirs["loss"]), (where, mine["loss"], theirs["loss"])
            for name, grad in theirs["grads"].items():
                got = mine["grads"][name]
                # torch: no gradient exactly where the parameter did not require grad in that step
                assert (got is None) == (grad is None), (where, name, got is None, grad is None)
                assert grad is None or torch.equal(got, grad), (where, name, got, grad)
            for name, value in theirs["params"].items():
                assert torch.equal(mine["params"][name], value), (where, name)
            expected = {n: (n not in frozen) != (n in flipped and step >= 1) for n in theirs["requires_grad"]}
            assert theirs["requires_grad"] == expected, where
            assert {n for n, g in theirs["grads"].items() if g is None} == {n for n, r in expected.items() if not r}, \
                (where, theirs["grads"])
        if "0.weight" in flipped:
            assert ours["plan_rebuilt"], (case, rank)
        assert ours["plan_kept"], (case, rank)
