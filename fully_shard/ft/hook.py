"""ReplicaAllReduce: the all-reduce hook that averages a unit's gradient shard over the replica groups.

Each replica group is its own fully_shard job; this hook runs after a unit's reduce-scatter (the group's
average over its shard ranks) and makes it the average over the replica groups as well, through torchft's
``Manager.allreduce``: a SUM over the managed process group of the current quorum, then a division by
``manager.num_participants()``. What that counts is the point (design/fault-tolerance.md, "What the
all-reduce divides by"): the replica groups whose gradient is in the sum. A group that heals in this step
(it computed its gradient with stale weights) or a spare contributes zeros and is not counted; every
other member of the quorum contributes and is counted. The one torchft setting where the count is wrong
(``init_sync=True`` with the asynchronous quorum: at step 0 every group but one "heals", contributes
zeros, yet is counted) is refused by ``fault_tolerant()``.

The hook waits for its all-reduce: the reduced shard becomes the parameter's ``.grad`` right after it
returns. An error (a peer died) is recorded by the manager, which then votes against committing the
step; the shard's contents are then meaningless and never reach the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ReduceOp

__all__ = ["ReplicaAllReduce"]


class ReplicaAllReduce:
    """``hook(shard)``: average ``shard`` in place over the replica groups contributing to this step."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.calls = 0  # all-reduces issued (one per unit and group per backward)

    def __call__(self, shard: torch.Tensor) -> None:
        self.calls += 1
        self.manager.allreduce(shard, reduce_op=ReduceOp.AVG).wait()

    def __repr__(self) -> str:
        return f"ReplicaAllReduce({type(self.manager).__name__}, calls={self.calls})"
