"""Shard -> unshard through real collectives is the identity, for random shapes and world sizes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fully_shard import fully_shard
from tests.distributed.harness import run_ranks

shapes = st.lists(
    st.one_of(st.just(()), st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple)),
    min_size=1, max_size=4)


class Params(nn.Module):
    def __init__(self, shape_list: list[tuple[int, ...]]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, generator=g)) for s in shape_list)


def _round_trip(shape_list: list[tuple[int, ...]]) -> None:
    ref = Params(shape_list)
    model = fully_shard(Params(shape_list))
    rank, world = dist.get_rank(), dist.get_world_size()
    for p, r in zip(model.ps, ref.ps):
        local = p.to_local()
        expected = r if r.dim() == 0 else (list(torch.chunk(r, world)) + [r[:0]] * world)[rank] if r.shape[0] else r
        if r.dim() and r.shape[0] and rank >= len(torch.chunk(r, world)):
            expected = r[r.shape[0]:]
        assert torch.equal(local, expected.detach()), (tuple(r.shape), rank, local.shape)
    model.unshard()
    for p, r in zip(model.ps, ref.ps):
        assert not hasattr(p, "to_local")
        assert torch.equal(p.detach(), r.detach()), tuple(r.shape)
    model.reshard()
    assert all(hasattr(p, "to_local") for p in model.ps)


@pytest.mark.parametrize("world", [2, 3, 4])
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(shape_list=shapes)
def test_shard_unshard_identity_through_collectives(world: int, shape_list: list[tuple[int, ...]]) -> None:
    run_ranks(_round_trip, world, shape_list)
