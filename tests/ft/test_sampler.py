"""StepSampler: batches keyed by the manager's step and the replica id (no process group needed)."""

from __future__ import annotations

import pytest

from fully_shard.ft import StepSampler


class _Manager:
    def __init__(self) -> None:
        self.step = 0

    def current_step(self) -> int:
        return self.step


def _sampler(replica: int, rank: int, **kw: object) -> StepSampler:
    args: dict[str, object] = dict(batch_size=3, replica_id=replica, num_replica_groups=2, group_rank=rank,
                                   group_world_size=2)
    args.update(kw)
    return StepSampler(50, **args)  # type: ignore[arg-type]


def test_slots_partition_the_global_batch_of_each_step() -> None:
    samplers = [_sampler(r, g) for r in range(2) for g in range(2)]
    assert samplers[0].steps_per_epoch == 4  # 50 // 12
    seen_epoch: set[int] = set()
    for step in range(4):
        parts = [s.indices(step) for s in samplers]
        assert [i for p in parts for i in p] == samplers[0].global_batch(step)  # slot order
        assert all(len(p) == 3 for p in parts) and len({i for p in parts for i in p}) == 12
        seen_epoch |= {i for p in parts for i in p}
    assert len(seen_epoch) == 48  # an epoch never repeats a sample
    assert samplers[0].global_batch(4) != samplers[0].global_batch(0)  # a new permutation each epoch
    assert _sampler(0, 0, shuffle=False).global_batch(1) == list(range(12, 24))


def test_the_batch_follows_the_manager_step_not_a_local_counter() -> None:
    manager = _Manager()
    sampler = _sampler(1, 0, manager=manager)
    it = iter(sampler)
    first = next(it)
    assert next(it) == first  # an uncommitted step is retried on the same batch
    manager.step = 7  # a heal jumped to the peer's step
    assert next(it) == sampler.indices(7) == _sampler(1, 0).indices(7)
    assert _sampler(1, 0, seed=1).indices(7) != sampler.indices(7)


def test_bad_arguments_say_what_and_the_fix() -> None:
    with pytest.raises(ValueError, match="replica_id 2 must be < num_replica_groups 2"):
        _sampler(2, 0)
    with pytest.raises(ValueError, match="cannot fill one global batch of 60"):
        StepSampler(50, batch_size=5, replica_id=0, num_replica_groups=3, group_rank=0, group_world_size=4)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        _sampler(0, 0, batch_size=0)
    with pytest.raises(ValueError, match="pass step= or build the sampler with manager="):
        _sampler(0, 0).indices()
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        _sampler(0, 0).indices(-1)
