"""2-D parallel example: a small Llama-like model with tensor parallel + activation checkpointing +
per-block compile + fully_shard, on 4 CPU ranks (dp 2 x tp 2), next to the dp-only run.

    torchrun --nproc_per_node 4 examples/train_tp.py            # dp 2 x tp 2, then dp 4, same data

The recipe: ``parallelize_module`` each block on the ``tp`` mesh (attention q/k/v and MLP gate/up
colwise, o/down rowwise), ``block.compile(fullgraph=True)``, wrap it in activation checkpointing, then
``fully_shard(wrapped, mesh=mesh["dp"])`` and ``fully_shard(model, mesh=mesh["dp"])``. (Compiling the
checkpoint wrapper itself, AC inside the graph, fails in torch 2.13 for TP blocks with
``AssertionError: expected all tensors_saved_with_vc_check to be Tensors`` in aot_autograd, with torch's
fully_shard and ours alike, so AC wraps the compiled block.) Every rank of one ``dp`` group sees the same batch; the
global batch is the same in both runs, so the two loss curves match (the last line prints the largest gap).
``--impl torch`` runs torch's own ``fully_shard`` instead (the reference this library is tested against).
See design/2d-params.md for the placements and the gradient path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 512
    dim: int = 64
    blocks: int = 2
    heads: int = 4
    hidden: int = 128  # SwiGLU hidden size
    seq: int = 32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim)."""
    seq, half = x.shape[-2], x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    angles = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallel each rank holds heads / tp of them (colwise q/k/v)
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.o(att.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


TP_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
           "attn.o": RowwiseParallel(), "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
           "mlp.down": RowwiseParallel()}


def parallelize(model: Llama, mesh: DeviceMesh, *, impl: str, compile_backend: str | None, ac: bool) -> None:
    """TP on each block's tp mesh (if any), AC, per-block compile, then FSDP over dp (torchtitan's order)."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fully_shard import fully_shard
    dp_mesh = mesh["dp"]
    for i, block in enumerate(model.blocks):
        if "tp" in (mesh.mesh_dim_names or ()):
            parallelize_module(block, mesh["tp"], TP_PLAN)
        if compile_backend is not None:
            block.compile(backend=compile_backend, fullgraph=True)
        wrapped: nn.Module = checkpoint_wrapper(block) if ac else block
        model.blocks[i] = wrapped
        fully_shard(wrapped, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def batch(cfg: LlamaConfig, global_batch: int, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, ...]:
    """This dp rank's rows of the step's global batch (the same global batch for every mesh): token
    sequences of a fixed sparse Markov chain, so the loss falls well below log(vocab)."""
    successors = torch.randint(0, cfg.vocab, (cfg.vocab, 2), generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(global_batch, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (global_batch,), generator=g)
    choice = torch.randint(0, 2, (global_batch, cfg.seq), generator=g)
    for t in range(cfg.seq):
        tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
    rows = tokens.chunk(dp_size)[dp_rank]
    return rows[:, :-1], rows[:, 1:]


def train(cfg: LlamaConfig, mesh: DeviceMesh, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(0)
    model = Llama(cfg)
    parallelize(model, mesh, impl=args.impl, compile_backend=None if args.no_compile else args.backend,
                ac=not args.no_ac)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dp = mesh["dp"]
    losses = []
    for step in range(args.steps):
        x, y = batch(cfg, args.global_batch, step, dp.get_local_rank(), dp.size())
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())  # tp ranks repeat their dp rank's loss
    return losses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--impl", choices=("ours", "torch"), default="ours")
    ap.add_argument("--backend", default="aot_eager", help="torch.compile backend (aot_eager, inductor)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-ac", action="store_true", help="no activation checkpointing")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--report", type=Path, default=None, help="write rank 0's losses as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("train_tp.py expects torchrun's environment. Run: "
                         "torchrun --nproc_per_node 4 examples/train_tp.py")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the world size {world}")
    cfg = LlamaConfig(dim=args.dim, blocks=args.blocks)
    mesh_2d = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    mesh_1d = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    two_d = train(cfg, mesh_2d, args)
    dp_only = train(cfg, mesh_1d, args)
    gap = max(abs(a - b) for a, b in zip(two_d, dp_only))
    if dist.get_rank() == 0:
        label = f"dp {world // args.tp} x tp {args.tp}"
        print(f"{args.impl} fully_shard, {cfg}, compile={'off' if args.no_compile else args.backend}")
        print(f"{'step':>4}  {label:>12}  {'dp ' + str(world):>12}")
        for i, (a, b) in enumerate(zip(two_d, dp_only)):
            print(f"{i + 1:>4}  {a:>12.6f}  {b:>12.6f}")
        print(f"max |2-D - dp-only| loss gap: {gap:.2e}")
        if args.report is not None:
            args.report.write_text(json.dumps({"two_d": two_d, "dp_only": dp_only, "gap": gap}))
    dist.destroy_process_group()
    return {"two_d": two_d, "dp_only": dp_only, "gap": gap}


if __name__ == "__main__":
    main()
