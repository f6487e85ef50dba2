"""Mixed precision: bf16/fp16 compute with fp32 master weights and fp32 reduction, checked against an
emulated unsharded reference, the bytes each collective moves, per-module policies, no-sync in fp32."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fully_shard import MixedPrecisionPolicy, fully_shard
from fully_shard.comm import trace
from fully_shard.comm.trace import EventKind
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.policies.common import (
    Emulator,
    local_slice,
    max_grad_diff,
    max_param_diff,
    rank_slice,
    sgd,
    unit_padded_numel,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shard_with(model: nn.Module, policies: dict[str, MixedPrecisionPolicy]) -> dict[str, list[nn.Parameter]]:
    """fully_shard every unit of ``policies`` bottom-up; return each unit's own original params."""
    modules = dict(model.named_modules())
    units = sorted(policies, key=lambda f: -f.count(".") - (1 if f else 0))
    owned: dict[str, list[nn.Parameter]] = {}
    taken: set[int] = set()
    for fqn in units:  # before sharding anything: fully_shard swaps the parameter objects
        params = [p for p in modules[fqn].parameters() if id(p) not in taken]
        taken |= {id(p) for p in params}
        owned[fqn] = params
    for fqn in units:
        fully_shard(modules[fqn], mp_policy=policies[fqn])
    return owned


def per_rank(x: torch.Tensor, y: torch.Tensor, world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [[(rank_slice(x, r, world), rank_slice(y, r, world))] for r in range(world)]


def _train_vs_emulation(policies: dict[str, MixedPrecisionPolicy], steps: int, lr: float = 0.1
                        ) -> dict[str, object]:
    world = dist.get_world_size()
    master = TinyGPT()
    model = copy.deepcopy(master)
    owned = shard_with(model, policies)
    emu = Emulator(master, policies)
    opt = sgd(model.parameters(), lr)
    seen: dict[str, torch.dtype] = {}
    model.blocks[0].up.register_forward_hook(
        lambda m, args, out: seen.update(weight=m.weight.dtype, input=args[0].dtype, output=out.dtype))
    first_events: list[trace.TraceEvent] = []
    losses = []
    for step, (x, y) in enumerate(batches(steps, batch=4)):
        with trace.record() as events:
            loss = loss_fn(model(local_slice(x)), local_slice(y))
            loss.backward()
        losses.append(loss.item())
        if step == 0:
            first_events = events
            for name, p in model.named_parameters():
                assert p.dtype == torch.float32, (name, p.dtype)  # master weights stay fp32
                assert p.grad is not None and p.grad.dtype == torch.float32, (name, p.grad)
                assert type(p.grad).__name__ == "DTensor", name
        opt.step()
        opt.zero_grad()
        emu.step(per_rank(x, y, world), lr)
    # Every collective moved exactly its unit's padded flat buffer at the policy's dtype.
    for e in first_events:
        if e.kind in (EventKind.ALL_GATHER, EventKind.REDUCE_SCATTER):
            policy = policies[e.fqn]
            dtype = policy.param_dtype or torch.float32
            if e.kind is EventKind.REDUCE_SCATTER:
                dtype = policy.reduce_dtype or dtype
            expected = unit_padded_numel(owned[e.fqn], world) * dtype.itemsize
            assert e.nbytes == expected, (e.kind, e.fqn, e.nbytes, expected)
            assert e.group_size == world
    ag = [e for e in first_events if e.kind is EventKind.ALL_GATHER]
    rs = [e for e in first_events if e.kind is EventKind.REDUCE_SCATTER]
    assert len(rs) == len(policies), [e.short() for e in rs]
    return {"param_diff": max_param_diff(model, master), "seen": seen, "losses": losses,
            "ag_bytes": sum(e.nbytes for e in ag), "rs_bytes": sum(e.nbytes for e in rs),
            "n_ag": len(ag), "n_rs": len(rs)}


def _uniform(policy: MixedPrecisionPolicy, n_blocks: int = 3) -> dict[str, MixedPrecisionPolicy]:
    """``policy`` on the root; the blocks the same without ``output_dtype`` (the root's output only)."""
    block = dataclasses.replace(policy, output_dtype=None)
    return {"": policy, **{f"blocks.{i}": block for i in range(n_blocks)}}


@distributed(world_size=2)
def _bytes_fp32_vs_mixed(param: str, reduce: str) -> dict[str, object]:
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param], reduce_dtype=DTYPES[reduce],
                                  output_dtype=torch.float32)
    return _train_vs_emulation(_uniform(policy), steps=10)


@pytest.mark.parametrize(("param", "reduce", "tol"), [("bf16", "fp32", 2e-3), ("fp16", "fp32", 5e-4),
                                                       ("bf16", "bf16", 2e-3)])
def test_low_precision_compute_matches_emulation(param: str, reduce: str, tol: float) -> None:
    results = _bytes_fp32_vs_mixed(param, reduce)
    for r in results:
        assert r["param_diff"] < tol, r["param_diff"]
        assert r["seen"] == {"weight": DTYPES[param], "input": DTYPES[param], "output": DTYPES[param]}
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trains


@distributed(world_size=2)
def _fp32_bytes() -> dict[str, object]:
    return _train_vs_emulation(_uniform(MixedPrecisionPolicy()), steps=2)


def test_bf16_halves_all_gather_bytes() -> None:
    fp32 = _fp32_bytes()[0]
    mixed = _bytes_fp32_vs_mixed("bf16", "fp32")[0]
    assert fp32["param_diff"] < 1e-5
    assert fp32["n_ag"] == mixed["n_ag"] and fp32["n_rs"] == mixed["n_rs"]
    assert mixed["ag_bytes"] * 2 == fp32["ag_bytes"]
    assert mixed["rs_bytes"] == fp32["rs_bytes"]  # fp32 reduce: gradients move at full width


@distributed(world_size=2)
def _per_module_policies() -> dict[str, object]:
    """Children differ from their parent: under an fp32 root, a bf16 block with fp32 outputs, an fp16
    block (reducing in fp32) that casts its fp32 inputs itself, and a block without a policy."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32)
    fp16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32)
    policies = {"": MixedPrecisionPolicy(), "blocks.0": bf16, "blocks.1": fp16,
                "blocks.2": MixedPrecisionPolicy()}
    master = TinyGPT()
    model = copy.deepcopy(master)
    shard_with(model, policies)
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for i, blk in enumerate(model.blocks):
        blk.up.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"up{i}", (a[0].dtype, o.dtype)))
        blk.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"out{i}", (a[0].dtype, o.dtype)))
    world = dist.get_world_size()
    x, y = batches(1, batch=4)[0]
    loss_fn(model(local_slice(x)), local_slice(y)).backward()
    ref = Emulator(master, policies).grads(per_rank(x, y, world))
    return {"seen": seen, "grad_diff": max_grad_diff(model, ref),
            "grad_dtypes": {p.grad.dtype for p in model.parameters()}}


def test_per_module_policies_compose() -> None:
    for r in _per_module_policies():
        seen = r["seen"]
        # blocks.0 computes in bf16 and hands fp32 to blocks.1, which casts its inputs to fp16.
        assert seen["up0"] == (torch.bfloat16, torch.bfloat16)
        assert seen["out0"][1] == torch.float32
        assert seen["up1"] == (torch.float16, torch.float16)
        assert seen["out1"] == (torch.float16, torch.float32)
        assert seen["up2"] == (torch.float32, torch.float32)  # no policy: fp32 params, fp32 compute
        assert r["grad_dtypes"] == {torch.float32}
        assert r["grad_diff"] < 1e-5, r["grad_diff"]


@distributed(world_size=2)
def _no_sync_accumulates_in_fp32(n_micro: int) -> dict[str, object]:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32)
    policies = _uniform(policy)
    master = TinyGPT()
    model = copy.deepcopy(master)
    shard_with(model, policies)
    world = dist.get_world_size()
    micro = batches(n_micro, batch=4, seed=7)
    acc_dtypes: set[torch.dtype] = set()
    with trace.record() as events:
        for i, (x, y) in enumerate(micro):
            last = i == n_micro - 1
            model.set_requires_gradient_sync(last)
            loss_fn(model(local_slice(x)), local_slice(y)).backward()
            if not last:
                for mod in [model, *model.blocks]:
                    for p in mod._fsdp.group.params:
                        acc_dtypes.add(p.unsharded_accumulated_grad.dtype)
                        assert p.sharded_param.grad is None
    per_rank_micro = [[(rank_slice(x, r, world), rank_slice(y, r, world)) for x, y in micro]
                      for r in range(world)]
    ref = Emulator(master, policies).grads(per_rank_micro)
    # The same sums accumulated in bf16 (what an accumulator in param_dtype would give).
    bf16_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    ref_bf16 = Emulator(master, _uniform(bf16_policy)).grads(per_rank_micro)
    rs = [e for e in events if e.kind is EventKind.REDUCE_SCATTER]
    return {"acc_dtypes": acc_dtypes, "diff": max_grad_diff(model, ref),
            "diff_vs_bf16_accumulation": max_grad_diff(model, ref_bf16), "n_rs": len(rs)}


def test_no_sync_accumulates_unsharded_grads_in_fp32() -> None:
    for r in _no_sync_accumulates_in_fp32(4):
        assert r["acc_dtypes"] == {torch.float32}
        assert r["n_rs"] == 4  # one reduce-scatter per unit, only on the synced micro-batch
        assert r["diff"] < 1e-6, r
        assert r["diff_vs_bf16_accumulation"] > 10 * max(r["diff"], 1e-8), r  # the test can tell them apart


@distributed(world_size=2)
def _cast_forward_inputs(cast: bool) -> dict[str, object]:
    lin = nn.Linear(8, 6)
    fully_shard(lin, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=cast,
                                                    output_dtype=torch.float64))
    seen: list[torch.dtype] = []

    def record_and_cast(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        seen.append(args[0].dtype)  # what fully_shard's pre-forward handed on
        return (args[0].to(torch.bfloat16),)

    lin.register_forward_pre_hook(record_and_cast)
    out = lin(torch.ones(3, 8))
    return {"seen": seen, "out": out.dtype}


@pytest.mark.parametrize("cast", [True, False])
def test_cast_forward_inputs_and_output_dtype(cast: bool) -> None:
    for r in _cast_forward_inputs(cast):
        assert r["seen"] == [torch.bfloat16 if cast else torch.float32]
        assert r["out"] == torch.float64  # output_dtype applies either way
