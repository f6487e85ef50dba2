"""A tiny TP-able transformer for the 2-D tests: attention q/k/v colwise + o rowwise, MLP up colwise +
down rowwise, plain LayerNorms (mixed with TP parameters in one unit), plain embedding and head."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, DIM, HEAD_DIM, HIDDEN, SEQ = 61, 32, 8, 42, 8  # HIDDEN 42: TP-local 21 rows, uneven over dp=2


class TPBlock(nn.Module):
    def __init__(self, gated: bool = False) -> None:
        super().__init__()
        if gated:  # a 0-dim parameter (torch's fully_shard refuses these); a Replicate() DTensor under TP
            self.gate = nn.Parameter(torch.tensor(0.9))
        self.norm1 = nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)  # (under sequence parallel x is this rank's sequence chunk; q/k/v see it all)
        q, k, v = (z.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for z in (self.q(h), self.k(h), self.v(h)))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
        x = x + self.o(att.transpose(1, 2).flatten(2))
        mlp = self.down(F.gelu(self.up(self.norm2(x))))
        if hasattr(self, "gate"):
            gate = self.gate.to_local() if isinstance(self.gate, DTensor) else self.gate
            mlp = gate * mlp
        return x + mlp


class TPModel(nn.Module):
    def __init__(self, n_blocks: int = 2, gated: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(TPBlock(gated) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))
            elif p.dim() == 1:
                nn.init.normal_(p, mean=1.0 if p.shape == (DIM,) else 0.0, std=0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        sp: DeviceMesh | None = getattr(self, "sp_mesh", None)
        if sp is not None:  # sequence parallel: the blocks see this rank's chunk of the sequence
            # (a redistribute, not a chunk: its backward all-gathers, so the embedding gets every position's grad)
            x = DTensor.from_local(x, sp, [Replicate()]).redistribute(placements=[Shard(1)]).to_local()
        for blk in self.blocks:
            x = blk(x)
        if sp is not None:
            x = DTensor.from_local(x, sp, [Shard(1)]).full_tensor()
        return self.head(self.norm(x))


PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
        "up": ColwiseParallel(), "down": RowwiseParallel()}


SP_PLAN = {"norm1": SequenceParallel(), "q": ColwiseParallel(input_layouts=Shard(1)),
           "k": ColwiseParallel(input_layouts=Shard(1)), "v": ColwiseParallel(input_layouts=Shard(1)),
           "o": RowwiseParallel(output_layouts=Shard(1)), "norm2": SequenceParallel(),
           "up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}


def sequence_parallel(model: TPModel, tp_mesh: DeviceMesh) -> TPModel:
    """TP + sequence parallel: LayerNorm weights become Replicate() DTensors whose gradients are Partial."""
    model.sp_mesh = tp_mesh
    for blk in model.blocks:
        parallelize_module(blk, tp_mesh, SP_PLAN)
    return model


_MESHES: dict[tuple[int, ...], DeviceMesh] = {}


def mesh_2d() -> DeviceMesh:
    """One (dp=2, tp=2) mesh per rank process, reused by every test: torch treats value-equal meshes as
    interchangeable (DTensor specs compare meshes by value), so a second equal mesh with its own
    process groups could mix two groups into one collective across tests."""
    if (2, 2) not in _MESHES:
        _MESHES[(2, 2)] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _MESHES[(2, 2)]


def tensor_parallel(model: TPModel, tp_mesh: DeviceMesh) -> TPModel:
    for blk in model.blocks:
        parallelize_module(blk, tp_mesh, PLAN)
        if hasattr(blk, "gate"):
            blk.gate = nn.Parameter(distribute_tensor(blk.gate.detach(), tp_mesh, [Replicate()]))
    return model


def shard_2d(model: TPModel, fully_shard: Callable[..., Any], dp_mesh: DeviceMesh, **kw: Any) -> TPModel:
    for blk in model.blocks:
        fully_shard(blk, mesh=dp_mesh, **kw)
    fully_shard(model, mesh=dp_mesh, **kw)
    return model


def data(steps: int, batch: int = 4, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        d = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((d[:, :-1], d[:, 1:]))
    return out


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def dp_slice(t: torch.Tensor, mesh: DeviceMesh, dim: str = "dp") -> torch.Tensor:
    per = t.shape[0] // mesh[dim].size()
    r = mesh[dim].get_local_rank()
    return t[r * per:(r + 1) * per]


def global_loss(loss: torch.Tensor, mesh: DeviceMesh, dim: str = "dp") -> float:
    value = loss.detach().clone()
    dist.all_reduce(value, group=mesh[dim].get_group())
    return value.item() / mesh[dim].size()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff_to(model: nn.Module, ref: nn.Module) -> float:
    ref_params = dict(ref.named_parameters())
    return max((full(p.detach()).float() - full(ref_params[n].detach()).float()).abs().max().item()
               for n, p in model.named_parameters())


def fresh_pair() -> tuple[TPModel, TPModel]:
    torch.manual_seed(0)
    base = TPModel()
    return base, copy.deepcopy(base)


class SpmdMLP(nn.Module):
    """Parameters are DTensors on the full (dp, tp) mesh, Replicate() on dp (the dp_mesh_dims recipe);
    the input is a DTensor sharded over dp."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.mesh = mesh
        self.w1 = nn.Parameter(distribute_tensor(torch.randn(HIDDEN, DIM, generator=g) / DIM**0.5, mesh,
                                                 [Replicate(), Shard(0)]))
        self.w2 = nn.Parameter(distribute_tensor(torch.randn(DIM, HIDDEN, generator=g) / HIDDEN**0.5, mesh,
                                                 [Replicate(), Shard(1)]))
        self.b2 = nn.Parameter(distribute_tensor(torch.randn(DIM, generator=g) * 0.1, mesh, [Replicate(), Replicate()]))

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        x = DTensor.from_local(x_local, self.mesh, [Shard(0), Replicate()])
        h = F.gelu(x @ self.w1.t())
        out = (h @ self.w2.t()).redistribute(placements=[Shard(0), Replicate()]) + self.b2
        return out.to_local().clone()  # (a view would make torch warn about its pre-backward hook)


def spmd_reference() -> nn.Module:
    """SpmdMLP's math on plain tensors (same init)."""
    g = torch.Generator().manual_seed(11)
    ref = nn.Module()
    ref.w1 = nn.Parameter(torch.randn(HIDDEN, DIM, generator=g) / DIM**0.5)
    ref.w2 = nn.Parameter(torch.randn(DIM, HIDDEN, generator=g) / HIDDEN**0.5)
    ref.b2 = nn.Parameter(torch.randn(DIM, generator=g) * 0.1)
    return ref


def spmd_reference_forward(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ ref.w1.t()) @ ref.w2.t() + ref.b2
