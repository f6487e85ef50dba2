"""StepSampler: the sample indices of one optimizer step for one rank, keyed by the manager's step.

Under torchft a local step counter is wrong twice over: a step the quorum does not commit is retried on
the same batch, and a replica group that heals jumps to its peer's step. So the batch is a function of
``manager.current_step()`` (the number of committed steps) and of where the rank sits among all ranks that
could train: slot ``replica_id * group_world_size + group_rank`` of ``num_replica_groups *
group_world_size``. Step ``s`` reads window ``s`` of an epoch's permutation (a new permutation, seeded,
each epoch); each slot takes ``batch_size`` consecutive indices of that window, so the global batch of a
step is the same whoever is alive, and a group that is down simply leaves its slots out (torchft's data
model: lossy, never duplicated within a step).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["StepSampler"]


class StepSampler(Sampler[list[int]]):
    """Indices of step ``s`` for this rank: ``indices(s)``; iterating yields ``indices(manager.current_step())``
    each time a batch is asked for (use it with ``DataLoader(batch_sampler=...)`` and ``num_workers=0``, or
    call ``indices()`` after ``optimizer.zero_grad()``: a synchronous quorum may heal there)."""

    def __init__(self, num_samples: int, *, batch_size: int, replica_id: int, num_replica_groups: int,
                 group_rank: int | None = None, group_world_size: int | None = None, manager: Any = None,
                 shuffle: bool = True, seed: int = 0) -> None:
        if group_rank is None or group_world_size is None:
            if not dist.is_initialized():
                raise ValueError("StepSampler: pass group_rank= and group_world_size= (no default process group).")
            group_rank = dist.get_rank() if group_rank is None else group_rank
            group_world_size = dist.get_world_size() if group_world_size is None else group_world_size
        for name, value, low in (("batch_size", batch_size, 1), ("num_replica_groups", num_replica_groups, 1),
                                 ("group_world_size", group_world_size, 1), ("replica_id", replica_id, 0),
                                 ("group_rank", group_rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"StepSampler: {name} must be an int >= {low}, got {value!r}")
        if replica_id >= num_replica_groups or group_rank >= group_world_size:
            raise ValueError(f"StepSampler: replica_id {replica_id} must be < num_replica_groups {num_replica_groups} "
                             f"and group_rank {group_rank} < group_world_size {group_world_size}. Fix: replica ids "
                             "are 0..num_replica_groups-1 (torchft's replica_id without its name prefix).")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.slots = num_replica_groups * group_world_size
        self.slot = replica_id * group_world_size + group_rank
        self.global_batch_size = batch_size * self.slots
        if num_samples < self.global_batch_size:
            raise ValueError(f"StepSampler: {num_samples} samples cannot fill one global batch of "
                             f"{self.global_batch_size} ({num_replica_groups} replica groups x {group_world_size} "
                             f"ranks x batch_size {batch_size}). Fix: a smaller batch_size or more data.")
        self.steps_per_epoch = num_samples // self.global_batch_size
        self.manager = manager
        self.shuffle = shuffle
        self.seed = seed

    def global_batch(self, step: int) -> list[int]:
        """Every slot's indices of ``step``, in slot order (what an unsharded reference trains on)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"StepSampler: step must be an int >= 0, got {step!r}")
        epoch, window = divmod(step, self.steps_per_epoch)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        start = window * self.global_batch_size
        return order[start:start + self.global_batch_size].tolist()

    def indices(self, step: int | None = None) -> list[int]:
        """This rank's indices of ``step`` (default: the manager's current step)."""
        if step is None:
            if self.manager is None:
                raise ValueError("StepSampler.indices(): pass step= or build the sampler with manager=")
            step = int(self.manager.current_step())
        batch = self.global_batch(step)
        return batch[self.slot * self.batch_size:(self.slot + 1) * self.batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.indices()
