"""The reduce side's ``ReducePlan`` (core/reduce_plan.py): built once per group and kept across steps, rebuilt
when a setting it fixed changes (a stale plan would silently keep the old scaling or collective), and the
Python work of one unit's post-backward it leaves (design/data-path.md, "Host work per step")."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fully_shard as fully_shard_package
from fully_shard import FSDPModule, fully_shard
from fully_shard.core.state import get_state
from tests.distributed.harness import distributed

Change = Callable[[FSDPModule], None]
# Measured on torch 2.13, 2.14.1, 2.15.0 and 2.11.0 alike. ``Reducer._take_row`` is not counted: it runs in
# gloo's thread when the all-reduce ends after its callback was chained, inline (here) when before, a race
# (design/data-path.md).
OUR_CALLS = 46


def _model(mesh: Any = None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # 4 rows: no padding over 2 ranks (the cat copy-in)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _step(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """One backward on this rank's input; the sharded grads (None where no reduce assigned one), cleared."""
    torch.manual_seed(1 + rank)
    model(torch.randn(3, 4)).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = None if p.grad is None else p.grad.to_local().clone()
        p.grad = None
    return grads


def _changed_after_first_step(change: Change, mesh: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The second step's grads of a model whose units got ``change`` after its first step, and of a model
    that had it from the start (its plans built with it)."""
    rank = torch.distributed.get_rank()
    late = _model(mesh)
    _step(late, rank)
    for unit in _units(late):
        change(unit)
    early = _model(mesh)
    for unit in _units(early):
        change(unit)
    _step(early, rank)
    return _step(late, rank), _step(early, rank)


def _plans(model: nn.Module) -> list[Any]:
    return [g.reducer._plan for unit in _units(model) for g in get_state(unit).groups]  # type: ignore[union-attr]


_CHANGES: dict[str, Change] = {
    "divide_factor": lambda m: m.set_gradient_divide_factor(1.0),  # SUM collectives, no division
    "force_sum": lambda m: m.set_force_sum_reduction_for_comms(True),  # SUM, then / world
    "no_sync": lambda m: m.set_requires_gradient_sync(False),  # no reduce: grads stay unsharded
}


@distributed(world_size=2)
def _settings_changed_after_the_first_step() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, change in _CHANGES.items():
        late, early = _changed_after_first_step(change)
        out[name] = {k: (late[k] is None, early[k] is None,
                         late[k] is not None and early[k] is not None and torch.equal(late[k], early[k]))
                     for k in late}
    # the default run's second step against the first: the plan is kept, not rebuilt, between steps
    model = _model()
    rank = torch.distributed.get_rank()
    first = _step(model, rank)
    plans = _plans(model)
    second = _step(model, rank)
    out["kept"] = all(a is b for a, b in zip(plans, _plans(model))) and all(p is not None for p in plans)
    out["repeatable"] = all(torch.equal(first[k], second[k]) for k in first)
    # set_gradient_divide_factor after a step: the plan is rebuilt (and the grads doubled: SUM over 2 ranks)
    for unit in _units(model):
        unit.set_gradient_divide_factor(1.0)
    third = _step(model, rank)
    out["rebuilt"] = all(a is not b for a, b in zip(plans, _plans(model)))
    out["summed"] = all(torch.allclose(third[k], 2 * second[k], rtol=1e-6, atol=1e-7) for k in first)
    return out


def test_reduce_settings_changed_after_the_first_step_take_effect() -> None:
    for rank, out in enumerate(_settings_changed_after_the_first_step()):
        for name in _CHANGES:
            for param, (late_none, early_none, same) in out[name].items():
                if name == "no_sync":  # no reduce on either: no sharded grad
                    assert late_none and early_none, (rank, name, param)
                else:
                    assert not late_none and not early_none and same, (rank, name, param)
        assert out["kept"], rank
        assert out["repeatable"], rank
        assert out["rebuilt"], rank
        assert out["summed"], rank


@distributed(world_size=4)
def _all_reduce_changed_after_the_first_step() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    late, early = _changed_after_first_step(lambda m: m.set_requires_all_reduce(False), mesh)
    return {k: torch.equal(late[k], early[k]) if late[k] is not None and early[k] is not None else
            (late[k] is None, early[k] is None) for k in late}


def test_requires_all_reduce_changed_after_the_first_step_takes_effect() -> None:
    """HSDP: ``set_requires_all_reduce(False)`` after a step leaves the replicas' partial sums, as from the
    start (no sharded grad until a step with the all-reduce)."""
    for rank, out in enumerate(_all_reduce_changed_after_the_first_step()):
        for param, value in out.items():
            assert value == (True, True), (rank, param, value)


_PACKAGE = os.path.dirname(fully_shard_package.__file__) + os.sep


@distributed(world_size=2)
def _python_calls_of_a_post_backward() -> dict[str, list[tuple[int, int]]]:
    """Per phase of one unit's reduce, each call's (calls of this library's Python functions, calls of any
    Python)."""
    model = _model()
    rank = torch.distributed.get_rank()
    _step(model, rank)  # the first step builds the plans
    state = get_state(model[1])
    assert state is not None
    reducer = state.groups[0].reducer
    counts: dict[str, list[tuple[int, int]]] = {"post_backward": [], "finish": []}

    def counted(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            ours = every = 0

            def profile(frame: Any, event: str, arg: Any) -> None:
                nonlocal ours, every
                if event == "call":
                    every += 1
                    code = frame.f_code
                    ours += code.co_filename.startswith(_PACKAGE) and code.co_name != "_take_row"

            sys.setprofile(profile)
            try:
                return original(*args, **kwargs)
            finally:
                sys.setprofile(None)
                counts[name].append((ours, every))

        return call

    post_backward = state.post_backward  # (the instance's Dynamo-disabled wrapper)
    state.post_backward = counted("post_backward", post_backward)  # type: ignore[method-assign]
    reducer.finish = counted("finish", reducer.finish)  # type: ignore[method-assign]
    try:
        _step(model, rank)
    finally:
        state.post_backward = post_backward  # type: ignore[method-assign]
        del reducer.finish  # the class's method again
    return counts


def test_post_backward_python_calls() -> None:
    """One unit's reduce on the planned path: its post-backward (reduce-scatter issue, the host's wait on
    CPU where the input exceeds the released bytes, reshard) and its finish (grads assigned), run later
    where every rank agrees (ReduceQueue: here the end of backward). Calls of this library's own Python
    functions, which this library decides, whatever torch does under them (all Python calls, torch's
    Dynamo-disable wrapper included, move with torch's own code: see the printed figures; 101 before the
    plan: reduce_ops, the copy-in's layout checks, the grads' checks, the no_grad contexts, the collective's
    checks, per call). Bounded at the figure measured on torch 2.13, 2.14.1, 2.15.0 and 2.11.0 alike."""
    for rank, counts in enumerate(_python_calls_of_a_post_backward()):
        assert len(counts["post_backward"]) == 1 and len(counts["finish"]) == 1, (rank, counts)
        (ours_pb, every_pb), (ours_fin, every_fin) = counts["post_backward"][0], counts["finish"][0]
        print(f"rank {rank}: {ours_pb} + {ours_fin} calls of fully_shard's functions, {every_pb} + {every_fin} "
              "Python calls in all (post-backward + finish)")
        assert ours_pb + ours_fin <= OUR_CALLS, (rank, counts)
