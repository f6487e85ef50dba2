"""Step-time benchmark: this library vs torch's fully_shard vs DDP, taking turns in the same processes.

    python benchmarks/step.py                 # launches 2 ranks itself (gloo on CPU, NCCL on GPUs)
    torchrun --nproc_per_node 2 benchmarks/step.py --steps 20

The same GPT (6 blocks, d=256 by default; no 0-dim parameters so torch's fully_shard accepts it) is
built once and copied into each variant; every step runs each variant once, in a rotating order, so
machine noise hits them alike. A step's time is the slowest rank's, from a barrier to the end of
``optimizer.step()``. Also measures the profiler's overhead: the "ours + profiler" variant is the same
setup with ``fully_shard.profile`` recording. Prints medians and ratios; ``--json`` saves them.

    python benchmarks/step.py --profile --warmup 2 --steps 6

``--profile``: where this library's step time goes instead: ``--warmup`` steps, then ``--steps`` profiled
steps of the "ours" variant (the first one left out of the table); prints rank 0's per-unit table (each
all-gather and reduce-scatter's time from issue to done and the part the host waited for), the step's
exposed communication and the share of the step with a collective in flight.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _common import (
    GPT,
    add_model_args,
    init,
    launch_if_needed,
    machine,
    median,
    model_config,
    rank0_print,
    synthetic_batch,
    timed_step,
    train_step,
    wrap_variant,
)

from fully_shard import profile


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to launch when not under torchrun")
    ap.add_argument("--steps", type=int, default=15, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    add_model_args(ap, dim=256, blocks=6, heads=8, seq=128, vocab=2048)
    ap.add_argument("--bf16", action="store_true", help="bf16 params for the FSDP variants, autocast for DDP")
    ap.add_argument("--variants", default="ours,ours+profiler,torch,ddp")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", action="store_true", help="print the profiler's per-unit table of ours instead")
    return ap.parse_args()


def build_variants(base: GPT, names: list[str], bf16: bool, device: torch.device) -> dict[str, tuple[nn.Module, Any]]:
    out: dict[str, tuple[nn.Module, Any]] = {}
    for name in names:
        if name not in ("ours", "ours+profiler", "torch", "ddp"):
            raise SystemExit(f"unknown variant {name!r}: expected ours, ours+profiler, torch or ddp")
        model = wrap_variant(copy.deepcopy(base).to(device), "ours" if name.startswith("ours") else name, bf16=bf16,
                             device=device)
        out[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return out


def make_step(name: str, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              bf16: bool, device: torch.device, losses: list[float]) -> Callable[[], None]:
    def step() -> None:
        losses.append(float(train_step(name, model, opt, x, y, bf16=bf16, device=device)))

    if name != "ours+profiler":
        return step

    def profiled() -> None:
        with profile(model):
            step()

    return profiled


def profile_table(base: GPT, args: argparse.Namespace, device: torch.device) -> None:
    """``--profile``: the profiler's per-unit table of this library's steps (rank 0 prints it)."""
    rank = dist.get_rank()
    model = wrap_variant(copy.deepcopy(base).to(device), "ours", bf16=args.bf16, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = model_config(args)

    def step(i: int) -> None:
        x, y = synthetic_batch(cfg, args.batch, i, rank, device=device)
        train_step("ours", model, opt, x, y, bf16=args.bf16, device=device)

    for i in range(args.warmup):
        step(i)
    with profile(model) as prof:
        for i in range(args.steps):
            step(args.warmup + i)
            prof.step()
    if rank == 0:
        print(prof.table(skip_first=1))


def main() -> None:
    args = parse_args()
    launch_if_needed(__file__, args.nproc)
    device = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    torch.manual_seed(0)
    base = GPT(cfg)
    if args.profile:
        profile_table(base, args, device)
        dist.destroy_process_group()
        return
    n_params = sum(p.numel() for p in base.parameters())
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    variants = build_variants(base, names, args.bf16, device)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    total = args.warmup + args.steps
    for i in range(total):
        x, y = synthetic_batch(cfg, args.batch, i, rank, device=device)
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            model, opt = variants[name]
            t = timed_step(make_step(name, model, opt, x, y, args.bf16, device, losses[name]), device)
            if i >= args.warmup:
                times[name].append(t)
    med = {n: median(ts) for n, ts in times.items()}
    loss_gap = max(abs(losses[n][0] - losses[names[0]][0]) for n in names)
    rank0_print(f"\nstep benchmark: GPT {n_params / 1e6:.1f}M params ({cfg.blocks} blocks, d={cfg.dim}, seq "
                f"{cfg.seq}, batch {args.batch}/rank), {world} ranks on {device.type} "
                f"({dist.get_backend()}), {'bf16' if args.bf16 else 'fp32'}, {args.steps} steps after "
                f"{args.warmup} warm-up, median of the slowest rank")
    rank0_print(f"machine: {machine()}")
    ref = "torch" if "torch" in med else names[0]
    rank0_print(f"{'variant':<16}{'median ms':>11}{'min ms':>9}{'vs ' + ref:>10}")
    for n in names:
        rank0_print(f"{n:<16}{med[n] * 1e3:>11.1f}{min(times[n]) * 1e3:>9.1f}{med[n] / med[ref]:>10.3f}")
    if "ours" in med and "torch" in med:
        paired = median([a / b for a, b in zip(times["ours"], times["torch"])])
        rank0_print(f"ours / torch fully_shard = {med['ours'] / med['torch']:.3f} "
                    f"({(1 - med['ours'] / med['torch']) * 100:+.1f}% time saved); median of the per-step "
                    f"ratios (adjacent turns) {paired:.3f}")
    if "ours" in med and "ddp" in med:
        rank0_print(f"ours / DDP = {med['ours'] / med['ddp']:.3f}")
    if "ours" in med and "ours+profiler" in med:
        rank0_print(f"profiler overhead (on vs off) = {(med['ours+profiler'] / med['ours'] - 1) * 100:+.1f}%")
    rank0_print(f"first-step loss spread across variants: {loss_gap:.2e} (same init, same batch)")
    if args.json is not None and rank == 0:
        args.json.write_text(json.dumps({"median_s": med, "times_s": times, "machine": machine(),
                                         "config": vars(args) | {"json": str(args.json)}}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
