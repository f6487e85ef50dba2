"""The CUDA branch's stream and buffer ordering, run on CPU through the stream stand-in (no GPU needed).

Each case trains a few steps of the CUDA branch (``CommContext`` on simulated streams, the collectives
on gloo) and asserts the stand-in saw no race and no buffer handed to a stream while another may
still use it (tests/distributed/stream_standin.py, design/streams.md "The stream stand-in"). The
losses are compared with the CPU branch's too, but only as a check that both branches computed the
same thing: the stand-in runs every op at once on the CPU, so a race never changes a value here; the
violations are the test. The mutation cases at the end show the library's runs are reported once an
ordering is missing (tests/distributed/test_stream_standin.py shows each race kind on raw streams).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, QuantizedAllGather, fully_shard, share_comm_ctx
from fully_shard.comm import streams
from tests.core.common import shard_aux, train_aux
from tests.distributed.harness import distributed
from tests.distributed.stream_standin import SimEvent, SimStream, StreamStandIn
from tests.models import AuxGPT, TinyGPT, batches, loss_fn
from tests.policies.common import local_slice

Hook = Callable[[nn.Module, int, int, "StreamStandIn | None"], None]  # (model, step, micro-batch, stand-in)
Loop = Callable[[nn.Module, "StreamStandIn | None"], list[float]]  # a training loop of its own
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _shard(model: TinyGPT, **kwargs: Any) -> TinyGPT:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _train(model: nn.Module, steps: int, device: StreamStandIn | None, *, hook: Hook | None = None,
           micro: int = 1) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(batches(steps * micro, batch=8)):
        i = step % micro
        if hook is not None:
            hook(model, step // micro, i, device)
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


def _run(shard: Callable[[TinyGPT], nn.Module], *, steps: int = 2, micro: int = 1, hook: Hook | None = None,
         offload: bool = False, loop: Loop | None = None, model: Callable[[], nn.Module] = TinyGPT) -> dict[str, Any]:
    """Train the stand-in's CUDA branch and the CPU branch from the same weights (``offload``: the
    sharded parameters are host memory, as CPUOffloadPolicy puts them; ``loop``: a training loop of its
    own instead of ``_train``'s)."""
    torch.manual_seed(0)
    ref = model()

    def train(device: StreamStandIn | None) -> list[float]:
        sharded = shard(copy.deepcopy(ref))  # type: ignore[arg-type]
        if offload and device is not None:
            device.mark_host(list(sharded.parameters()))
        if loop is not None:
            return loop(sharded, device)
        return _train(sharded, steps, device, hook=hook, micro=micro)

    out = _both(train)
    # compute's first wait on each reduce-scatter event, and how many ops that stream had issued since
    first: dict[int, int] = {}
    for w in out.pop("device").log:
        if w.waiter == "compute" and w.on == "reduce_scatter" and w.event is not None:
            first.setdefault(w.event, w.lag)
    return {**out, "reduce_waits": list(first.values())}


def _assert_clean(results: list[dict[str, Any]], tol: float = 1e-5) -> None:
    for r in results:
        assert r["violations"] == [], f"{len(r['violations'])} violation(s):\n" + "\n".join(r["violations"][:10])
        assert max(abs(a - b) for a, b in zip(r["losses"], r["cpu_losses"])) <= tol, r


@distributed(world_size=2)
def _fsdp() -> dict[str, Any]:
    return _run(lambda m: _shard(m))


def test_fsdp() -> None:
    _assert_clean(_fsdp())


@distributed(world_size=2)
def _fsdp_bf16_no_reshard() -> dict[str, Any]:
    return _run(lambda m: _shard(m, mp_policy=BF16, reshard_after_forward=False))


def test_fsdp_bf16_without_reshard_after_forward() -> None:
    _assert_clean(_fsdp_bf16_no_reshard())


@distributed(world_size=4)
def _hsdp(all_reduce_every: int) -> dict[str, Any]:
    def shard(m: TinyGPT) -> TinyGPT:
        return _shard(m, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))

    def accumulate(model: nn.Module, step: int, i: int, _: StreamStandIn | None) -> None:
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


def _communicated(device: StreamStandIn, since: int, kind: str, arg: str) -> list[Any]:
    """Weak references to the storages passed as ``arg`` (``output``/``input``) to the collectives of ``kind``
    (``gather``/``reduce_scatter``) issued since the ``since``-th collective argument."""
    return [c.storage for c in device.communicated[since:] if kind in c.op and c.arg.startswith(arg)]


@distributed(world_size=2)
def _buffers_released() -> dict[str, Any]:
    """Every gathered buffer and every reduce-scatter input, taken (as weak references) by the stand-in at
    the collective that used it, whoever holds it afterwards: freed at the end of forward and of backward
    (backward's gathered buffers at once, when their copy-out is done)."""
    torch.manual_seed(0)
    with StreamStandIn() as device, streams.stand_in(device):
        model = _shard(TinyGPT())
        x, y = batches(1, batch=8)[0]
        start = len(device.communicated)
        held: list[int] = []  # after each block's forward: gathered buffers alive (the last one is held)

        def after_block(*_: Any) -> None:
            held.append(sum(ref() is not None for ref in _communicated(device, start, "gather", "output")))

        for block in model.blocks:
            block.register_forward_hook(after_block)
        out = model(local_slice(x))
        gc.collect()
        gathered = _communicated(device, start, "gather", "output")
        start = len(device.communicated)
        loss_fn(out, local_slice(y)).backward()
        gc.collect()
        reduced = _communicated(device, start, "reduce_scatter", "input")
        regathered = _communicated(device, start, "gather", "output")  # backward's all-gathers
        return {"held_after_blocks": held, "gathered": len(gathered), "reduced": len(reduced),
                "regathered": len(regathered), "regathered_alive": sum(ref() is not None for ref in regathered),
                "gathered_alive": sum(ref() is not None for ref in gathered),
                "reduce_inputs_alive": sum(ref() is not None for ref in reduced), "violations": device.violations}


def test_last_buffers_freed_at_the_end_of_forward_and_backward() -> None:
    for r in _buffers_released():
        assert r["violations"] == [], r["violations"]
        assert r["gathered"] >= 3 and r["reduced"] >= 4, r  # the 3 blocks (+ the root's reduce)
        assert r["held_after_blocks"] and min(r["held_after_blocks"]) >= 1, r  # the weak references see them
        assert r["gathered_alive"] == 0, r
        assert r["reduce_inputs_alive"] == 0, r
        # backward holds no gathered buffer for the next unit (as torch: only forward defers the free), so
        # none outlives it into the optimizer step (gpu_check 2026-12-04: one block's buffer, +24 MiB)
        assert r["regathered"] >= 3 and r["regathered_alive"] == 0, r


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


# --- configurations first run through the stand-in with issue 31 ---------------------------------------
def _units(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "set_all_reduce_hook")]


@distributed(world_size=2)
def _all_reduce_hook_on_its_stream() -> dict[str, Any]:
    world = dist.get_world_size()

    def average_shards(shard: torch.Tensor) -> None:  # a hook that communicates and writes in place
        dist.all_reduce(shard)
        shard.div_(world)

    def hook(model: nn.Module, step: int, i: int, device: StreamStandIn | None) -> None:
        if step == 1:  # after lazy init: the units' contexts know they run on (simulated) streams
            for unit in _units(model):
                unit.set_all_reduce_hook(average_shards, stream=device.Stream() if device is not None else None)

    return _run(lambda m: _shard(m), steps=3, hook=hook)


def test_all_reduce_hook_on_its_own_stream() -> None:
    _assert_clean(_all_reduce_hook_on_its_stream())


def _post_optim_loop(*, early: bool) -> Loop:
    """Each step records the event ``set_post_optim_event`` takes: after the optimizer step (``early``: before
    it, a user's mistake the stand-in must report)."""
    def loop(model: nn.Module, device: StreamStandIn | None) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y in batches(3, batch=8):
            loss = loss_fn(model(local_slice(x)), local_slice(y))
            loss.backward()
            losses.append(loss.item())
            before = device.current_stream().record_event() if device is not None else None
            opt.step()
            opt.zero_grad()
            if device is not None:
                model.set_post_optim_event(before if early else device.current_stream().record_event())  # type: ignore[operator]
        return losses

    return loop


@distributed(world_size=2)
def _post_optim_event(early: bool) -> dict[str, Any]:
    return _run(lambda m: _shard(m), loop=_post_optim_loop(early=early))


def test_post_optim_event() -> None:
    _assert_clean(_post_optim_event(False))


@distributed(world_size=2)
def _no_sync(reshard_after_backward: bool) -> dict[str, Any]:
    def accumulate(model: nn.Module, step: int, i: int, _: StreamStandIn | None) -> None:
        model.set_requires_gradient_sync(i == 1)  # type: ignore[operator]
        if not reshard_after_backward:  # torch's recipe: keep the parameters gathered between micro-batches
            model.set_reshard_after_backward(i == 1)  # type: ignore[operator]

    return _run(lambda m: _shard(m), micro=2, hook=accumulate)


def test_no_sync_accumulation() -> None:
    _assert_clean(_no_sync(True) + _no_sync(False))


@distributed(world_size=2)
def _no_unshard_in_backward() -> dict[str, Any]:
    def shard(m: TinyGPT) -> TinyGPT:
        fully_shard(m.tok)  # its backward reads only the indices
        _shard(m)
        m.tok.set_unshard_in_backward(False)  # type: ignore[operator]
        return m

    return _run(shard)


def test_unshard_in_backward_false() -> None:
    _assert_clean(_no_unshard_in_backward())


@distributed(world_size=2)
def _reshard_after_backward_false() -> dict[str, Any]:
    return _run(shard_aux, loop=lambda model, _: train_aux(model), model=AuxGPT)  # type: ignore[arg-type]


def test_reshard_after_backward_false_with_a_prefetch_backward_never_uses() -> None:
    """The end of backward drops that prefetch's all-gather (whatever reshard_after_backward says): kept
    pending, its copy-in (reading the shards) raced the optimizer step's writes (4 violations per rank
    before the fix in core/state.py), and the next forward used parameters gathered before the step
    (tests/core/test_runtime.py compares the losses with torch's)."""
    _assert_clean(_reshard_after_backward_false())


@distributed(world_size=2)
def _quantized() -> dict[str, Any]:
    return _run(lambda m: _shard(m, all_gather_policy=QuantizedAllGather(block_size=64)))


def test_quantized_all_gather() -> None:
    _assert_clean(_quantized())


@distributed(world_size=4)
def _tensor_parallel() -> dict[str, Any]:
    from tests.parallel.tp_common import TPModel, data, dp_slice, mesh_2d, shard_2d, tensor_parallel
    from tests.parallel.tp_common import loss_fn as tp_loss

    mesh = mesh_2d()

    def loop(model: nn.Module, _: StreamStandIn | None) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y in data(2):
            loss = tp_loss(model(dp_slice(x, mesh)), dp_slice(y, mesh))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    return _run(lambda m: shard_2d(tensor_parallel(m, mesh["tp"]), fully_shard, mesh["dp"]),  # type: ignore[arg-type]
                loop=loop, model=TPModel)


def test_tensor_parallel_2d() -> None:
    _assert_clean(_tensor_parallel())


@distributed(world_size=2)
def _shared_comm_ctx() -> dict[str, Any]:
    from tests.core.test_surface_runtime import _Chunk

    def shard(chunks: nn.ModuleList) -> nn.ModuleList:
        for chunk in chunks:
            fully_shard(chunk.mid)
            fully_shard(chunk)
        share_comm_ctx(list(chunks))  # type: ignore[arg-type]
        return chunks

    def loop(chunks: nn.Module, _: StreamStandIn | None) -> list[float]:
        opt = torch.optim.AdamW(chunks.parameters(), lr=1e-2)
        losses = []
        for x, y in batches(2, batch=8, vocab=97):
            loss = loss_fn(chunks[1](chunks[0](local_slice(x))), local_slice(y))  # type: ignore[index]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    return _run(shard, loop=loop, model=lambda: nn.ModuleList([_Chunk(True), _Chunk(False)]))  # type: ignore[arg-type]


def test_share_comm_ctx_two_roots_on_one_context() -> None:
    _assert_clean(_shared_comm_ctx())


@distributed(world_size=2)
def _reset_iter_state() -> dict[str, Any]:
    from tests.core.test_surface_runtime import _failing_step

    def loop(model: nn.Module, _: StreamStandIn | None) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step, (x, y) in enumerate(batches(3, batch=8)):
            if step:  # a forward, then a backward, that raise; reset_iter_state; the step again
                _failing_step(model, ("forward", "backward_mid")[step - 1])  # type: ignore[arg-type]
                opt.zero_grad()
            loss = loss_fn(model(local_slice(x)), local_slice(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    return _run(lambda m: _shard(m), loop=loop)


def test_reset_iter_state_after_failed_forward_and_backward() -> None:
    _assert_clean(_reset_iter_state())


@distributed(world_size=2)
def _optimizer_in_backward() -> dict[str, Any]:
    def loop(model: nn.Module, _: StreamStandIn | None) -> list[float]:
        optims = {id(p): torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

        def step(p: torch.Tensor) -> None:
            optims[id(p)].step()
            optims[id(p)].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
        losses = []
        for x, y in batches(2, batch=8):
            loss = loss_fn(model(local_slice(x)), local_slice(y))
            loss.backward()
            losses.append(loss.item())
        return losses

    return _run(lambda m: _shard(m), loop=loop)


def test_optimizer_in_backward() -> None:
    _assert_clean(_optimizer_in_backward())


@distributed(world_size=4)
def _hsdp_reduce_dtype(mp: MixedPrecisionPolicy) -> dict[str, Any]:
    def shard(m: TinyGPT) -> TinyGPT:
        return _shard(m, mp_policy=mp, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))

    return _run(shard)


def test_hsdp_with_a_reduce_dtype_other_than_the_param_dtype() -> None:
    _assert_clean(_hsdp_reduce_dtype(MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
                  + _hsdp_reduce_dtype(BF16))


# --- the library's runs are reported once an ordering is missing ---------------------------------------
# Mutations through the simulated device's waits and events, the public set_post_optim_event, and one
# CommContext verb: the gathered buffer let go without the copy-in stream's wait on its copy-out (held
# in forward, let go at once in backward: either way the next copy-in's allocation may take the block
# while the copy-out on compute still reads it).
@distributed(world_size=2)
def _mutated(mutation: str) -> dict[str, Any]:
    saved = (SimStream.wait_event, SimStream.wait_stream, SimStream.record_event, SimEvent.synchronize)
    release = streams.CommContext.release_all_gather_buffer

    def drops(wait: Callable[..., None], waiter: str) -> Callable[..., None]:
        def mutated(stream: SimStream, other: Any) -> None:
            if (stream.name == "compute") != (waiter == "compute"):
                wait(stream, other)
        return mutated

    def early(stream: SimStream, event: SimEvent | None = None) -> SimEvent:  # one op before the record
        event = saved[2](stream, event)
        event.clock[stream] -= 1
        return event

    if mutation in ("compute", "side"):  # the compute stream (or every side stream) ignores its waits
        SimStream.wait_event, SimStream.wait_stream = drops(saved[0], mutation), drops(saved[1], mutation)  # type: ignore[method-assign]
    elif mutation == "early events":
        SimStream.record_event = early  # type: ignore[method-assign]
    elif mutation == "no host sync":
        SimEvent.synchronize = lambda event: None  # type: ignore[method-assign]
    elif mutation == "gathered buffer let go unwaited":
        streams.CommContext.release_all_gather_buffer = (  # type: ignore[method-assign]
            lambda ctx: setattr(ctx, "all_gather_state", None))
    try:
        if mutation == "post-optim event before the step":
            return _run(lambda m: _shard(m), loop=_post_optim_loop(early=True))
        offload = mutation == "no host sync"
        policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
        return _run(lambda m: _shard(m, **policy), steps=1, offload=offload)
    finally:
        SimStream.wait_event, SimStream.wait_stream, SimStream.record_event, SimEvent.synchronize = saved  # type: ignore[method-assign]
        streams.CommContext.release_all_gather_buffer = release  # type: ignore[method-assign]


@pytest.mark.parametrize("mutation, reported", [
    ("compute", "reads"),  # e.g. the copy-out reading the gathered buffer before the all-gather ran
    ("side", "may still run"),  # e.g. the all-gather reading the buffer before its copy-in ran
    ("early events", "not waited"),
    ("no host sync", "on host"),  # CPU offload: the optimizer reads grads the D2H copies may still write
    ("post-optim event before the step", "all_gather_copy_in reads"),  # the copy-in reads shards mid-step
    ("gathered buffer let go unwaited", "may still use it"),  # reallocated on the copy-in stream too early
])
def test_a_missing_ordering_in_a_library_run_is_reported(mutation: str, reported: str) -> None:
    for r in _mutated(mutation):
        assert r["violations"], f"{mutation}: the stand-in saw no race"
        assert any(reported in v for v in r["violations"]), r["violations"][:5]
