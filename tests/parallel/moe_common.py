"""A tiny mixture-of-experts model for the expert-parallel tests: torchtitan's layout (stacked ``[E, ...]``
expert weights, ``Shard(0)`` DTensors on an ``ep`` mesh), top-1 routing, and a token dispatch over ``ep``
that is exact against the unsharded model on the global batch.

Dispatch: every rank of an ``ep`` group gathers the group's tokens, runs its local experts on the tokens
routed to them, and the partial outputs are summed back to the tokens' owners (an all-gather dispatch,
gloo-friendly; the example uses all-to-all)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

DIM, HIDDEN, TOKENS = 8, 12, 6  # TOKENS per rank
# torch < 2.13 has only the *_tensor(_autograd) functional collectives (same arguments)
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_reduce_scatter_autograd = getattr(funcol, "reduce_scatter_single_autograd", funcol.reduce_scatter_tensor_autograd)


class _GatherTokens(torch.autograd.Function):
    """[T, D] on each ep rank -> [ep*T, D] (every rank's tokens); backward sums the gradients of every
    rank's copy and keeps this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rows = grad.shape[0] // dist.get_world_size(ctx.group)
        me = dist.get_rank(ctx.group)
        return grad[me * rows:(me + 1) * rows], None


class _CombineTokens(torch.autograd.Function):
    """[ep*T, D] partial outputs on each ep rank -> [T, D] this rank's tokens, summed over the ep ranks."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        rows = y.shape[0] // dist.get_world_size(group)
        me = dist.get_rank(group)
        return y[me * rows:(me + 1) * rows].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class GroupedExperts(nn.Module):
    """Stacked expert weights ``w1 [E, D, H]``, ``w2 [E, H, D]`` (torchtitan's ``GroupedExperts``)."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, DIM, HIDDEN) * 0.3)
        self.w2 = nn.Parameter(torch.randn(experts, HIDDEN, DIM) * 0.3)
        self.ep_group: dist.ProcessGroup | None = None  # set by expert_parallel
        self.ep_rank = 0
        self.traceable = False  # True: static-shape dispatch with functional collectives (torch.compile)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        if self.traceable:
            return self._traceable(x, index, weight, w1, w2)
        group = self.ep_group
        if group is not None:
            x = _GatherTokens.apply(x, group)
            index = _gather_plain(index, group)
            weight = _GatherTokens.apply(weight, group)
        first = w1.shape[0] * (dist.get_rank(group) if group is not None else 0)
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):  # an expert with no tokens still runs (empty): every rank has its grads
            rows = (index == first + e).nonzero().flatten()
            h = torch.relu(x[rows] @ w1[e]) @ w2[e]
            out = out.index_add(0, rows, h * weight[rows, None].to(h.dtype))
        return _CombineTokens.apply(out, group) if group is not None else out


    def _traceable(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
        """Every local expert on every gathered token, masked (static shapes, no data-dependent branch):
        all-gather over ep, then reduce-scatter (sum) back, both autograd-aware functional collectives."""
        group = self.ep_group
        if group is not None:
            x = _all_gather_autograd(x, 0, group)
            weight = _all_gather_autograd(weight, 0, group)
            index = _all_gather(index, 0, group)
        first = w1.shape[0] * self.ep_rank
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):
            mask = (index == first + e).to(x.dtype) * weight.to(x.dtype)
            out = out + (torch.relu(x @ w1[e]) @ w2[e]) * mask[:, None]
        return _reduce_scatter_autograd(out, "sum", 0, group) if group is not None else out


def _gather_plain(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


class MoEBlock(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = GroupedExperts(experts)
        self.register_buffer("expert_bias", torch.zeros(experts))  # load balancing (not a parameter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        probs = torch.softmax(self.router(h), dim=-1)
        weight, index = (probs + self.expert_bias).max(dim=-1)
        return x + self.experts(h, index, weight)


class MoEModel(nn.Module):
    def __init__(self, experts: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(MoEBlock(experts) for _ in range(layers))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum(-1)


VOCAB = 16


class Decoder(nn.Module):
    """torchtitan's ``Decoder`` shape: tok_embeddings, layers (a ModuleDict of MoE blocks), norm, lm_head."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): MoEBlock(experts) for i in range(2)})
        for layer in self.layers.values():
            layer.moe_enabled = True
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.lm_head(self.norm(h))


def expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> Any:
    """Experts ``Shard(0)`` DTensors on ``ep_mesh`` (what torchtitan's ``parallelize`` does before FSDP)."""
    for experts in [m for m in model.modules() if isinstance(m, GroupedExperts)]:
        for name in ("w1", "w2"):
            full = getattr(experts, name).detach()
            setattr(experts, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)))
        experts.ep_group = ep_mesh.get_group(0)
        experts.ep_rank = ep_mesh.get_local_rank(0)
    return model


def is_expert(p: nn.Parameter) -> bool:
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def sparse_meshes(efsdp: int, ep: int, replicate: int = 1) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(dense dp mesh, expert FSDP mesh (efsdp, or (dp_replicate, efsdp)), ep mesh): torchtitan's layout."""
    if replicate > 1:
        sparse = init_device_mesh("cpu", (replicate, efsdp, ep), mesh_dim_names=("dp_replicate", "efsdp", "ep"))
        edp = sparse["dp_replicate", "efsdp"]
    else:
        sparse = init_device_mesh("cpu", (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
        edp = sparse["efsdp"]
    dense = init_device_mesh("cpu", (replicate * efsdp * ep,), mesh_dim_names=("dp",))
    return dense, edp, sparse["ep"]


def batch(seed: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (every rank's tokens, rank-major) and its targets."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(world * TOKENS, DIM, generator=g), torch.randn(world * TOKENS, generator=g)


def local(t: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return t[rank * TOKENS:(rank + 1) * TOKENS]


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}
