"""Shared recipes for the core multi-rank tests: sharded vs unsharded training on one global batch."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from tests.models import AuxGPT, TinyGPT, batches, loss_fn


def shard_gpt(model: TinyGPT, **kwargs: object) -> TinyGPT:
    for blk in model.blocks:
        fully_shard(blk, **kwargs)  # type: ignore[arg-type]
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})  # type: ignore[arg-type]
    return model


def shard_aux(model: AuxGPT, fs: Callable[..., object] = fully_shard) -> AuxGPT:
    """``AuxGPT`` as units (aux, blocks, root) with ``reshard_after_backward=False`` (``fs``: ours or torch's)."""
    fs(model.aux)
    for block in model.blocks:
        fs(block)
    fs(model)
    model.set_reshard_after_backward(False)  # type: ignore[operator]
    return model


def train_aux(model: nn.Module, steps: int = 4) -> list[float]:
    """AdamW on this rank's slices; the auxiliary loss counts on even steps, and the optimizer keeps stepping
    the auxiliary head on odd steps (its grads zeroed, not dropped). This rank's losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(batches(steps, batch=4)):
        logits, aux = model(local_slice(x))
        loss = loss_fn(logits, local_slice(y))
        if step % 2 == 0:
            loss = loss + aux.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses


def local_slice(t: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def global_mean(x: torch.Tensor) -> float:
    x = x.detach().float().clone()  # bf16 losses would lose digits in the all-reduce
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def train_pair(make: Callable[[], nn.Module], shard: Callable[[nn.Module], nn.Module], steps: int = 10,
               batch: int = 12, lr: float = 1e-2) -> tuple[list[float], list[float], float]:
    """Train a sharded model (local batch slices) and an unsharded copy (global batch) side by side.

    Returns (sharded losses averaged over ranks, reference losses, max |param diff| at the end).
    """
    torch.manual_seed(0)
    ref = make()
    model = shard(copy.deepcopy(ref))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses, ref_losses = [], []
    for x, y in batches(steps, batch=batch):
        loss, ref_loss = step_pair(model, ref, opt, ref_opt, x, y)
        losses.append(loss)
        ref_losses.append(ref_loss)
    return losses, ref_losses, max_param_diff(model, ref)


def step_pair(model: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer,
              x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One optimizer step of the sharded model on this rank's slice and of the reference on the global
    batch; returns (sharded loss averaged over ranks, reference loss)."""
    loss = loss_fn(model(local_slice(x)), local_slice(y))
    loss.backward()
    opt.step()
    opt.zero_grad()
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return global_mean(loss), ref_loss.item()


def max_param_diff(model: nn.Module, ref: nn.Module) -> float:
    """Worst |sharded - reference| over all parameters (DTensors gathered, compared in fp32)."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        if value.numel():
            worst = max(worst, (value.detach().float() - ref_params[name].detach().float()).abs().max().item())
    return worst
