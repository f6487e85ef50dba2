"""Reducer.finish on CPU, seen through FSDP1's NO_SHARD (an HSDP (W, 1) mesh): the replicas' all-reduce of each
reduced gradient must be waited before the gradient is assigned. The host waits for the reduce-scatter before
issuing the all-reduce, and ``Reducer.finish`` used to settle only when the last reduce-scatter was unwaited,
so where the CPU budget deferred the wait (activations far above the gradients) the gradient was read while
its all-reduce was in flight: torch's test_fsdp_grad_acc (NO_SHARD) found gradients differing across ranks.
The all-reduce here only runs when waited (a lazy work handle), so a gradient assigned without the wait is
this rank's own, unreduced one."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.distributed.harness import distributed


class _LazyWork:
    def __init__(self, run: Any) -> None:
        self._run, self._done = run, False

    def get_future(self) -> Any:
        raise RuntimeError("no future: keep the work handle")

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._run()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


@distributed(world_size=2)
def _grads_after_backward() -> dict[str, Any]:
    from fully_shard import FullyShardedDataParallel as FSDP
    from fully_shard import ShardingStrategy
    from fully_shard.comm import collectives
    from fully_shard.wrap import ModuleWrapPolicy

    original = collectives.all_reduce

    def lazy_all_reduce(tensor: torch.Tensor, group: Any, op: Any, *, async_op: bool = False) -> Any:
        if not async_op:
            return original(tensor, group, op, async_op=False)
        return _LazyWork(lambda: original(tensor, group, op, async_op=False))

    collectives.all_reduce = lazy_all_reduce
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        model = FSDP(copy.deepcopy(plain), sharding_strategy=ShardingStrategy.NO_SHARD,
                     auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        torch.manual_seed(1 + dist.get_rank())
        x = torch.randn(4096, 8)  # activations far above the gradients: the CPU budget defers the wait
        model(x).sum().backward()
        plain(x).sum().backward()
        expected = []
        for p in plain.parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            expected.append(g / dist.get_world_size())
        got = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for p in model.parameters()]
        return {"max_diff": max(float((a - b).abs().max()) for a, b in zip(got, expected))}
    finally:
        collectives.all_reduce = original


def test_no_shard_gradients_are_the_all_reduced_mean_after_backward() -> None:
    for r in _grads_after_backward():
        assert r["max_diff"] < 1e-6, (f"expected NO_SHARD gradients to be the ranks' mean after backward, found "
                                      f"them {r['max_diff']} away (the replicas' all-reduce was not waited before "
                                      "the gradient was assigned). Fix: Reducer.finish waits unwaited all-reduces")
