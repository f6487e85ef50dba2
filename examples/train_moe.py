"""Mixture-of-experts example: expert parallel (EP) + fully_shard with per-parameter meshes, on 4 CPU ranks.

    torchrun --nproc_per_node 4 examples/train_moe.py                 # ours, then torch's, side by side
    torchrun --nproc_per_node 4 examples/train_moe.py --impl torch    # torch's fully_shard only

(torch 2.11's fully_shard has no per-parameter meshes: there the first command runs this library alone and
says so.)

Meshes (torchtitan's layout): dense ``dp`` 4 for embeddings, norms, routers, shared MLPs and the head;
experts on ``(efsdp 2, ep 2)``: each expert weight is a stacked ``[E, ...]`` tensor, ``Shard(0)`` on ``ep``
(ep rank j owns experts ``j*E/2 ...``), and fully_shard shards that EP shard over ``efsdp``. One
``fully_shard`` call per block: ``shard_placement_fn`` puts the experts on the ``efsdp`` mesh
(``ShardPlacement``), everything else stays on ``dp`` (two groups, two all-gathers, two reduce-scatters per
block). Tokens go to their expert by all-to-all over ``ep`` (gloo supports it) and come back the same way.
The router picks the top-1 expert by score + a load-balancing bias buffer (DeepSeek-V3's auxiliary-free
balancing: after each step the bias of under-used experts goes up, of over-used ones down).

Gradients follow torchtitan's convention (``set_gradient_divide_factor(1.0)`` on every unit, the loss
summed and divided by the global token count), so this library and torch's fully_shard train identically;
torch needs ``set_force_sum_reduction_for_comms(True)`` for factor 1.0 on gloo (no PREMUL_SUM). Without
the factor this library's default divisor is also right (design/experts.md); torch's would leave the
expert gradients ``ep`` times too large.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fully_shard import ShardPlacement, clip_grad_norm_, fully_shard


class Experts(nn.Module):
    """Stacked expert MLPs ``w1 [E, D, H]``, ``w2 [E, H, D]``; tokens dispatched by all-to-all over ``ep``."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1  # this rank's experts
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        local, group = w1.shape[0], self.ep_group
        ep = dist.get_world_size(group) if group is not None else 1
        order = torch.argsort(expert, stable=True)  # tokens sorted by expert = by owning ep rank
        counts = torch.bincount(expert, minlength=self.num_experts)  # tokens this rank sends per expert
        if group is None:
            received, recv_counts = x[order], counts.view(1, -1)
        else:  # how many tokens each rank sends to each of my experts, then the tokens themselves
            recv_counts = funcol.all_to_all_single(counts, None, None, group).view(ep, local)
            send = counts.view(ep, local).sum(1).tolist()
            recv = recv_counts.sum(1).tolist()
            received = funcol.all_to_all_single_autograd(x[order], recv, send, group)
        out = torch.zeros_like(received)
        starts = torch.cat([recv_counts.new_zeros(1), recv_counts.flatten().cumsum(0)])
        for e in range(local):  # rows of expert e from every source rank (grouped by source, then expert)
            rows = torch.cat([torch.arange(int(starts[r * local + e]), int(starts[r * local + e + 1]))
                              for r in range(recv_counts.shape[0])])
            h = torch.relu(received[rows] @ w1[e]) @ w2[e]
            out = out.index_add(0, rows, h)
        if group is not None:
            out = funcol.all_to_all_single_autograd(out, send, recv, group)
        return torch.empty_like(out).index_copy(0, order, out)  # back in token order


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim, hidden)
        self.shared = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.register_buffer("expert_bias", torch.zeros(experts))  # load balancing, not trained
        self.register_buffer("tokens_per_expert", torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = torch.sigmoid(self.router(h))
        expert = torch.argmax(scores + self.expert_bias, dim=-1)  # the bias only steers the choice
        gate = scores.gather(-1, expert[:, None])
        with torch.no_grad():
            self.tokens_per_expert += torch.bincount(expert, minlength=scores.shape[-1]).float()
        return x + self.shared(h) + gate * self.experts(h, expert)


class MoEModel(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, experts: int, blocks: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoEBlock(dim, hidden, experts) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def update_expert_bias(model: MoEModel, dp: DeviceMesh, rate: float = 1e-2) -> None:
    """Auxiliary-free load balancing: the global token count per expert moves each bias toward balance."""
    for layer in model.layers:
        counts = layer.tokens_per_expert
        dist.all_reduce(counts, group=dp.get_group(0))
        layer.expert_bias += rate * torch.sign(counts.mean() - counts)
        counts.zero_()


def parallelize(model: MoEModel, impl: str, dense: DeviceMesh, efsdp: DeviceMesh, ep: DeviceMesh) -> MoEModel:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

        infos = (_get_mesh_info(efsdp), _get_mesh_info(dense))

        def place(p: nn.Parameter) -> Any:  # torch's records (what torchtitan passes)
            return ShardPlacementResult(Shard(0), infos[0] if _is_expert(p) else infos[1])
    else:
        shard = fully_shard  # type: ignore[assignment]

        def place(p: nn.Parameter) -> Any:  # ours: None keeps the fully_shard mesh
            return ShardPlacement(Shard(0), mesh=efsdp) if _is_expert(p) else None

    for layer in model.layers:  # expert parallel first (torchtitan's parallelize), then FSDP
        for name in ("w1", "w2"):
            full = getattr(layer.experts, name).detach()
            setattr(layer.experts, name, nn.Parameter(distribute_tensor(full, ep, [Shard(0)], src_data_rank=None)))
        layer.experts.ep_group = ep.get_group(0)
        shard(layer, mesh=dense, shard_placement_fn=place)
    shard(model, mesh=dense)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # the loss is normalised by the global token count
            if impl == "torch":
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _is_expert(p: nn.Parameter) -> bool:
    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def train(impl: str, args: argparse.Namespace) -> list[tuple[float, float]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (world // args.ep, args.ep), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    model = MoEModel(args.vocab, args.dim, args.hidden, args.experts, args.blocks)
    model = parallelize(model, impl, dense, sparse["efsdp"], sparse["ep"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    history = []
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (world, args.tokens), generator=gen)[rank]
        target = (tokens * 7 + 3) % args.vocab  # a learnable map, so the loss goes down
        loss = F.cross_entropy(model(tokens), target, reduction="sum") / (world * args.tokens)
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, dense)
        total = loss.detach().clone()
        dist.all_reduce(total)
        history.append((total.item(), norm.item()))
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=("both", "ours", "torch"), default="both")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per rank per step")
    ap.add_argument("--lr", type=float, default=3e-2)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runs = run(parse_args(argv))
    dist.destroy_process_group()
    return runs


def torch_lacks_placement_results() -> str | None:
    """Why torch's fully_shard cannot run this recipe here (torch 2.11 has no per-parameter meshes: no
    ``ShardPlacementResult``), else None."""
    import torch.distributed.fsdp._fully_shard._fsdp_common as common

    if hasattr(common, "ShardPlacementResult"):
        return None
    return (f"torch {torch.__version__}'s fully_shard has no ShardPlacementResult (per-parameter meshes, which torch "
            "2.13 has): it cannot shard experts on efsdp beside the dense dp mesh")


def run(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Train with each ``--impl`` in the initialized process group; rank 0 prints the table. On a torch
    whose fully_shard has no per-parameter meshes, "both" runs this library alone and says so."""
    impls = ("ours", "torch") if args.impl == "both" else (args.impl,)
    lacking = torch_lacks_placement_results() if "torch" in impls else None
    if lacking is not None:
        if args.impl == "torch":
            raise SystemExit(f"--impl torch: {lacking}")
        impls = ("ours",)
        if dist.get_rank() == 0:
            print(f"{lacking}; running this library alone")
    runs = {impl: train(impl, args) for impl in impls}
    if dist.get_rank() == 0:
        print("step  " + "  ".join(f"{impl + ' loss':>12} {impl + ' norm':>12}" for impl in impls))
        for step in range(args.steps):
            print(f"{step:4d}  " + "  ".join(f"{runs[i][step][0]:12.6f} {runs[i][step][1]:12.6f}" for i in impls))
        if len(impls) == 2:
            gap = max(abs(a[0] - b[0]) for a, b in zip(runs["ours"], runs["torch"]))
            print(f"largest loss gap ours vs torch: {gap:.2e}")
    return runs


if __name__ == "__main__":
    main(sys.argv[1:])
