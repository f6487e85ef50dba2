"""Side-by-side recipes: the same tiny decoder sharded by this library and by torch's fully_shard.

A torchtitan-shaped model (embedding, residual MLP blocks, final norm, lm_head) whose ``[norm,
lm_head]`` pair is one grouped unit, plus helpers to compare losses and gradients across the two.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard

VOCAB, DIM, SEQ = 40, 16, 8
Shard = Callable[..., Any]


def torch_shard() -> Shard:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard


LIBS: dict[str, Callable[[], Shard]] = {"ours": lambda: fully_shard, "torch": torch_shard}


class Decoder(nn.Module):
    def __init__(self, n_blocks: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.tok(idx)
        for blk in self.blocks:
            h = h + blk(h)
        h = self.norm(h)
        return h if skip_head else self.head(h)


def shard_decoder(model: Decoder, shard: Shard, *, group_raf: bool = True, **kwargs: Any) -> Decoder:
    """Blocks one unit each, ``[norm, head]`` one grouped unit, the root last (torchtitan's layout)."""
    for blk in model.blocks:
        shard(blk, **kwargs)
    shard([model.norm, model.head], reshard_after_forward=group_raf, **kwargs)
    shard(model, **kwargs)
    return model


def decoder_pair(libs: dict[str, Callable[[], Shard]] | None = None,
                 **kwargs: Any) -> tuple[Decoder, dict[str, Decoder]]:
    """An unsharded reference and the same weights sharded by each library (``libs``, default ``LIBS``)."""
    torch.manual_seed(0)
    ref = Decoder()
    return ref, {lib: shard_decoder(copy.deepcopy(ref), make(), **kwargs) for lib, make in (libs or LIBS).items()}


def tokens(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def rank_rows(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * per:(dist.get_rank() + 1) * per]


def ce_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1), reduction="sum")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's global gradient (None where it has none), in fp32."""
    return {n: None if p.grad is None else full(p.grad).detach().float().clone()
            for n, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    """Worst |a - b| over the entries; a None on one side only is a mismatch (raises)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for name, x in a.items():
        y = b[name]
        assert (x is None) == (y is None), f"{name}: grad {'None' if x is None else 'set'} vs " \
                                           f"{'None' if y is None else 'set'}"
        if x is not None and y is not None and x.numel():
            worst = max(worst, (x - y).abs().max().item())
    return worst


def reference_grads(ref: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The unsharded model's gradients of a global-batch loss, averaged like the sharded ones: the
    global loss is the sum of the per-rank losses, the sharded grads their mean, so ``.grad`` is
    divided by W in place (an optimizer on ``ref`` then takes the same step)."""
    ref.zero_grad(set_to_none=True)
    loss.backward()
    world = dist.get_world_size()
    for p in ref.parameters():
        if p.grad is not None:
            p.grad.div_(world)
    return grads(ref)


def global_sum(x: torch.Tensor) -> float:
    x = x.detach().float().clone()
    dist.all_reduce(x)
    return x.item()
