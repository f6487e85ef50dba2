"""Shared helpers for the checkpoint tests: tiny uneven models, sharding recipes, training, comparisons."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from tests.models import TinyGPT, batches, loss_fn

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks, so every world size sees the same global batch


def make_gpt(seed: int = 0, **kwargs: Any) -> TinyGPT:
    """TinyGPT (vocab 997, dim 60: uneven shards, a 0-dim parameter per block) plus a persistent buffer."""
    torch.manual_seed(seed)
    kwargs.setdefault("n_blocks", 2)
    model = TinyGPT(**kwargs)
    model.register_buffer("calib", torch.linspace(0, 1, 7) * (seed + 1))  # plain tensor, written once
    return model


def shard(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """fully_shard each block, then the root (the usual recipe)."""
    for blk in getattr(model, "blocks", []):
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def hsdp_mesh(replicate: int, shard_size: int) -> DeviceMesh:
    return init_device_mesh("cpu", (replicate, shard_size), mesh_dim_names=("replicate", "shard"))


def rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_slice(t: torch.Tensor) -> torch.Tensor:
    rank, world = rank_world()
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def global_mean(x: torch.Tensor) -> float:
    x = x.detach().clone()
    rank, world = rank_world()
    if world > 1:
        dist.all_reduce(x)
    return x.item() / world


def train(model: nn.Module, opt: torch.optim.Optimizer, first: int, steps: int) -> list[float]:
    """Steps first..first+steps-1 of a fixed data stream; each rank takes its slice of the global batch."""
    return train_on(model, opt, batches(first + steps, batch=GLOBAL_BATCH)[first:])


def train_on(model: nn.Module, opt: torch.optim.Optimizer, data: list[Any]) -> list[float]:
    """One optimizer step per global batch in ``data`` (this rank's slice); the global mean losses."""
    losses = []
    for x, y in data:
        loss = loss_fn(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    return losses


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every state_dict entry, on every rank."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def full_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out.setdefault(names[id(p)], {})[k] = (v.full_tensor() if isinstance(v, DTensor) else v).clone()
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k], f"{what}[{k}]")
        else:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k, a[k].shape, b[k].shape)
            assert torch.equal(a[k], b[k]), f"{what}[{k}] differs (max {(a[k].float() - b[k].float()).abs().max()})"


def clone_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def assert_clear_errors(per_rank: list[dict[str, Any]], fragments: dict[str, tuple[str, ...]]) -> None:
    """Every rank failed every named case with a message holding its fragments and a fix."""
    for name, expected in fragments.items():
        for rank, results in enumerate(per_rank):
            message = results[name]
            assert message is not None, f"{name}: rank {rank} loaded without an error"
            for fragment in expected:
                assert fragment in message, f"{name}: rank {rank}: {fragment!r} not in:\n{message}"
            assert "fix" in message, message
