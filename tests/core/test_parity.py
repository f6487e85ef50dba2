"""Parity: sharded training equals one unsharded process on the global batch, and torch's fully_shard."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from fully_shard import fully_shard
from tests.core.common import global_mean, local_slice, shard_gpt, train_pair
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


def _parity(raf: bool | int | None) -> tuple[float, float]:
    losses, ref_losses, pdiff = train_pair(TinyGPT, lambda m: shard_gpt(m, reshard_after_forward=raf))
    ldiff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert ldiff < 2e-5, (losses, ref_losses)
    assert pdiff < 1e-3, pdiff  # AdamW turns float noise in near-zero grads into lr-sized steps
    return ldiff, pdiff


@distributed(world_size=2)
def _parity_w2(raf: bool | int | None) -> tuple[float, float]:
    return _parity(raf)


@distributed(world_size=3)
def _parity_w3(raf: bool | int | None) -> tuple[float, float]:
    return _parity(raf)


@distributed(world_size=4)
def _parity_w4(raf: bool | int | None) -> tuple[float, float]:
    return _parity(raf)


@pytest.mark.parametrize("raf", [True, False, None])
def test_parity_world2(raf: bool | None) -> None:
    _parity_w2(raf)


@pytest.mark.parametrize("raf", [True, False])
def test_parity_world3(raf: bool) -> None:
    _parity_w3(raf)


@pytest.mark.parametrize("raf", [2, 1, 4])
def test_parity_int_reshard_world4(raf: int) -> None:
    _parity_w4(raf)


def _vs_torch(steps: int, shard_placement_fn: Callable[[torch.nn.Parameter], Shard | None] | None = None) -> float:
    """Our fully_shard and torch's on copies of one model, in lockstep: the worst loss difference."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    base = TinyGPT(zero_dim=False)  # torch's fully_shard refuses 0-dim parameters
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    shard_gpt(ours, shard_placement_fn=shard_placement_fn)
    for blk in theirs.blocks:
        torch_fully_shard(blk, shard_placement_fn=shard_placement_fn)
    torch_fully_shard(theirs, shard_placement_fn=shard_placement_fn)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    worst = 0.0
    for x, y in batches(steps, batch=12):
        got = []
        for m, opt in zip((ours, theirs), opts):
            loss = loss_fn(m(local_slice(x)), local_slice(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            got.append(global_mean(loss))
        worst = max(worst, abs(got[0] - got[1]))
    assert worst < 1e-6, worst
    return worst


@distributed(world_size=2)
def _torch_parity() -> float:
    return _vs_torch(10)


def test_parity_with_torch_fully_shard() -> None:
    _torch_parity()


@distributed(world_size=2)
def _tiny_shapes() -> None:
    """0-dim params, dim0 < world, empty local shards, frozen params and buffers in one group."""

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(1.5))  # 0-dim
            self.row = torch.nn.Parameter(torch.randn(1, 5))  # dim0 = 1 < world: rank 1 holds nothing
            self.frozen = torch.nn.Parameter(torch.randn(3, 5), requires_grad=False)
            self.lin = torch.nn.Linear(5, 3)
            self.register_buffer("offset", torch.full((5,), 0.25))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * self.scale + self.row + self.offset) + (x @ self.frozen.T)

    torch.manual_seed(0)
    ref = Odd()
    model = fully_shard(copy.deepcopy(ref))
    assert model.row.to_local().shape == ((1, 5) if torch.distributed.get_rank() == 0 else (0, 5))
    assert model.scale.to_local().shape == ()
    assert not isinstance(model.offset, torch.distributed.tensor.DTensor)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(4, 5)
    for _ in range(3):
        model(local_slice(x)).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        assert model.frozen.grad is None
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), dict(ref.named_parameters())[name], atol=1e-6, rtol=1e-5)


def test_zero_dim_small_frozen_and_buffers() -> None:
    _tiny_shapes()


def _largest_dim(p: torch.nn.Parameter) -> Shard | None:
    """Shard along the largest dim, as torch's docs suggest for shard_placement_fn."""
    return Shard(max(range(p.dim()), key=lambda d: p.shape[d])) if p.dim() else None


def _dim1_if_even(p: torch.nn.Parameter) -> Shard | None:
    return Shard(1) if p.dim() == 2 and p.shape[1] % 2 == 0 else None


@distributed(world_size=2)
def _shard_placement_fn_parity() -> tuple[float, float]:
    worst = _vs_torch(5, _dim1_if_even)  # torch refuses uneven sharding on dims other than 0
    # uneven sharding along dim 1 (torch refuses it) against the unsharded reference
    losses, ref_losses, pdiff = train_pair(TinyGPT, lambda m: shard_gpt(m, shard_placement_fn=_largest_dim))
    ldiff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert ldiff < 2e-5 and pdiff < 1e-3, (ldiff, pdiff)
    torch.manual_seed(0)
    model = shard_gpt(TinyGPT(), shard_placement_fn=_largest_dim)
    down = model.blocks[0].down.weight  # (60, 157): sharded along dim 1, 79 + 78 columns
    assert down.placements == (Shard(1),)
    assert down.to_local().shape == ((60, 79) if dist.get_rank() == 0 else (60, 78))
    assert "blocks.0.down.weight f32[60, 157@shard/2] SHARDED" in model.fsdp_repr(), model.fsdp_repr()
    return worst, ldiff


def test_shard_placement_fn_other_dims_matches_torch() -> None:
    _shard_placement_fn_parity()
