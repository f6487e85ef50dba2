"""Tiny factories for the tuner tests: a 2-block MLP whose blocks fail in chosen configurations."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn


class Blk(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.__dict__.get("_fsdp_state")
        if state is not None and state.reshard_after_forward is False:
            if len(state.modules) > 1:  # k=2, keep: every rank raises (a deterministic bad config)
                raise RuntimeError("test: this model refuses grouped blocks without resharding")
            if os.environ.get("FS_TUNE_TEST_CRASH") and dist.get_rank() == 1:  # k=1, keep: rank 1 dies
                os._exit(3)
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, dim: int = 32, n_blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(Blk(dim) for _ in range(n_blocks))
        self.out = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        return self.out(h)


def build_model() -> Net:
    return Net()


def build_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g)
