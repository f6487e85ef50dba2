"""Manual backward finalization (torch 2.15's ``set_manual_backward_finalization`` / ``finalize_backward`` /
``GradientReductionHandle``), side by side with torch's fully_shard where it has them: the same losses,
gradients and collectives as torch's for one backward, gradient accumulation and a pipeline-style step
(sync off and no reshard for every microbatch, then an asynchronous finalization), equal to this library's
automatic finalization; torch's errors for every misuse, message for message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from fully_shard import FSDPModule, GradientReductionHandle, fully_shard
from tests.core.common import local_slice
from tests.core.test_surface import _build, _close, _torch_fs
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import batches, loss_fn
from tests.torch_ref import lacks_method

TORCH_NO_MANUAL = lacks_method("finalize_backward", since="2.15")


def _step(model: nn.Module, mode: str, micro: int, step: int) -> tuple[list[float], dict[str, int]]:
    """One optimizer step's backward passes: ``mode`` "auto" (this library's default finalization, the
    reference), "manual" (finalize_backward after the last microbatch), "async" (finalize_backward(
    async_op=True).wait()), "pipeline" (torch's pipelining: every microbatch without sync nor reshard,
    then sync and reshard on and an asynchronous finalization)."""
    data = batches(micro, batch=4, seed=10 + step)
    losses = []
    with CountCollectives() as counted:
        for i, (x, y) in enumerate(data):
            if mode != "auto":
                model.set_manual_backward_finalization(True)
            last = i == micro - 1
            if mode == "pipeline":
                model.set_reshard_after_backward(False)
                model.set_requires_gradient_sync(False)
            elif micro > 1:
                model.set_requires_gradient_sync(last)
            loss = loss_fn(model(local_slice(x)), local_slice(y)) / micro
            loss.backward()
            losses.append(loss.item())
        if mode == "pipeline":
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
        if mode in ("async", "pipeline"):
            handle = model.finalize_backward(async_op=True)
            assert isinstance(handle, GradientReductionHandle) or type(handle).__mro__[1].__name__ == \
                "GradientReductionHandle", type(handle)  # ours, or torch's
            handle.wait()
            model.set_manual_backward_finalization(False)
        elif mode == "manual":
            assert model.finalize_backward() is None
    return losses, dict(counted.counts)


def _run(fs: Any, mode: str, micro: int, steps: int = 2) -> dict[str, Any]:
    model = _build(fs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "counts": [], "grads": []}
    for step in range(steps):
        losses, counts = _step(model, mode, micro, step)
        out["losses"].append(losses)
        out["counts"].append(counts)
        out["grads"].append({n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None})
        out["sharded"] = all(not isinstance(m, FSDPModule) or m.fsdp_state_name == "SHARDED" for m in model.modules())
        opt.step()
        opt.zero_grad()
    return out


@distributed(world_size=2)
def _modes() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, micro in (("manual", 1), ("manual", 2), ("async", 2), ("pipeline", 2)):
        key = f"{mode}x{micro}"
        out[key] = {"ours": _run(fully_shard, mode, micro), "auto": _run(fully_shard, "auto", micro)}
        if not TORCH_NO_MANUAL:
            out[key]["torch"] = _run(_torch_fs(), mode, micro)
    return out


def test_manual_finalization_matches_automatic_and_torch() -> None:
    for r in _modes():
        for key, runs in r.items():
            ours = runs["ours"]
            assert ours["sharded"], key  # finalize_backward resharded every unit
            for ref in ("auto", "torch"):
                if ref not in runs:
                    continue
                theirs = runs[ref]
                flat = [loss for step in theirs["losses"] for loss in step]
                assert [loss for step in ours["losses"] for loss in step] == pytest.approx(flat, abs=1e-6), (key, ref)
                for mine, want in zip(ours["grads"], theirs["grads"]):
                    _close(mine, want)
                if ref == "torch":  # the same collectives per step as torch's (one reduce per unit and step)
                    assert ours["counts"] == theirs["counts"], (key, ours["counts"], theirs["counts"])
    if TORCH_NO_MANUAL:
        pytest.skip(TORCH_NO_MANUAL)


# --- misuse: torch 2.15's errors --------------------------------------------------------------------------
def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "no error"


def _forward_backward(model: nn.Module, hook: Callable[[torch.Tensor], Any] | None = None) -> None:
    x, y = batches(1, batch=4, seed=3)[0]
    out = model(local_slice(x))
    if hook is not None:
        out.register_hook(hook)
    loss_fn(out, local_slice(y)).backward()


def _misuse(fs: Any) -> dict[str, str]:
    found: dict[str, str] = {}
    model = _build(fs)
    found["before_forward"] = repr(model.finalize_backward())
    handle = model.finalize_backward(async_op=True)
    handle.wait()  # a no-op handle before the first forward
    found["before_forward_async"] = type(handle).__mro__[-2].__name__
    _forward_backward(model)
    found["not_root"] = _error(lambda: model.blocks[0].set_manual_backward_finalization(True))
    found["finalize_not_root"] = _error(lambda: model.blocks[0].finalize_backward())
    found["not_manual"] = _error(lambda: model.finalize_backward())
    model.set_manual_backward_finalization(True)
    found["during_backward"] = _error(lambda: _forward_backward(
        model, lambda g: model.set_manual_backward_finalization(False)))
    model.reset_iter_state()
    found["finalize_in_backward"] = _error(lambda: _forward_backward(model, lambda g: model.finalize_backward()))
    model.reset_iter_state()
    _forward_backward(model)
    found["after_backward_starts"] = _error(lambda: model.set_manual_backward_finalization(False))
    handle = model.finalize_backward(async_op=True)
    found["again"] = _error(lambda: model.finalize_backward())
    found["forward_pending"] = _error(lambda: _forward_backward(model))
    handle.wait()
    found["waited_twice"] = _error(handle.wait)
    _forward_backward(model)
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    found["invalidated"] = _error(handle.wait)
    model.set_manual_backward_finalization(False)
    _forward_backward(model)  # automatic again
    found["sharded_after"] = repr(all(not isinstance(m, FSDPModule) or m.fsdp_state_name == "SHARDED"
                                      for m in model.modules() if isinstance(m, FSDPModule) and m is not model))
    inner = _build(fs)
    inner.blocks[0].set_manual_backward_finalization(True)  # not yet known to be a non-root: accepted
    found["inner_before_lazy_init"] = _error(lambda: _forward_backward(inner))
    return found


@distributed(world_size=2)
def _misuse_both() -> dict[str, Any]:
    out = {"ours": _misuse(fully_shard)}
    if not TORCH_NO_MANUAL:
        out["torch"] = _misuse(_torch_fs())
    return out


def test_manual_finalization_misuse_raises_torchs_errors() -> None:
    for r in _misuse_both():
        ours = r["ours"]
        assert ours["not_root"] == \
            "RuntimeError: set_manual_backward_finalization must be called on the root FSDP module"
        assert ours["not_manual"].startswith("RuntimeError: FSDP finalize_backward requires manual"), ours
        assert ours["during_backward"] == \
            "RuntimeError: set_manual_backward_finalization cannot change mode during backward", ours
        assert ours["invalidated"] == "RuntimeError: This gradient reduction handle was invalidated", ours
        assert ours["waited_twice"] == "no error" and ours["before_forward"] == "None", ours
        if "torch" in r:
            assert ours == r["torch"], {k: (v, r["torch"][k]) for k, v in ours.items() if v != r["torch"][k]}
    if TORCH_NO_MANUAL:
        pytest.skip(TORCH_NO_MANUAL)
