"""The CUDA branch's stream and buffer ordering, run on CPU through the stream stand-in (no GPU needed).

Each case trains a few steps of the CUDA branch (``CommContext`` on simulated streams, the collectives
on gloo) and asserts the stand-in saw no race and no buffer handed to a stream while another may
still use it (tests/distributed/stream_standin.py, design/streams.md "The stream stand-in"), and the
same losses as the CPU branch.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fully_shard.comm import streams
from fully_shard.core.state import get_state
from tests.distributed.harness import distributed
from tests.distributed.stream_standin import StreamStandIn
from tests.models import TinyGPT, batches, loss_fn
from tests.policies.common import local_slice


def _shard(model: TinyGPT, **kwargs: Any) -> TinyGPT:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _train(model: nn.Module, steps: int, *, hook: Callable[[nn.Module, int, int], None] | None = None,
           micro: int = 1) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(batches(steps * micro, batch=8)):
        i = step % micro
        if hook is not None:
            hook(model, step // micro, i)
        loss = loss_fn(model(local_slice(x)), local_slice(y))
        loss.backward()
        losses.append(loss.item())
        if i == micro - 1:
            opt.step()
            opt.zero_grad()
    return losses


def _both(train: Callable[[StreamStandIn | None], list[float]]) -> dict[str, Any]:
    """``train(None)`` on the CPU branch, then ``train(device)`` on the CUDA branch through the stand-in
    (each builds its model from the same weights): the losses of both and what the stand-in saw."""
    cpu_losses = train(None)
    with StreamStandIn() as device, streams.stand_in(device):
        losses = train(device)
        gc.collect()
    return {"violations": device.violations, "losses": losses, "cpu_losses": cpu_losses, "device": device}


def _run(shard: Callable[[TinyGPT], nn.Module], *, steps: int = 2, micro: int = 1,
         hook: Callable[[nn.Module, int, int], None] | None = None, offload: bool = False) -> dict[str, Any]:
    """Train the stand-in's CUDA branch and the CPU branch from the same weights (``offload``: the
    sharded parameters are host memory, as CPUOffloadPolicy puts them)."""
    torch.manual_seed(0)
    ref = TinyGPT()

    def train(device: StreamStandIn | None) -> list[float]:
        model = shard(copy.deepcopy(ref))
        if offload and device is not None:
            device.mark_host(list(model.parameters()))
        return _train(model, steps, hook=hook, micro=micro)

    out = _both(train)
    # compute's first wait on each reduce-scatter event, and how many ops that stream had issued since
    first: dict[int, int] = {}
    for w in out.pop("device").log:
        if w.waiter == "compute" and w.on == "reduce_scatter" and w.event is not None:
            first.setdefault(w.event, w.lag)
    return {**out, "reduce_waits": list(first.values())}


def _assert_clean(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["violations"] == [], "\n".join(r["violations"][:10])
        assert max(abs(a - b) for a, b in zip(r["losses"], r["cpu_losses"])) < 1e-5, r


@distributed(world_size=2)
def _fsdp() -> dict[str, Any]:
    return _run(lambda m: _shard(m))


def test_fsdp() -> None:
    _assert_clean(_fsdp())


@distributed(world_size=2)
def _fsdp_bf16_no_reshard() -> dict[str, Any]:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    r = _run(lambda m: _shard(m, mp_policy=mp, reshard_after_forward=False))
    r["cpu_losses"] = r["losses"]  # bf16 compute: the check here is the stand-in's
    return r


def test_fsdp_bf16_without_reshard_after_forward() -> None:
    _assert_clean(_fsdp_bf16_no_reshard())


@distributed(world_size=4)
def _hsdp(all_reduce_every: int) -> dict[str, Any]:
    def shard(m: TinyGPT) -> TinyGPT:
        return _shard(m, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))

    def accumulate(model: nn.Module, step: int, i: int) -> None:
        model.set_requires_all_reduce(i == all_reduce_every - 1)  # type: ignore[operator]

    return _run(shard, micro=all_reduce_every, hook=accumulate)


def test_hsdp() -> None:
    _assert_clean(_hsdp(1))


def test_hsdp_without_all_reduce_accumulates_on_the_reduce_scatter_stream() -> None:
    _assert_clean(_hsdp(2))


@distributed(world_size=4)
def _partial_reshard() -> dict[str, Any]:
    return _run(lambda m: _shard(m, reshard_after_forward=2))


def test_partial_reshard_keeps_the_block_until_the_all_gather_is_waited() -> None:
    _assert_clean(_partial_reshard())


@distributed(world_size=2)
def _offload(pin_memory: bool, micro: int) -> dict[str, Any]:
    return _run(lambda m: _shard(m, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory)), offload=True,
                micro=micro)


def test_cpu_offload_pinned_copies_are_synchronized_before_the_host_reads_them() -> None:
    _assert_clean(_offload(True, 1))


def test_cpu_offload_accumulation_and_pageable_memory() -> None:
    _assert_clean(_offload(True, 2) + _offload(False, 1))


@distributed(world_size=2)
def _explicit_prefetch() -> dict[str, Any]:
    def shard(m: TinyGPT) -> TinyGPT:
        _shard(m)
        blocks = list(m.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])  # type: ignore[operator]
            block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0):i] if i else [])  # type: ignore[operator]
        return m

    return _run(shard)


def test_explicit_prefetch() -> None:
    _assert_clean(_explicit_prefetch())


@distributed(world_size=2)
def _max_input_buffers(k: int) -> dict[str, Any]:
    def shard(m: TinyGPT) -> TinyGPT:
        _shard(m)
        m.set_reduce_scatter_max_input_buffers(k)  # type: ignore[operator]
        return m

    return _run(shard, steps=1)


def test_reduce_scatter_max_input_buffers_two() -> None:
    one, two = _max_input_buffers(1), _max_input_buffers(2)
    _assert_clean(one + two)
    # k inputs in flight: compute first waits on a reduce-scatter once a later one has been issued
    for r1, r2 in zip(one, two):
        assert r1["reduce_waits"] and all(lag == 0 for lag in r1["reduce_waits"]), r1["reduce_waits"]
        assert sum(lag > 0 for lag in r2["reduce_waits"]) >= 2, r2["reduce_waits"]


@distributed(world_size=2)
def _buffers_released() -> dict[str, Any]:
    torch.manual_seed(0)
    with StreamStandIn() as device, streams.stand_in(device):
        model = _shard(TinyGPT())
        x, y = batches(1, batch=8)[0]
        out = model(local_slice(x))
        comm = get_state(model).root.comm  # type: ignore[union-attr]
        gathered = comm.all_gather_state
        gathered_ref = weakref.ref(gathered[0]) if gathered is not None else None
        del gathered
        gc.collect()
        after_forward = gathered_ref is not None and gathered_ref() is not None
        loss_fn(out, local_slice(y)).backward()
        held = [weakref.ref(buffer) for buffer, _ in comm.reduce_scatter_states]
        gc.collect()
        after_backward = any(ref() is not None for ref in held)
    return {"gather_alive_after_forward": after_forward, "reduce_input_alive_after_backward": after_backward,
            "violations": device.violations}


def test_last_buffers_freed_at_the_end_of_forward_and_backward() -> None:
    for r in _buffers_released():
        assert r["violations"] == [], r["violations"]
        assert not r["gather_alive_after_forward"], r
        assert not r["reduce_input_alive_after_backward"], r


class _CountingAllGather:
    """torch's Comm protocol: every buffer from ``allocate`` (counted), the collective from c10d."""

    def __init__(self) -> None:
        self.allocations = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@distributed(world_size=2)
def _subclass_unit() -> dict[str, Any]:
    from tests.core import subclass_weights as sw

    torch.manual_seed(0)
    ref = sw.int8_net()
    x = torch.randn(4, 32)
    comms: list[_CountingAllGather] = []

    def run(_: StreamStandIn | None) -> list[float]:
        model = copy.deepcopy(ref)
        for layer in model.layers:  # type: ignore[attr-defined]
            fully_shard(layer)
            comms.append(_CountingAllGather())
            layer.set_custom_all_gather(comms[-1])
        fully_shard(model)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        losses = []
        for _ in range(2):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    out = _both(run)
    return {**out, "device": None, "allocations": [c.allocations for c in comms]}


def test_tensor_subclass_unit_and_its_custom_all_gather_buffers() -> None:
    results = _subclass_unit()
    _assert_clean(results)
    for r in results:  # every gathered buffer of the extension units came from the comm's allocate
        assert all(n >= 4 for n in r["allocations"]), r["allocations"]  # 2 steps x (forward + backward)


@distributed(world_size=4)
def _experts() -> dict[str, Any]:
    """Two groups per unit (dense on dp 4, experts on efsdp 2 x ep 2): each with its own all-gather and
    reduce-scatter in flight on the same streams."""
    from fully_shard.core.placement import ShardPlacement
    from tests.parallel.moe_common import MoEModel, batch, expert_parallel, is_expert, local, sparse_meshes

    torch.manual_seed(0)
    dense, edp, ep_mesh = sparse_meshes(2, 2)
    base = MoEModel()

    def run(_: StreamStandIn | None) -> list[float]:
        model = expert_parallel(copy.deepcopy(base), ep_mesh)
        fn = lambda p: ShardPlacement(Shard(0), mesh=edp) if is_expert(p) else None  # noqa: E731
        for layer in model.layers:  # type: ignore[attr-defined]
            fully_shard(layer, mesh=dense, shard_placement_fn=fn)
        fully_shard(model, mesh=dense)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(2):
            x, y = batch(step, 4)
            loss = (model(local(x)) - local(y)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    return {**_both(run), "device": None}


def test_expert_parallel_unit_with_two_groups() -> None:
    _assert_clean(_experts())
