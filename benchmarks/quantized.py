"""Quantized all-gather benchmark: the example GPT trained with bf16 vs int8 (QuantizedAllGather) all-gathers.

    python benchmarks/quantized.py                  # launches 2 ranks itself, 200 steps
    python benchmarks/quantized.py --steps 50 --block-size 128

Both variants start from the same weights (models/gpt.py's ``build_model``, 7.4M params, or the
same GPT with ``--dim``/``--blocks``: bf16 matmuls are slow on CPUs without bf16 units) and see the same
batches (``synthetic_batch`` of its config, a new batch per step, 4 sequences per rank), with
bf16 params and fp32 reductions; one shards with ``QuantizedAllGather``. They take turns each step in the
same processes. Prints the final-loss gap (mean of the last 10 steps, relative), the all-gather bytes per
step from the profiler, the step-time ratio, and writes the loss curves to results/quantized.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    ROOT,
    init,
    launch_if_needed,
    loss_fn,
    machine,
    median,
    rank0_print,
    synthetic_batch,
    timed_step,
)

from fully_shard import MixedPrecisionPolicy, QuantizedAllGather, fully_shard, profile
from models.gpt import GPT, TUNE_CONFIG, GPTConfig, build_model

VARIANTS = ("bf16", "int8")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dim", type=int, default=TUNE_CONFIG.dim, help="smaller than the example's: a faster run")
    ap.add_argument("--blocks", type=int, default=TUNE_CONFIG.blocks)
    ap.add_argument("--png", type=Path, default=ROOT / "benchmarks" / "results" / "quantized.png")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def build(base: torch.nn.Module, quantized: bool, block_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(base)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    extra = {"all_gather_policy": QuantizedAllGather(block_size=block_size)} if quantized else {}
    for blk in model.blocks:  # type: ignore[union-attr]
        fully_shard(blk, mp_policy=mp, **extra)  # type: ignore[arg-type]
    fully_shard(model, mp_policy=mp, **extra)  # type: ignore[arg-type]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def global_loss(loss: torch.Tensor) -> float:
    value = loss.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def plot(losses: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in losses.items():
        ax.plot(range(1, len(ys) + 1), ys, label=f"{name} all-gather", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    launch_if_needed(__file__, args.nproc)
    device = init("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=TUNE_CONFIG.vocab, dim=args.dim, blocks=args.blocks, heads=TUNE_CONFIG.heads,
                    seq=TUNE_CONFIG.seq)
    base = build_model() if cfg == TUNE_CONFIG else GPT(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    models = {name: build(base, name == "int8", args.block_size) for name in VARIANTS}
    for _, opt in models.values():
        for group in opt.param_groups:
            group["lr"] = args.lr
    losses: dict[str, list[float]] = {n: [] for n in VARIANTS}
    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    ag_bytes: dict[str, float] = {}
    for i in range(args.steps):
        x, y = synthetic_batch(cfg, 4, i, rank, device=device)
        for name in VARIANTS[i % 2:] + VARIANTS[:i % 2]:
            model, opt = models[name]
            out: list[torch.Tensor] = []

            def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt,
                     out: list[torch.Tensor] = out, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                out.append(loss.detach())

            if i == 1:  # bytes of one steady-state step, from the profiler
                with profile(model) as prof:
                    t = timed_step(step, device)
                    prof.step()
                ag_bytes[name] = prof.summary()["all_gather_bytes"]
            else:
                t = timed_step(step, device)
            if i >= 3:
                times[name].append(t)
            losses[name].append(global_loss(out[0]))
    tail = min(10, args.steps)
    final = {n: sum(v[-tail:]) / tail for n, v in losses.items()}
    gap = (final["int8"] - final["bf16"]) / final["bf16"]
    ratio_bytes = ag_bytes["int8"] / ag_bytes["bf16"]
    med = {n: median(v) for n, v in times.items()} if args.steps > 3 else {n: float("nan") for n in VARIANTS}
    rank0_print(f"\nquantized all-gather: example GPT {n_params / 1e6:.1f}M params ({cfg.blocks} blocks, "
                f"d={cfg.dim}, seq {cfg.seq}, batch 4/rank), {dist.get_world_size()} ranks on CPU "
                f"(gloo), bf16 params, fp32 reduce, AdamW lr {args.lr}, {args.steps} steps, "
                f"block_size={args.block_size}")
    rank0_print(f"machine: {machine()}")
    rank0_print(f"{'variant':<8}{'first loss':>12}{'final loss':>12}{'AG MiB/step':>13}{'median ms':>11}")
    for n in VARIANTS:
        rank0_print(f"{n:<8}{losses[n][0]:>12.4f}{final[n]:>12.4f}{ag_bytes[n] / 2**20:>13.3f}{med[n] * 1e3:>11.1f}")
    rank0_print(f"final-loss gap int8 vs bf16 (mean of the last {tail} steps) = {gap * 100:+.2f}%")
    rank0_print(f"all-gather bytes int8 / bf16 = {ratio_bytes:.4f} (scales and block padding included)")
    rank0_print(f"step time int8 / bf16 = {med['int8'] / med['bf16']:.3f}")
    if rank == 0:
        plot(losses, args.png, f"example GPT, 2 CPU ranks: bf16 vs int8 all-gather (block {args.block_size}); "
                               f"final gap {gap * 100:+.2f}%")
        rank0_print(f"loss curves: {args.png}")
        if args.json is not None:
            args.json.write_text(json.dumps({"losses": losses, "times_s": times, "all_gather_bytes": ag_bytes,
                                             "gap": gap, "machine": machine(), "config": vars(args) | {
                                                 "png": str(args.png), "json": str(args.json)}}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
