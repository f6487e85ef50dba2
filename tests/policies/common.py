"""Shared recipes for the policy tests: batch slicing, reference emulation, grads and event sums."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import MixedPrecisionPolicy
from fully_shard.comm.trace import EventKind, TraceEvent
from fully_shard.core.policy import REDUCE_IN_ORIG_DTYPE
from tests.core.common import global_mean as global_mean  # re-exported for the policy tests
from tests.core.common import local_slice as local_slice
from tests.core.common import max_param_diff, step_pair
from tests.models import batches, loss_fn


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a DTensor (a plain tensor unchanged)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_grad_diff(model: nn.Module, ref_grads: Mapping[str, torch.Tensor]) -> float:
    worst = 0.0
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} has no grad"
        worst = max(worst, (full(p.grad).float() - ref_grads[n].float()).abs().max().item())
    return worst


def sgd(params: Iterable[torch.Tensor], lr: float = 0.1) -> torch.optim.Optimizer:
    """Plain SGD: unlike Adam it does not blow float noise in near-zero grads up to lr-sized steps."""
    return torch.optim.SGD(list(params), lr=lr)


class Emulator:
    """The unsharded reference for mixed precision: fp32 master weights, a compute copy cast per
    module policy, per-rank gradients cast to each unit's reduce dtype and averaged over ranks.

    ``policies`` maps a unit's module FQN ("" = root) to its policy; a unit's dtype applies to its
    own parameters, not to those of nested units (as fully_shard does).
    """

    def __init__(self, master: nn.Module, policies: Mapping[str, MixedPrecisionPolicy]) -> None:
        self.master = master
        self.policies = dict(policies)

    def _unit_of(self, fqn: str) -> str:
        best = ""
        for unit in self.policies:
            if unit and (fqn == unit or fqn.startswith(unit + ".")) and len(unit) > len(best):
                best = unit
        return best

    def _compute_copy(self) -> nn.Module:
        compute = copy.deepcopy(self.master)
        for name, p in compute.named_parameters():
            dtype = self.policies[self._unit_of(name)].param_dtype
            if dtype is not None:
                p.data = p.data.to(dtype)
        modules = dict(compute.named_modules())
        for unit, policy in self.policies.items():
            mod = modules[unit]
            if policy.param_dtype is not None and policy.cast_forward_inputs:
                dtype = policy.param_dtype
                mod.register_forward_pre_hook(
                    lambda _m, args, d=dtype: tuple(a.to(d) if a.is_floating_point() else a for a in args))
            if policy.output_dtype is not None:
                out_dtype = policy.output_dtype
                mod.register_forward_hook(lambda _m, _a, out, d=out_dtype: out.to(d))
        return compute

    def reduce_dtype(self, fqn: str) -> torch.dtype:
        """The unit's reduce dtype; unset: the masters' fp32 from torch 2.15, ``param_dtype`` before (policy.py)."""
        policy = self.policies[self._unit_of(fqn)]
        return policy.reduce_dtype or (None if REDUCE_IN_ORIG_DTYPE else policy.param_dtype) or torch.float32

    def grads(self, microbatches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, torch.Tensor]:
        """``microbatches[r]``: rank r's (x, y) list; grads accumulate per rank in the reduce dtype,
        then are averaged over ranks (as the reduce-scatter does) and returned in fp32."""
        compute = self._compute_copy()
        total: dict[str, torch.Tensor] = {}
        for per_rank in microbatches:
            acc: dict[str, torch.Tensor] = {}
            for x, y in per_rank:
                compute.zero_grad(set_to_none=True)
                loss_fn(compute(x).float(), y).backward()
                for name, p in compute.named_parameters():
                    assert p.grad is not None
                    g = p.grad.to(self.reduce_dtype(name))
                    acc[name] = g if name not in acc else acc[name] + g
            for name, g in acc.items():
                total[name] = g if name not in total else total[name] + g
        world = len(microbatches)
        return {n: (g / world).float() for n, g in total.items()}

    def step(self, microbatches: list[list[tuple[torch.Tensor, torch.Tensor]]], lr: float) -> None:
        grads = self.grads(microbatches)
        with torch.no_grad():
            for name, p in self.master.named_parameters():
                p -= lr * grads[name]


def count(events: list[TraceEvent], kind: EventKind, **match: Any) -> int:
    return sum(1 for e in events if e.kind is kind and all(getattr(e, k) == v for k, v in match.items()))


def nbytes(events: list[TraceEvent], kind: EventKind) -> int:
    return sum(e.nbytes for e in events if e.kind is kind)


def padded_numel(shape: tuple[int, ...], world: int) -> int:
    """Elements a dim-0 sharded tensor occupies in a gathered flat buffer (independent of layout.py)."""
    if not shape:
        return world  # 0-dim: one replicated slot per rank
    return math.ceil(shape[0] / world) * world * math.prod(shape[1:])


def unit_padded_numel(params: Iterable[torch.Tensor], world: int) -> int:
    return sum(padded_numel(tuple(p.shape), world) for p in params)


def train_parity(model: nn.Module, ref: nn.Module, *, steps: int = 10, batch: int = 8, lr: float = 0.1,
                 optim: type[torch.optim.Optimizer] = torch.optim.SGD) -> dict[str, float]:
    """Train ``model`` (sharded, local batch slices) and ``ref`` (unsharded, the global batch) side by
    side with the same optimizer; return the worst loss and parameter differences."""
    opt = optim(model.parameters(), lr=lr)
    ref_opt = optim(ref.parameters(), lr=lr)
    loss_diff = 0.0
    for x, y in batches(steps, batch=batch):
        loss, ref_loss = step_pair(model, ref, opt, ref_opt, x, y)
        loss_diff = max(loss_diff, abs(loss - ref_loss))
    return {"loss_diff": loss_diff, "param_diff": max_param_diff(model, ref)}
