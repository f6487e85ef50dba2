"""The expert-parallel parity setup shared by tests/parallel/test_experts.py and the 8-rank HSDP check
tests/manual/hsdp_experts.py: the tiny MoE model sharded by this library and by torch's fully_shard with
torchtitan's placements, the unsharded reference, the default-divisor gradients and factor-1.0 losses."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fully_shard import ShardPlacement, clip_grad_norm_, fully_shard, total_grad_norm
from tests.parallel.moe_common import (
    TOKENS,
    MoEModel,
    batch,
    expert_parallel,
    full_grads,
    is_expert,
    local,
    sparse_meshes,
)
from tests.torch_ref import lacks_name

# torch < 2.12: no per-parameter meshes in torch's fully_shard; ours runs with its own ShardPlacement instead
TORCH_NO_PLACEMENT_RESULT = lacks_name("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult")
TORCH_NO_RECORDS = TORCH_NO_PLACEMENT_RESULT and TORCH_NO_PLACEMENT_RESULT.replace(
    "the torch-side comparison", "ShardPlacementResult's case")


def torch_fully_shard() -> Any:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard


def torchtitan_fn(model: MoEModel, dense: Any, edp: Any, ep: int) -> Callable[[nn.Parameter], Any]:
    """torchtitan's ``apply_fsdp_to_decoder`` shard_placement_fn for ep > 1 (torch's private records)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    dp_info, edp_info = _get_mesh_info(dense), _get_mesh_info(edp)
    experts = model.layers[0].experts.num_experts
    efsdp = edp.size(edp.ndim - 1)

    def fn(p: nn.Parameter) -> Any:
        if is_expert(p):
            return ShardPlacementResult(Shard(1) if efsdp * ep > experts else Shard(0), edp_info)
        return ShardPlacementResult(Shard(0), dp_info)

    return fn


def ours_fn(model: MoEModel, edp: Any, ep: int) -> Callable[[nn.Parameter], Any]:
    """The same with this library's public ``ShardPlacement`` (None: Shard(0) on the call's mesh)."""
    experts = model.layers[0].experts.num_experts
    efsdp = edp.size(edp.ndim - 1)

    def fn(p: nn.Parameter) -> Any:
        if is_expert(p):
            return ShardPlacement(Shard(1) if efsdp * ep > experts else Shard(0), mesh=edp)
        return None

    return fn


def shard_model(model: MoEModel, shard: Any, dense: Any, fn: Callable[[nn.Parameter], Any] | None) -> MoEModel:
    for layer in model.layers:
        shard(layer, mesh=dense, shard_placement_fn=fn)
    shard(model, mesh=dense)
    return model


def layout(model: nn.Module) -> dict[str, Any]:
    return {n: (tuple(p.placements), tuple(p.shape), p.device_mesh.mesh_dim_names) for n, p in model.named_parameters()}


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], scale: dict[str, float] | None = None) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[n] - b[n] * (scale or {}).get(n, 1.0)).abs().max().item() for n in a)


def mean_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


def ref_grads(base: MoEModel, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], float]:
    ref = copy.deepcopy(base)
    mean_loss(ref, x, y).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
    return full_grads(ref), norm


def placement_fn(model: MoEModel, dense: Any, edp: Any, ep: int) -> Callable[[nn.Parameter], Any]:
    """torchtitan's records where this torch has them, else this library's ShardPlacement."""
    return ours_fn(model, edp, ep) if TORCH_NO_PLACEMENT_RESULT else torchtitan_fn(model, dense, edp, ep)


def setup(experts: int, efsdp: int, ep: int,
           replicate: int = 1) -> tuple[MoEModel, MoEModel, MoEModel | None, Any, Any]:
    dense, edp, ep_mesh = sparse_meshes(efsdp, ep, replicate)
    base = MoEModel(experts)
    ours = shard_model(expert_parallel(copy.deepcopy(base), ep_mesh), fully_shard, dense,
                       placement_fn(base, dense, edp, ep))
    theirs = None if TORCH_NO_PLACEMENT_RESULT else shard_model(expert_parallel(copy.deepcopy(base), ep_mesh),
                                                                torch_fully_shard(), dense,
                                                                torchtitan_fn(base, dense, edp, ep))
    return base, ours, theirs, dense, edp


def default_divisor(base: MoEModel, ours: MoEModel, theirs: MoEModel | None, ep: int) -> dict[str, Any]:
    """Mean loss over each rank's tokens, default divisor: ours equals the unsharded model on the global
    batch; torch's expert gradients are ep times too large (pytorch #160285)."""
    world = dist.get_world_size()
    x, y = batch(1, world)
    ref, ref_norm = ref_grads(base, x, y)
    models = [m for m in (ours, theirs) if m is not None]
    for m in models:
        mean_loss(m, local(x), local(y)).backward()
    got = full_grads(ours)
    scale = {n: float(ep) for n in ref if ".experts." in n}
    norm = total_grad_norm(list(ours.parameters())).item()
    clipped = clip_grad_norm_(list(ours.parameters()), max_norm=ref_norm / 2).item()
    clipped_norm = total_grad_norm(list(ours.parameters())).item()
    placements = {n: tuple(p.grad.placements) for n, p in ours.named_parameters() if ".experts." in n}
    out: dict[str, Any] = {"grad_vs_ref": diff(got, ref), "norm": (norm, ref_norm, clipped, clipped_norm),
                           "expert_grad_placements": placements}
    if theirs is not None:
        torch_got = full_grads(theirs)
        out.update(torch_vs_ref_times_ep=diff(torch_got, ref, scale), torch_vs_ref=diff(torch_got, ref))
    for m in models:
        m.zero_grad()
    return out


def factor_one_steps(ours: MoEModel, theirs: MoEModel | None, base: MoEModel,
                      steps: int = 3) -> list[tuple[float, ...]]:
    """torchtitan's convention: factor 1.0 on every unit, loss = sum / global token count. Losses of ours,
    torch's and the unsharded model (global batch, mean loss) step by step (SGD)."""
    world = dist.get_world_size()
    models = [m for m in (ours, theirs) if m is not None]
    for m in models:
        for module in m.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                if m is theirs:  # torch's factor needs NCCL's PREMUL_SUM unless forced to SUM (gloo)
                    module.set_force_sum_reduction_for_comms(True)
    ref = copy.deepcopy(base)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (*models, ref)]
    losses = []
    for step in range(steps):
        x, y = batch(10 + step, world)
        row = []
        for m, opt in zip(models, opts):
            loss = F.mse_loss(m(local(x)), local(y), reduction="sum") / (world * TOKENS)
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            row.append(total.item())
        loss = mean_loss(ref, x, y)
        loss.backward()
        opts[-1].step()
        opts[-1].zero_grad()
        row.append(loss.item())
        losses.append(tuple(row))
    return losses
