"""torch 2.13's FSDPModule surface beyond the common calls, side by side with torch's fully_shard where
torch runs the same call on CPU/gloo (loss and grads within 1e-6), else against an analytic reference:
divide factor, force-sum, unshard_in_backward, all-reduce hook, custom collectives, unused params, reduce-
scatter buffers and group. The rest of the surface: test_surface_runtime.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import FSDPModule, MixedPrecisionPolicy, fully_shard
from fully_shard.comm import trace
from tests.core.common import local_slice
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.torch_ref import lacks_method

Configure = Callable[[Any], None]
TORCH_NO_UNUSED = lacks_method("set_reduce_scatter_unused_params")
TORCH_NO_RS_BUFFERS = lacks_method("set_reduce_scatter_max_input_buffers") or \
    lacks_method("set_separate_reduce_scatter_group")


def _torch_fs() -> Any:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    return torch_fully_shard


def _mesh(hsdp: bool) -> Any:
    if not hsdp:
        return None
    return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))


def _build(fs: Any, *, hsdp: bool = False, tok_unit: bool = False, **kw: Any) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2, zero_dim=False)  # torch's fully_shard refuses 0-dim parameters
    mesh = _mesh(hsdp)
    if tok_unit:
        fs(model.tok, mesh=mesh, **kw)
    for blk in model.blocks:
        fs(blk, mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    return model


def _train(model: nn.Module, configure: Configure | None = None, steps: int = 2) -> dict[str, Any]:
    """``steps`` SGD steps on this rank's slice; the first step's full grads, losses, counts."""
    if configure is not None:
        configure(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "counts": [], "grads": {}}
    for i, (x, y) in enumerate(batches(steps, batch=4)):
        with CountCollectives() as fwd:
            loss = loss_fn(model(local_slice(x)), local_slice(y))
        with CountCollectives() as bwd:
            loss.backward()
        if i == 0:
            out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["counts"].append((dict(fwd.counts), dict(bwd.counts)))
    return out


def _pair(configure: Configure | None, steps: int = 2, **build: Any) -> dict[str, Any]:
    return {"ours": _train(_build(fully_shard, **build), configure, steps),
            "torch": _train(_build(_torch_fs(), **build), configure, steps)}


def _vs_default(configure: Configure, steps: int = 2) -> dict[str, Any]:
    """Where torch lacks a scheduling-only setting: ours with it against ours without it (the default
    run, itself checked against torch and the unsharded model elsewhere), for ``_same``."""
    return {"ours": _train(_build(fully_shard), configure, steps), "default": _train(_build(fully_shard), None, steps)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], scale: float = 1.0) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for name, g in a.items():
        torch.testing.assert_close(g, b[name] * scale, atol=1e-6, rtol=0, msg=name)


def _same(r: dict[str, Any], counts: bool = True) -> None:
    ours, ref = r["ours"], r["torch"] if "torch" in r else r["default"]
    for loss, t_loss in zip(ours["losses"], ref["losses"]):
        assert abs(loss - t_loss) < 1e-6, (ours["losses"], ref["losses"])
    if counts:
        assert ours["counts"] == ref["counts"], (ours["counts"], ref["counts"])
    _close(ours["grads"], ref["grads"])


def _units(model: nn.Module) -> list[Any]:
    """Every module passed to fully_shard, ours or torch's."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    return [m for m in model.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]


def _each(configure: Callable[[Any], None]) -> Configure:
    return lambda model: [configure(m) for m in _units(model)]


# --- set_gradient_divide_factor / set_force_sum_reduction_for_comms -----------------------------------
@distributed(world_size=2)
def _divide_w2() -> dict[str, Any]:
    factor_sum = _each(lambda m: (m.set_gradient_divide_factor(1.0), m.set_force_sum_reduction_for_comms(True)))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float16)
    torch_premul = ""
    try:  # torch 2.13 on gloo: PREMUL_SUM for a divide factor without force-sum
        _train(_build(_torch_fs()), _each(lambda m: m.set_gradient_divide_factor(1.0)), steps=1)
    except Exception as e:
        torch_premul = str(e)
    return {
        "factor_sum": _pair(factor_sum),
        "force_sum": _pair(_each(lambda m: m.set_force_sum_reduction_for_comms(True)), steps=1),
        "fp16_factor_sum": _pair(_each(lambda m: (m.set_gradient_divide_factor(4.0),
                                                  m.set_force_sum_reduction_for_comms(True))), steps=1, mp_policy=mp),
        "torch_premul": torch_premul,
        "default": _train(_build(fully_shard), steps=1)["grads"],
        "factor_1": _train(_build(fully_shard), _each(lambda m: m.set_gradient_divide_factor(1.0)), steps=1),
        "factor_3": _train(_build(fully_shard), _each(lambda m: m.set_gradient_divide_factor(3.0)), steps=1),
    }


def test_gradient_divide_factor_and_force_sum() -> None:
    for r in _divide_w2():
        for key in ("factor_sum", "force_sum", "fp16_factor_sum"):
            _same(r[key])
        bwd = r["force_sum"]["ours"]["counts"][0][1]
        assert bwd == {"all_gather": 2, "reduce_scatter": 3}, bwd
        assert "PREMUL_SUM" in r["torch_premul"], r["torch_premul"]  # where torch fails, the analytic sum:
        _close(r["factor_1"]["grads"], r["default"], scale=2.0)  # sum over 2 ranks = 2 x the average
        _close(r["factor_3"]["grads"], r["default"], scale=2.0 / 3.0)
        assert r["factor_1"]["counts"][0][1] == bwd


@distributed(world_size=4)
def _divide_hsdp() -> dict[str, Any]:
    factor_sum = _each(lambda m: (m.set_gradient_divide_factor(1.0), m.set_force_sum_reduction_for_comms(True)))
    return {
        "factor_sum": _pair(factor_sum, steps=1, hsdp=True),
        "default": _train(_build(fully_shard, hsdp=True), steps=1)["grads"],
        "factor_1": _train(_build(fully_shard, hsdp=True), _each(lambda m: m.set_gradient_divide_factor(1.0)),
                           steps=1)["grads"],
        "hook": _pair(_each(lambda m: m.set_all_reduce_hook(_double)), steps=1, hsdp=True),
    }


def _double(t: torch.Tensor) -> None:
    t.mul_(2)


def test_divide_factor_and_all_reduce_hook_with_hsdp() -> None:
    for r in _divide_hsdp():
        _same(r["factor_sum"])
        _close(r["factor_1"], r["default"], scale=4.0)  # 2 replicas x 2 shards
        _same(r["hook"])
        _close(r["hook"]["ours"]["grads"], r["default"], scale=2.0)  # the hook ran once, after the all-reduce


# --- set_all_reduce_hook (1-D), set_custom_all_gather / set_custom_reduce_scatter ------------------------
class _Recorder:
    """A torch-protocol comm: allocates and runs the collective itself, recording both."""

    def __init__(self) -> None:
        self.allocated: set[int] = set()
        self.calls = 0
        self.used_own_buffers = True

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = torch.empty(*size, dtype=dtype, device=device)
        self.allocated.add(t.data_ptr())
        return t

    def _record(self, output_tensor: torch.Tensor) -> None:
        self.calls += 1
        self.used_own_buffers &= output_tensor.data_ptr() in self.allocated


class _AllGather(_Recorder):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        self._record(output_tensor)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _ReduceScatter(_Recorder):
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        self._record(output_tensor)
        self.used_own_buffers &= input_tensor.data_ptr() in self.allocated
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _with_comms(comms: list[_Recorder]) -> Configure:
    def configure(model: Any) -> None:
        for m in _units(model):
            ag, rs = _AllGather(), _ReduceScatter()
            comms.extend([ag, rs])
            m.set_custom_all_gather(ag)
            m.set_custom_reduce_scatter(rs)
    return configure


@distributed(world_size=2)
def _hook_and_comms() -> dict[str, Any]:
    seen: list[tuple[int, ...]] = []

    def hook(t: torch.Tensor) -> None:
        seen.append(tuple(t.shape))
        t.mul_(2)

    ours_comms: list[_Recorder] = []
    torch_comms: list[_Recorder] = []
    configure = _each(lambda m: m.set_all_reduce_hook(hook))
    out: dict[str, Any] = {"hook": {"ours": _train(_build(fully_shard), configure)}}
    ours_calls = len(seen)
    out["hook"]["torch"] = _train(_build(_torch_fs()), configure)
    out["hook_calls"] = (ours_calls, len(seen) - ours_calls)
    out["default"] = _train(_build(fully_shard), steps=1)["grads"]
    out["comms"] = {"ours": _train(_build(fully_shard), _with_comms(ours_comms)),
                    "torch": _train(_build(_torch_fs()), _with_comms(torch_comms))}
    out["comm_calls"] = ([c.calls for c in ours_comms], [c.calls for c in torch_comms])
    out["own_buffers"] = all(c.used_own_buffers for c in ours_comms)
    return out


def test_all_reduce_hook_and_custom_comms() -> None:
    for r in _hook_and_comms():
        _same(r["hook"])
        _close(r["hook"]["ours"]["grads"], r["default"], scale=2.0)
        ours, theirs = r["hook_calls"]
        assert ours == theirs == 2 * 3, r["hook_calls"]  # 3 units x 2 steps, as torch
        _same(r["comms"], counts=False)  # the collectives go through the user's objects, not counted
        ours_calls, torch_calls = r["comm_calls"]
        assert ours_calls == torch_calls and sum(ours_calls) > 0, r["comm_calls"]
        assert r["own_buffers"]  # every buffer passed in came from the object's allocate()


# --- set_unshard_in_backward ----------------------------------------------------------------------------
@distributed(world_size=2)
def _unshard_in_backward() -> dict[str, Any]:
    off = lambda model: model.tok.set_unshard_in_backward(False)  # noqa: E731
    return {"off": _pair(off, tok_unit=True), "on": _train(_build(fully_shard, tok_unit=True), steps=1)}


def test_unshard_in_backward_skips_the_embedding_all_gather() -> None:
    for r in _unshard_in_backward():
        _same(r["off"])
        on = r["on"]["counts"][0][1]["all_gather"]
        off = r["off"]["ours"]["counts"][0][1]["all_gather"]
        assert off == on - 1, (on, off)
        _close(r["off"]["ours"]["grads"], r["on"]["grads"])


# --- set_reduce_scatter_unused_params -------------------------------------------------------------------
class _TwoPaths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_run(fs: Any, flag: bool) -> dict[str, Any]:
    """``fs=None``: the unsharded model (every rank's batch is the same: its grads are the mean's)."""
    torch.manual_seed(0)
    model = _TwoPaths()
    if fs is not None:
        fs(model)
        model.set_reduce_scatter_unused_params(flag)
    model(torch.randn(4, 8)).sum().backward()
    return {n: None if p.grad is None else getattr(p.grad, "full_tensor", p.grad.detach)()
            for n, p in model.named_parameters()}


@distributed(world_size=2)
def _unused() -> dict[str, Any]:
    return {flag: {"ours": _unused_run(fully_shard, flag), "ref": _unused_run(None, flag),
                   **({} if TORCH_NO_UNUSED else {"torch": _unused_run(_torch_fs(), flag)})}
            for flag in (False, True)}


def test_reduce_scatter_unused_params() -> None:
    for r in _unused():
        for flag, pair in r.items():
            for name, g in pair["ours"].items():
                want = pair["ref"][name]
                if want is not None:
                    torch.testing.assert_close(g, want, atol=1e-6, rtol=0)
            if "torch" not in pair:
                continue
            assert pair["ours"].keys() == pair["torch"].keys()
            for name, g in pair["ours"].items():
                t = pair["torch"][name]
                assert (g is None) == (t is None), (flag, name, g, t)
                if g is not None:
                    torch.testing.assert_close(g, t, atol=1e-6, rtol=0)
        assert r[False]["ours"]["unused.weight"] is None
        assert r[True]["ours"]["unused.weight"].abs().sum() == 0
    if TORCH_NO_UNUSED:
        pytest.skip(TORCH_NO_UNUSED)


# --- set_reduce_scatter_max_input_buffers / set_separate_reduce_scatter_group ---------------------------
def _max_in_flight(model: nn.Module, configure: Configure) -> tuple[int, dict[str, Any]]:
    with trace.record() as events:
        out = _train(model, configure, steps=1)
    issued = done = worst = 0
    for e in events:  # one reduce per unit and step here: issued - finished = in flight
        issued += e.kind is trace.EventKind.REDUCE_SCATTER
        done += e.kind is trace.EventKind.REDUCE_DONE
        worst = max(worst, issued - done)
    return worst, out


@distributed(world_size=2)
def _buffers_and_group() -> dict[str, Any]:
    def k(n: int) -> Configure:
        return lambda model: model.set_reduce_scatter_max_input_buffers(n)

    separate = lambda model: model.set_separate_reduce_scatter_group()  # noqa: E731
    model = _build(fully_shard)
    out: dict[str, Any] = {"k": {n: _max_in_flight(_build(fully_shard), k(n))[0] for n in (1, 2, 3)}}
    out["k3"] = _vs_default(k(3)) if TORCH_NO_RS_BUFFERS else _pair(k(3))
    out["separate"] = _vs_default(separate) if TORCH_NO_RS_BUFFERS else _pair(separate)
    separate(model)
    group = model.blocks[0]._fsdp.group
    out["own_group"] = group.reducer.settings.group is not None and \
        group.reducer.settings.group is not group.mesh_info.shard_group
    with pytest.raises(ValueError, match="positive"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.raises(TypeError, match="int"):
        model.set_reduce_scatter_max_input_buffers(True)
    return out


def test_reduce_scatter_buffers_and_separate_group() -> None:
    for r in _buffers_and_group():
        assert r["k"] == {1: 1, 2: 2, 3: 3}, r["k"]  # 3 units: at most k reduces in flight
        _same(r["k3"])
        _same(r["separate"])
        assert r["own_group"]
    if TORCH_NO_RS_BUFFERS:
        pytest.skip(TORCH_NO_RS_BUFFERS)
