"""Muon benchmark: optimizer step time and bytes per step (owner vs gather vs AdamW), and a 200-step GPT run.

    python benchmarks/muon.py --world 2                 # step figures at W=2 (launches gloo ranks itself)
    python benchmarks/muon.py --world 4
    python benchmarks/muon.py --world 2 --train 200     # + loss curves, Muon vs AdamW, PNG under results/

Step figures: the shared GPT (models/gpt.py) sharded per block, one backward for fixed
gradients, then only ``optimizer.step()`` is timed for each variant (each with its own copy of the model):
``owner`` (fully_shard.optim.Muon, rows to owners by all-to-all), ``gather`` (``comm="gather"``) and
``adamw`` (torch's AdamW over every parameter, on the library's local step). Rounds rotate the order; a
round's time is the slowest rank's. Bytes are the optimizer's own collectives per rank per step
(``Muon.comm_stats``), next to the Muon matrices' fp32 bytes and the issue's bound ``2/W`` of them.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    GPT,
    GPTConfig,
    init,
    launch_if_needed,
    loss_fn,
    machine,
    median,
    rank0_print,
    synthetic_batch,
    wrap_variant,
)

from fully_shard.optim import Muon, muon_param_groups

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks to launch when not under torchrun")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--train", type=int, default=0, help="also train this many steps, Muon vs AdamW")
    ap.add_argument("--batch", type=int, default=8, help="per-rank batch for --train")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr; Muon's too (match_rms_adamw scaling)")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def make_optimizer(name: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW, or Muon with Moonshot's ``match_rms_adamw`` scaling so that both use the same lr."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    groups = muon_param_groups(model, adamw_lr=lr, adamw_weight_decay=0.0)
    return Muon(groups, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw", comm=name)  # type: ignore[arg-type]


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def step_figures(args: argparse.Namespace) -> dict[str, Any]:
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, blocks=args.blocks, heads=4, seq=32)
    torch.manual_seed(0)
    base = GPT(cfg)
    variants = ("owner", "gather", "adamw")
    runs = {}
    for name in variants:
        model = wrap_variant(copy.deepcopy(base), "ours")
        opt = make_optimizer(name, model, args.lr)
        x, y = synthetic_batch(cfg, 4, 0, dist.get_rank())
        loss_fn(model(x), y).backward()
        opt.step()  # creates the states (and checks the Muon plan)
        runs[name] = (model, opt)
    times: dict[str, list[float]] = {n: [] for n in variants}
    for r in range(args.rounds):
        for name in variants[r % 3:] + variants[:r % 3]:
            opt = runs[name][1]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times[name].append(slowest((time.perf_counter() - t0) / args.steps))
    out: dict[str, Any] = {"world": dist.get_world_size(), "config": cfg.__dict__}
    for name in variants:
        model, opt = runs[name]
        row: dict[str, Any] = {"step_ms": 1e3 * median(times[name])}
        if isinstance(opt, Muon):
            muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
            row.update(sent=opt.comm_stats.total_sent(), received=opt.comm_stats.total_received(),
                       calls=dict(opt.comm_stats.calls), muon_param_bytes=sum(p.numel() * 4 for p in muon),
                       matrices=len(muon), ns_work_share=opt.ns_work / sum_ns(opt))
        else:
            row.update(sent=0, received=0, calls={})
        out[name] = row
    return out


def sum_ns(opt: Muon) -> int:
    t = torch.tensor([opt.ns_work], dtype=torch.float64)
    dist.all_reduce(t)
    return int(t.item()) if opt.comm == "owner" else int(t.item()) // dist.get_world_size()


def train(args: argparse.Namespace) -> dict[str, list[float]]:
    cfg = GPTConfig()  # the example's model: vocab 2048, dim 128, 4 blocks, seq 64
    torch.manual_seed(0)
    base = GPT(cfg)
    curves: dict[str, list[float]] = {}
    for name in ("owner", "adamw"):
        model = wrap_variant(copy.deepcopy(base), "ours")
        opt = make_optimizer(name, model, args.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (
            1 + math.cos(math.pi * s / args.train)))
        losses = []
        for step in range(args.train):
            x, y = synthetic_batch(cfg, args.batch, step, dist.get_rank())
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / dist.get_world_size())
        curves["muon" if name == "owner" else "adamw"] = losses
    return curves


def main() -> None:
    args = parse_args()
    launch_if_needed(__file__, args.world)
    init("gloo")
    result: dict[str, Any] = {"machine": machine(), "step": step_figures(args)}
    world = dist.get_world_size()
    rank0_print(f"W={world}  {machine()}")
    rank0_print(f"{'variant':8} {'step ms':>8} {'sent B':>9} {'recv B':>9}  calls        muon fp32 B   2/W bound")
    for name in ("owner", "gather", "adamw"):
        r = result["step"][name]
        bound = 2 / world * r.get("muon_param_bytes", 0)
        rank0_print(f"{name:8} {r['step_ms']:8.2f} {r['sent']:9d} {r['received']:9d}  {r['calls']!s:12} "
                    f"{r.get('muon_param_bytes', 0):11d} {bound:11.0f}")
    if args.train:
        curves = train(args)
        result["train"] = curves
        rank0_print("final loss (mean of last 10): " + ", ".join(
            f"{k} {sum(v[-10:]) / 10:.4f}" for k, v in curves.items()))
        if dist.get_rank() == 0:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 4))
            for k, v in curves.items():
                ax.plot(v, label=k)
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.set_title(f"example GPT, W={world}, fully_shard: Muon (owner) vs AdamW")
            ax.legend()
            RESULTS.mkdir(exist_ok=True)
            fig.savefig(RESULTS / "muon_loss.png", dpi=100, bbox_inches="tight")
    if args.json and dist.get_rank() == 0:
        args.json.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
