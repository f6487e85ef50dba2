"""On gloo the reduce-scatter is an in-place all-reduce of the library's own reduce input (design/data-path.md):
bitwise the same gradients as gloo's own reduce-scatter, and the input is let go when the collective ends,
before the host waits for it. And the CPU queue's rule: a reduce's input stays in flight only within the
bytes the backward has released (this rank's shapes), while where a reduce finishes (its hooks, which may
communicate) is the same on every rank, whatever their batch shapes."""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fully_shard import fully_shard
from fully_shard.comm import collectives, trace
from fully_shard.core.reduce import ReduceBytes, ReduceQueue, Reducer
from tests.core.common import local_slice, shard_gpt
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


def _grads(in_place: bool) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, int]]]:
    original = collectives.reduce_scatter_is_all_reduce
    if not in_place:
        collectives.reduce_scatter_is_all_reduce = lambda group: False  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        model = shard_gpt(TinyGPT(n_blocks=2))
        x, y = batches(1)[0]
        loss = loss_fn(model(local_slice(x)), local_slice(y))
        with CountCollectives() as counted:
            loss.backward()
        counts = {"issued": dict(counted.issued), "as_torch": dict(counted.counts)}
        return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}, counts
    finally:
        collectives.reduce_scatter_is_all_reduce = original  # type: ignore[assignment]


@distributed(world_size=4)
def _same_as_gloo_reduce_scatter() -> dict[str, Any]:
    ours, counts = _grads(in_place=True)
    gloo, gloo_counts = _grads(in_place=False)
    different = [n for n in ours if not torch.equal(ours[n], gloo[n])]
    return {"different": different, "counts": counts, "gloo_counts": gloo_counts}


def test_in_place_all_reduce_is_bitwise_gloo_reduce_scatter() -> None:
    for rank in _same_as_gloo_reduce_scatter():  # 4 ranks, TinyGPT's uneven shards and 0-dim params
        assert rank["different"] == [], rank["different"]
        # what was issued: one all-reduce per unit (3) where gloo's own path issues a reduce-scatter (and
        # the two blocks' backward all-gathers); in torch's terms (tests/distributed/counting.py, the
        # trace's issued_as) the same counts
        assert rank["counts"]["issued"] == {"all_gather": 2, "all_reduce": 3}, rank["counts"]
        assert rank["gloo_counts"]["issued"] == {"all_gather": 2, "reduce_scatter": 3}, rank["gloo_counts"]
        torch_terms = {"all_gather": 2, "reduce_scatter": 3}
        assert rank["counts"]["as_torch"] == rank["gloo_counts"]["as_torch"] == torch_terms, rank


@distributed(world_size=2)
def _released_before_wait() -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    push = ReduceQueue.push

    def checking_push(self: ReduceQueue, reducer: Reducer, nbytes: ReduceBytes | None = None) -> None:
        item = reducer.pending[-1]
        record: dict[str, Any] = {"in_place": item.in_place}
        if item.in_place:
            assert item.cpu_input is not None or item.reduce_scatter.done()
            inp = weakref.ref(item.cpu_input) if item.cpu_input is not None else None
            deadline = time.monotonic() + 30
            while not item.reduce_scatter.done():  # both ranks issued it: gloo's thread completes it
                assert time.monotonic() < deadline, "the all-reduce did not complete"
                time.sleep(0.001)
            # the backend's work drops its own reference just after the future completes (gloo's thread,
            # a moment later): poll for it, still before any wait; never freed fails at the deadline
            freed = False
            while not freed and time.monotonic() < deadline:
                gc.collect()
                freed = inp is None or inp() is None
                if not freed:
                    time.sleep(0.001)
            record.update(dropped=item.cpu_input is None, freed=freed,
                          output=item.output is not None and item.output.numel() == item.flat.shard_numel)
        seen.append(record)
        push(self, reducer, nbytes)

    ReduceQueue.push = checking_push  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        model = shard_gpt(TinyGPT(n_blocks=2))
        x, y = batches(1)[0]
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
    finally:
        ReduceQueue.push = push  # type: ignore[method-assign]
    return seen


def test_input_released_when_the_all_reduce_completes() -> None:
    for seen in _released_before_wait():
        assert len(seen) == 3 and all(r["in_place"] for r in seen), seen  # two blocks and the root
        for record in seen:  # before any wait: the row was taken and the input freed in gloo's thread
            assert record["dropped"] and record["freed"] and record["output"], record



class _FakeReducer:
    """What ReduceQueue reads of a reducer: its settings, settle() and finish()."""

    def __init__(self, name: str, finished: list[str], settled: list[str]) -> None:
        self.name, self.finished, self.settled = name, finished, settled
        self.settings = type("S", (), {"max_input_buffers": None})()

    def settle(self) -> None:
        self.settled.append(self.name)

    def finish(self) -> None:
        self.finished.append(self.name)


def _queue_order(units: list[ReduceBytes], *, accelerated: bool = False) -> tuple[list[int], list[int]]:
    """A backward over ``units`` (in backward order): after each push, how many reduces were settled (input
    let go: this rank's budget) and how many finished (hooks and grads: the limit alone)."""
    queue = ReduceQueue(accelerated=accelerated)
    finished: list[str] = []
    settled: list[str] = []
    seen_settled, seen_finished = [], []
    for i, nbytes in enumerate(units):
        group = _FakeReducer(f"u{i}", finished, settled)
        queue.make_room(group)  # type: ignore[arg-type]
        queue.push(group, nbytes)  # type: ignore[arg-type]
        seen_settled.append(len(settled))
        seen_finished.append(len(finished))
    queue.drain()
    assert finished == [f"u{i}" for i in range(len(units))] and queue.released == 0
    return seen_settled, seen_finished


def test_cpu_queue_holds_a_reduce_only_within_what_the_backward_released() -> None:
    one_behind = [0, 1, 2, 3, 4, 5, 6, 7, 8]  # CPU: a reduce finishes when the next is pushed, whatever the bytes
    # each unit: a 12-byte input, a 6-byte shard, and 8 bytes of activations: the backward releases 2
    # bytes per unit, so the 6th reduce is the first whose input fits (released 12 >= 12)
    slow = [ReduceBytes(input=12, kept=6, released=8)] * 9
    assert _queue_order(slow) == ([1, 2, 3, 4, 5, 5, 5, 5, 5], one_behind)
    # 10 bytes of activations per unit: 4 per unit, held from the 3rd reduce on
    assert _queue_order([ReduceBytes(12, 6, 10)] * 6) == ([1, 2, 2, 2, 2, 2], one_behind[:6])
    # activations below the shard left behind: the backward's memory grows, every input let go at once
    assert _queue_order([ReduceBytes(12, 6, 5)] * 4) == ([1, 2, 3, 4], one_behind[:4])
    # a large last unit (the root) after small ones: held only when its own input fits
    assert _queue_order([ReduceBytes(4, 2, 8)] * 3 + [ReduceBytes(40, 20, 8)]) == ([0, 0, 0, 1], one_behind[:4])
    # accelerators: two in flight, never settled early, whatever the bytes
    assert _queue_order([ReduceBytes(12, 6, 0)] * 6, accelerated=True) == ([0] * 6, [0, 0, 1, 2, 3, 4])
    assert _queue_order([None] * 3) == ([1, 2, 3], [0, 1, 2])  # type: ignore[list-item]  # bytes unknown: settled


@distributed(world_size=2)
def _in_flight_in_a_backward(batch: int, dim: int, hidden: int) -> list[dict[str, Any]]:
    """Each reduce of one backward: its unit, its input bytes, and whether it was finished at once."""
    torch.manual_seed(0)
    model = shard_gpt(TinyGPT(dim=dim, hidden=hidden))
    x, y = batches(1, batch=batch)[0]
    loss = loss_fn(model(local_slice(x)), local_slice(y))
    held: list[bool] = []  # per push: the reduce's input still held after it (in flight behind the next unit)
    push = ReduceQueue.push

    def recording_push(self: ReduceQueue, reducer: Reducer, nbytes: ReduceBytes | None = None) -> None:
        push(self, reducer, nbytes)
        held.append(bool(reducer.pending) and not reducer.pending[-1].reduce_scatter.waited)

    ReduceQueue.push = recording_push  # type: ignore[method-assign]
    try:
        with trace.record() as events:
            loss.backward()
    finally:
        ReduceQueue.push = push  # type: ignore[method-assign]
    out, open_ = [], set()
    for e in events:
        if e.kind is trace.EventKind.REDUCE_SCATTER:
            out.append({"fqn": e.fqn, "input": e.nbytes, "in_flight_before": len(open_),
                        "at_once": not held[len(out)]})
            open_.add(e.fqn)
        elif e.kind is trace.EventKind.REDUCE_DONE:
            open_.remove(e.fqn)
    # the rule, from the model's own shapes: a block's Linears keep (rows x in_features) fp32 inputs for
    # their weight gradients; the block leaves half its input (2 ranks) as its shard
    rows = local_slice(x).numel()
    released = 0
    for r in out[:-1]:  # the blocks (the root's is the backward's last reduce)
        block = model.get_submodule(r["fqn"])
        in_features = sum(p.shape[1] for p in block.parameters() if p.dim() == 2)
        released += rows * in_features * 4 - r["input"] // 2
        r["fits"] = released >= r["input"]
    return out


def test_reduces_in_flight_follow_the_budget_on_two_shapes() -> None:
    for batch, dim, hidden, at_once in ((16, 60, 157, 2), (4, 96, 384, 4)):
        for reduces in _in_flight_in_a_backward(batch, dim, hidden):
            assert [r["fqn"] for r in reduces] == ["blocks.2", "blocks.1", "blocks.0", ""], reduces
            assert all(r["in_flight_before"] <= 1 for r in reduces), reduces  # one at a time on CPU
            # a reduce's input is held in flight exactly where it fits in what the backward released (else the
            # host waits for it at once: settled; it finishes, one unit later, where the limit puts it)
            assert [r["at_once"] for r in reduces[:-1]] == [not r["fits"] for r in reduces[:-1]], reduces
            # 8 sequences of 16 per rank: blocks.2 at once, then in flight; 2 of width 96: every reduce at once
            assert sum(r["at_once"] for r in reduces) == at_once, reduces  # (the root's, the last, settled at once)


def _uneven_batches(shard: Any) -> dict[str, Any]:
    """Two steps of four Linear units on this rank's batch (1 row on rank 0, 64 on rank 1: the CPU queue's
    budget would keep a reduce in flight on rank 1 only), with an all-reduce hook that communicates over the
    units' own process group (a gradient-norm logger)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    for layer in model:
        shard(layer)
    shard(model)
    group = model[0].weight.device_mesh.get_group()  # the group the units' all-gathers and reduces run on
    norms: list[torch.Tensor] = []

    def log_norm(shard_grad: torch.Tensor) -> None:
        square = shard_grad.detach().pow(2).sum().reshape(1)
        dist.all_reduce(square, group=group)
        norms.append(square)

    for layer in model:
        layer.set_all_reduce_hook(log_norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    steps = []
    for step in range(2):
        torch.manual_seed(10 * step + rank)
        loss = model(torch.randn((1, 64)[rank], 16)).pow(2).mean()
        loss.backward()
        steps.append({"loss": loss.detach(), "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad()
    return {"steps": steps, "norms": torch.cat(norms)}


@distributed(world_size=2, timeout=150)
def _uneven_batches_side_by_side() -> dict[str, Any]:
    from tests.torch_ref import lacks_method

    out = {"ours": _uneven_batches(fully_shard)}
    if lacks_method("set_all_reduce_hook") is None:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        out["torch"] = _uneven_batches(torch_fully_shard)
    return out


def test_ranks_with_other_batch_sizes_finish_reduces_alike() -> None:
    """Every decision that orders collectives is the same on every rank: a reduce's finish runs the all-reduce
    hook (here a collective on the units' own group), so where it runs may not depend on this rank's batch
    shape (design/data-path.md). Before, rank 0 finished each reduce at once and rank 1 one unit later: the
    hook's all-reduce met the other rank's all-gather (a gloo error or a hang, the harness's timeout)."""
    from tests.torch_ref import lacks_method

    for rank, out in enumerate(_uneven_batches_side_by_side()):
        ours = out["ours"]
        assert ours["norms"].numel() == 8, (rank, ours["norms"])  # 4 units x 2 steps, one hook call each
        if "torch" not in out:
            continue
        ref = out["torch"]
        assert torch.equal(ours["norms"], ref["norms"]), (rank, ours["norms"], ref["norms"])
        for step, (mine, theirs) in enumerate(zip(ours["steps"], ref["steps"])):
            assert torch.equal(mine["loss"], theirs["loss"]), (rank, step)
            for name, grad in theirs["grads"].items():
                assert torch.equal(mine["grads"][name], grad), (rank, step, name)
    reason = lacks_method("set_all_reduce_hook")
    if reason:
        pytest.skip(reason)
