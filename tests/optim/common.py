"""Shared recipes for the Muon tests: a sharded TinyGPT and its unsharded twin fed the same gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from fully_shard.optim import Muon, muon_param_groups
from tests.core.common import shard_gpt
from tests.models import TinyGPT, batches, loss_fn

MUON_KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW_KW: dict[str, Any] = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def make_pair(*, n_blocks: int = 1, shard: Callable[[nn.Module], nn.Module] = shard_gpt,
              **muon_kw: Any) -> tuple[nn.Module, Muon, nn.Module, list[torch.optim.Optimizer]]:
    """(sharded model, our Muon over muon_param_groups, unsharded twin, [torch Muon, torch AdamW] over the
    same routing by name)."""
    torch.manual_seed(0)
    ref = TinyGPT(n_blocks=n_blocks)
    model = shard(copy.deepcopy(ref))
    kw = {**MUON_KW, **muon_kw}
    ours = {k: kw.pop(k) for k in ("comm", "per_bucket") if k in kw}
    groups = muon_param_groups(model, adamw_lr=ADAMW_KW["lr"], adamw_betas=ADAMW_KW["betas"],
                               adamw_eps=ADAMW_KW["eps"], adamw_weight_decay=ADAMW_KW["weight_decay"])
    opt = Muon(groups, **kw, **ours)
    ref_params = dict(ref.named_parameters())
    muon_names = [n for g in groups if g["algorithm"] == "muon" for n in g["param_names"]]
    adamw_names = [n for g in groups if g["algorithm"] == "adamw" for n in g["param_names"]]
    ref_opts: list[torch.optim.Optimizer] = [
        torch.optim.Muon([ref_params[n] for n in muon_names], **kw),
        torch.optim.AdamW([ref_params[n] for n in adamw_names], **ADAMW_KW),
    ]
    return model, opt, ref, ref_opts


def feed_same_grads(model: nn.Module, ref: nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> None:
    """Backward on the unsharded twin (``y=None``: its gradients are already there); give each sharded
    parameter its rows of the same gradient."""
    if y is not None:
        loss_fn(ref(x), y).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = ref_params[name].grad
        assert full is not None
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full.clone(), p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = full.clone()


def max_diff(model: nn.Module, ref: nn.Module) -> float:
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst = max(worst, (full.detach() - ref_params[name].detach()).abs().max().item())
    return worst


def run_equal(steps: int = 3, schedule: bool = True, **muon_kw: Any) -> float:
    """Train both ``steps`` steps on the same gradients (with an lr schedule); the worst parameter diff."""
    model, opt, ref, ref_opts = make_pair(**muon_kw)
    scheds = []
    if schedule:
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, *ref_opts)]
    for x, y in batches(steps):
        feed_same_grads(model, ref, x, y)
        opt.step()
        for o in ref_opts:
            o.step()
        for s in scheds:
            s.step()
        opt.zero_grad()
        ref.zero_grad()
    return max_diff(model, ref)
