"""On gloo the reduce-scatter is an in-place all-reduce of the library's own reduce input (design/data-path.md):
bitwise the same gradients as gloo's own reduce-scatter, and the input is let go when the collective ends,
before the host waits for it. And the CPU queue's rule: a reduce stays in flight only within the bytes the
backward has released."""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import torch

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
    """What ReduceQueue reads of a reducer: its settings and finish()."""

    def __init__(self, name: str, finished: list[str]) -> None:
        self.name, self.finished = name, finished
        self.settings = type("S", (), {"max_input_buffers": None})()

    def finish(self) -> None:
        self.finished.append(self.name)


def _finish_order(units: list[ReduceBytes], *, accelerated: bool = False) -> list[int]:
    """A backward over ``units`` (in backward order): how many reduces were finished after each push."""
    queue = ReduceQueue(accelerated=accelerated)
    finished: list[str] = []
    seen = []
    for i, nbytes in enumerate(units):
        group = _FakeReducer(f"u{i}", finished)
        queue.make_room(group)  # type: ignore[arg-type]
        queue.push(group, nbytes)  # type: ignore[arg-type]
        seen.append(len(finished))
    queue.drain()
    assert finished == [f"u{i}" for i in range(len(units))] and queue.released == 0
    return seen


def test_cpu_queue_holds_a_reduce_only_within_what_the_backward_released() -> None:
    # each unit: a 12-byte input, a 6-byte shard, and 8 bytes of activations: the backward releases 2
    # bytes per unit, so the 6th reduce is the first whose input fits (released 12 >= 12)
    slow = [ReduceBytes(input=12, kept=6, released=8)] * 9
    assert _finish_order(slow) == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    # 10 bytes of activations per unit: 4 per unit, in flight from the 3rd reduce on
    assert _finish_order([ReduceBytes(12, 6, 10)] * 6) == [1, 2, 2, 3, 4, 5]
    # activations below the shard left behind: the backward's memory grows, every reduce at once
    assert _finish_order([ReduceBytes(12, 6, 5)] * 4) == [1, 2, 3, 4]
    # a large last unit (the root) after small ones: in flight only when its own input fits
    assert _finish_order([ReduceBytes(4, 2, 8)] * 3 + [ReduceBytes(40, 20, 8)]) == [0, 1, 2, 4]
    # accelerators: two in flight, never at once, whatever the bytes
    assert _finish_order([ReduceBytes(12, 6, 0)] * 6, accelerated=True) == [0, 0, 1, 2, 3, 4]
    assert _finish_order([None] * 3) == [1, 2, 3]  # type: ignore[list-item]  # bytes unknown: at once


@distributed(world_size=2)
def _in_flight_in_a_backward(batch: int, dim: int, hidden: int) -> list[dict[str, Any]]:
    """Each reduce of one backward: its unit, its input bytes, and whether it was finished at once."""
    torch.manual_seed(0)
    model = shard_gpt(TinyGPT(dim=dim, hidden=hidden))
    x, y = batches(1, batch=batch)[0]
    loss = loss_fn(model(local_slice(x)), local_slice(y))
    held: list[bool] = []  # per push: the reduce still pending after it (in flight behind the next unit)
    push = ReduceQueue.push

    def recording_push(self: ReduceQueue, reducer: Reducer, nbytes: ReduceBytes | None = None) -> None:
        push(self, reducer, nbytes)
        held.append(bool(reducer.pending))

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
            # a reduce is held in flight exactly where its input fits in what the backward released
            assert [r["at_once"] for r in reduces[:-1]] == [not r["fits"] for r in reduces[:-1]], reduces
            # 8 sequences of 16 per rank: blocks.2 at once, then in flight; 2 of width 96: every reduce at once
            assert sum(r["at_once"] for r in reduces) == at_once, reduces  # (the root's, the last, finishes at once)
