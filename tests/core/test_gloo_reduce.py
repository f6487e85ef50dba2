"""On gloo the reduce-scatter is an in-place all-reduce of the library's own reduce input (design/data-path.md):
bitwise the same gradients as gloo's own reduce-scatter, and the input is let go when the collective ends,
before the host waits for it. And the CPU queue's rule: a backward's first third of reduces finish at once."""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import torch

from fully_shard.comm import collectives
from fully_shard.core.reduce import ReduceQueue, Reducer
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

    def checking_push(self: ReduceQueue, reducer: Reducer) -> None:
        item = reducer.pending[-1]
        record: dict[str, Any] = {"in_place": item.in_place}
        if item.in_place:
            assert item.cpu_input is not None or item.reduce_scatter.done()
            inp = weakref.ref(item.cpu_input) if item.cpu_input is not None else None
            deadline = time.monotonic() + 30
            while not item.reduce_scatter.done():  # both ranks issued it: gloo's thread completes it
                assert time.monotonic() < deadline, "the all-reduce did not complete"
                time.sleep(0.001)
            gc.collect()
            record.update(dropped=item.cpu_input is None, freed=inp is None or inp() is None,
                          output=item.output is not None and item.output.numel() == item.flat.shard_numel)
        seen.append(record)
        push(self, reducer)

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


def _finish_order(units: int, *, accelerated: bool = False) -> list[tuple[str, list[str]]]:
    """Per push of a backward over ``units`` units: which reduces were finished by then."""
    queue = ReduceQueue(accelerated=accelerated)
    queue.units = units
    finished: list[str] = []
    seen = []
    for i in reversed(range(units)):
        group = _FakeReducer(f"u{i}", finished)
        queue.make_room(group)  # type: ignore[arg-type]
        queue.push(group)  # type: ignore[arg-type]
        seen.append((group.name, list(finished)))
    queue.drain()
    assert finished == [f"u{i}" for i in reversed(range(units))]
    return seen


def test_first_third_of_a_backward_finishes_at_once_on_cpu() -> None:
    seen = _finish_order(15)  # the memory benchmark's 14 blocks + root: 5 at once, then one in flight
    assert [len(done) for _, done in seen] == [1, 2, 3, 4, 5] + list(range(5, 15)), seen
    assert ReduceQueue(accelerated=False).at_once == 1  # at least one (a single unit)
    accelerated = _finish_order(6, accelerated=True)  # two in flight, none at once
    assert [len(done) for _, done in accelerated] == [0, 0, 1, 2, 3, 4], accelerated
