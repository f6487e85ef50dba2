"""Optimizer-step benchmark: plain tensors vs DTensor dispatch vs this library's local step, same processes.

    python benchmarks/optimizer.py                  # launches 2 gloo ranks itself
    torchrun --nproc_per_node 2 benchmarks/optimizer.py --rounds 15

Three variants per optimizer/flag combination and model shape, each with its own copy of the same
parameters, gradients and optimizer: "plain" steps plain tensors with this rank's local shapes and
gradients (the floor), "dtensor" steps this library's sharded DTensor parameters with
``set_step_path(StepPath.DTENSOR)`` (every op through DTensor dispatch, as torch's fully_shard does),
"ours" steps the same kind of parameters on the default local path (design/optimizer-step.md).
Gradients are fixed (set once), so only ``optimizer.step()`` is timed. Each round runs every variant
for ``--steps`` steps in a rotating order so machine noise hits them alike; a round's time is the
slowest rank's. Prints medians per step and the median of per-round paired ratios, for wall time and
for the stepping thread's CPU time (the steady figure on a machine shared with other jobs).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from _common import init, launch_if_needed, machine, median, rank0_print, timed_step
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from fully_shard.optim.step import StepPath, set_step_path

SHAPES = {"48x32": (48, 32), "12x512": (12, 512)}
VARIANTS = ("plain", "dtensor", "ours")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to launch when not under torchrun")
    ap.add_argument("--rounds", type=int, default=9, help="measured rounds per combination")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per variant per round")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--optims", default="sgd,adam,adamw")
    ap.add_argument("--flags", default="foreach,for-loop,fused")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def make_model(blocks: int, dim: int) -> nn.Module:
    """``blocks`` Linear(dim, dim) and a LayerNorm: 2 * blocks + 2 parameters (98 for 48 blocks)."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(dim, dim) for _ in range(blocks)), nn.LayerNorm(dim))


def make_optimizer(name: str, flag: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {"foreach": flag == "foreach"} if flag != "fused" else {"fused": True}
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kwargs)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(params, lr=1e-3, weight_decay=0.01, **kwargs)


def build(blocks: int, dim: int, name: str, flag: str) -> dict[str, tuple[torch.optim.Optimizer, StepPath, nn.Module]]:
    """Each variant's optimizer over its own parameters, with the same fixed (local) gradients."""
    variants = {}
    sharded_params: list[DTensor] = []
    for variant in ("dtensor", "ours", "plain"):
        model = make_model(blocks, dim)
        if variant != "plain":
            for block in list(model.children()):
                fully_shard(block)
            fully_shard(model)
        params: list[torch.Tensor] = list(model.parameters())
        if variant == "plain":  # plain tensors with this rank's local shapes: the sharded model's
            params = [nn.Parameter(p.to_local().detach().clone()) for p in sharded_params]
        else:
            sharded_params = [p for p in params if isinstance(p, DTensor)]
        gen = torch.Generator().manual_seed(1)
        for p in params:
            local = p.to_local() if isinstance(p, DTensor) else p
            local_grad = torch.randn(local.shape, generator=gen)
            p.grad = (DTensor.from_local(local_grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                      if isinstance(p, DTensor) else local_grad)
        variants[variant] = (make_optimizer(name, flag, params),
                             StepPath.DTENSOR if variant == "dtensor" else StepPath.LOCAL, model)  # keep it alive
    return {v: variants[v] for v in VARIANTS}


def run_steps(opt: torch.optim.Optimizer, path: StepPath, steps: int, cpu: list[float]) -> Callable[[], None]:
    def fn() -> None:
        previous = set_step_path(path)
        start = time.thread_time()
        try:
            for _ in range(steps):
                opt.step()
        finally:
            cpu.append(time.thread_time() - start)
            set_step_path(previous)
    return fn


def measure(variants: dict[str, tuple[torch.optim.Optimizer, StepPath, nn.Module]], rounds: int,
            steps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-round ms per step: wall (slowest rank, from a barrier) and this thread's CPU time (max over
    ranks; less sensitive to other jobs on a shared machine)."""
    device = torch.device("cpu")
    for opt, path, _ in variants.values():  # warm-up: the first step creates the states (DTensor path)
        run_steps(opt, path, 2, [])()
    wall: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    for r in range(rounds):
        for v in order[r % len(order):] + order[:r % len(order)]:
            opt, path, _ = variants[v]
            spent: list[float] = []
            wall[v].append(timed_step(run_steps(opt, path, steps, spent), device) / steps * 1e3)
            slowest = torch.tensor(spent, dtype=torch.float64)
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            cpu[v].append(float(slowest.item()) / steps * 1e3)
    return wall, cpu


def main() -> None:
    args = parse_args()
    launch_if_needed(__file__, args.nproc)
    init("gloo")
    rank0_print(f"# optimizer.step() per step, ms; {machine()}; {torch.distributed.get_world_size()} ranks; "
                f"median of {args.rounds} rounds x {args.steps} steps, variants interleaved")
    rank0_print(f"{'shape':>7} {'optimizer':>16} {'clock':>5} {'plain':>8} {'dtensor':>8} {'ours':>8} "
                f"{'dtensor/plain':>13} {'ours/plain':>10} {'ours/dtensor':>12}")
    results = []
    for shape in args.shapes.split(","):
        blocks, dim = SHAPES[shape]
        for name in args.optims.split(","):
            for flag in args.flags.split(","):
                if (name, flag) == ("sgd", "fused"):
                    rank0_print(f"{shape:>7} {'sgd fused':>16}  n/a: DTensor has no sharding strategy for "
                                "aten._fused_sgd_ (the first step, which creates the momentum, runs on DTensor)")
                    continue
                timings = measure(build(blocks, dim, name, flag), args.rounds, args.steps)
                for clock, times in zip(("wall", "cpu"), timings):
                    med = {v: median(ts) for v, ts in times.items()}
                    paired = {f"{a}/{b}": median([x / y for x, y in zip(times[a], times[b])])
                              for a, b in (("dtensor", "plain"), ("ours", "plain"), ("ours", "dtensor"))}
                    rank0_print(f"{shape:>7} {name + ' ' + flag:>16} {clock:>5} {med['plain']:8.2f} "
                                f"{med['dtensor']:8.2f} {med['ours']:8.2f} {paired['dtensor/plain']:13.2f} "
                                f"{paired['ours/plain']:10.2f} {paired['ours/dtensor']:12.2f}")
                    results.append({"shape": shape, "optimizer": name, "flag": flag, "clock": clock,
                                    "median_ms": med, "paired": paired})
    if args.json is not None and torch.distributed.get_rank() == 0:
        args.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
