"""Shared helpers for the checkpoint tests: tiny uneven models, sharding recipes, training, comparisons."""

from __future__ import annotations

import copy
import json
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


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, bytes]:
    """This rank's model and optimizer state as raw bytes per tensor (no collective), and the hyperparameters."""
    out: dict[str, bytes] = {}
    for k, t in model.state_dict().items():
        out[k] = _raw(t)
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, state in opt.state.items():
            for k, v in state.items():
                out[f"{names[id(p)]}/{k}"] = _raw(v) if isinstance(v, torch.Tensor) else repr(v).encode()
        out["param_groups"] = json.dumps([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                                         sort_keys=True, default=str).encode()
    return out


def _raw(t: torch.Tensor) -> bytes:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def scramble(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """Overwrite every local model and optimizer tensor (and the learning rates) so a load must write it all."""
    tensors = list(model.state_dict().values())
    if opt is not None:
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        for g in opt.param_groups:
            g["lr"] = 123.0
    with torch.no_grad():
        for t in tensors:
            local = t.to_local() if isinstance(t, DTensor) else t
            local.fill_(float("nan") if local.is_floating_point() else 7)


def load_both(path: Any, model: nn.Module, opt: torch.optim.Optimizer | None = None, **kwargs: Any) -> Any:
    """checkpoint.load (staged, the default) as the test asked, then the same checkpoint again in place after
    ``scramble``: both must leave this rank's model and optimizer bitwise the same and return the same extra."""
    from fully_shard import checkpoint

    extra = checkpoint.load(path, model, opt, **kwargs)
    staged = local_bytes(model, opt)
    scramble(model, opt)
    again = checkpoint.load(path, model, opt, mode=checkpoint.LoadMode.IN_PLACE, **kwargs)
    in_place = local_bytes(model, opt)
    assert sorted(in_place) == sorted(staged), sorted(set(in_place) ^ set(staged))
    differ = [k for k in staged if in_place[k] != staged[k]]
    assert not differ, f"in-place load differs from the staged one in {differ}"
    _assert_same_tree(again, extra)
    return extra


def _assert_same_tree(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (a, b)
        for k in a:
            _assert_same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _assert_same_tree(x, y)
    else:
        assert a == b, (a, b)
