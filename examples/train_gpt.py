"""Main example: train a GPT-style model on synthetic tokens with fully_shard, end to end.

Two CPU ranks (gloo), the default; about half a minute on 2 cores::

    torchrun --nproc_per_node 2 examples/train_gpt.py

One node with GPUs (NCCL is picked automatically when CUDA is available; bf16 compute)::

    torchrun --nproc_per_node 8 examples/train_gpt.py --bf16 --dim 1024 --blocks 24 --seq 1024 --batch 8

Several nodes: run the same command on every node, pointing the rendezvous at one of them::

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node0.example:29500 \\
        --rdzv_id gpt-run-1 examples/train_gpt.py --bf16 --dim 1024 --blocks 24 --seq 1024

Each block (or ``--blocks-per-unit k`` consecutive blocks) becomes one fully_shard unit via
``auto_wrap(model, GranularityPolicy(k))``, the rest of the model the root unit. Checkpoints are written
every ``--ckpt-every`` steps to ``--ckpt-dir``;
``--resume`` continues from the latest one (same loss curve as an uninterrupted run). At the end rank
0 prints the loss curve, the per-rank memory next to an unsharded model, and the profiler's table of
the last steps (per-unit all-gather/reduce-scatter time and bytes, exposed communication, memory).
The model, its loss and its synthetic batches are models/gpt.py's (shared with the benchmarks and the GPU
check; ``models.gpt:build_model``/``build_batch`` are the tuner's factories).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fully_shard import MixedPrecisionPolicy, Profiler, profile
from fully_shard.wrap import GranularityPolicy, WrapPlan, auto_wrap
from models.gpt import GPT, Block, GPTConfig, loss_fn, synthetic_batch


# --- sharding and checkpoints ----------------------------------------------------------------------
def shard_model(model: GPT, blocks_per_unit: int, reshard_after_forward: bool,
                mp_policy: MixedPrecisionPolicy) -> WrapPlan:
    """``blocks_per_unit`` consecutive blocks per fully_shard unit, the rest of the model the root unit."""
    return auto_wrap(model, GranularityPolicy(blocks_per_unit, block_classes={Block}), mp_policy=mp_policy,
                     reshard_after_forward=reshard_after_forward)


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
    from fully_shard import checkpoint

    checkpoint.save(path, model, optimizer, extra=extra)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from fully_shard import checkpoint

    return checkpoint.load(path, model, optimizer)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted((p for p in ckpt_dir.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]))
    return found[-1] if found else None


# --- memory accounting -----------------------------------------------------------------------------
def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (its shards)."""
    params = list(model.parameters())
    opt = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0)
    param_bytes = sum(local_bytes(p) for p in params)  # grads: same shards, same dtype (zero_grad frees them)
    return {"params": param_bytes, "grads": param_bytes, "optimizer": opt}


# --- training --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bf16", action="store_true", help="bf16 all-gathers and compute, fp32 reductions")
    ap.add_argument("--blocks-per-unit", type=int, default=1, help="consecutive blocks per fully_shard unit")
    ap.add_argument("--no-reshard-after-forward", action="store_true",
                    help="keep gathered params from forward to backward (ZeRO-2-like: less comm, more memory)")
    ap.add_argument("--ckpt-dir", type=Path, default=Path("runs/train_gpt/checkpoints"))
    ap.add_argument("--ckpt-every", type=int, default=20, help="0 disables checkpoints")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    ap.add_argument("--profile-steps", type=int, default=5, help="profile the last N steps (0: off)")
    ap.add_argument("--trace", type=Path, default=None, help="write rank 0's Chrome trace here")
    ap.add_argument("--report", type=Path, default=None, help="write rank 0's summary (losses, memory) as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def setup() -> torch.device:
    if "RANK" not in os.environ:
        raise SystemExit("train_gpt.py expects torchrun's environment. Run: "
                         "torchrun --nproc_per_node 2 examples/train_gpt.py")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, blocks=args.blocks, heads=args.heads, seq=args.seq)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    full_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 \
        else MixedPrecisionPolicy()
    plan = shard_model(model, args.blocks_per_unit, not args.no_reshard_after_forward, mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    start, losses = 0, []
    if args.resume:
        ckpt = latest_checkpoint(args.ckpt_dir)
        if ckpt is None:
            raise SystemExit(f"--resume: no checkpoint found in {args.ckpt_dir} (expected step-<N> folders). "
                             "Fix: run without --resume first, or point --ckpt-dir at the run.")
        extra = load_checkpoint(ckpt, model, optimizer)
        start, losses = int(extra["step"]), list(extra["losses"])
        if rank == 0:
            print(f"resumed from {ckpt} at step {start}")
    if rank == 0:
        print(f"GPT {n_params / 1e6:.2f}M params ({cfg}), {len(plan.units)} fully_shard units, world {world} on "
              f"{device.type}, {'bf16' if args.bf16 else 'fp32'}")
        print(plan.table())

    bar: Any = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    prof_start = max(start, args.steps - args.profile_steps) if args.profile_steps else args.steps
    prof: Profiler | None = None
    t0 = time.perf_counter()
    with contextlib.ExitStack() as profiling:
        for step in range(start, args.steps):
            if step == prof_start:
                prof = profiling.enter_context(profile(model))
            x, y = synthetic_batch(cfg, args.batch, step, rank, args.seed, device)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if prof is not None:
                prof.step()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / world)
            if bar is not None:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                bar.update(1)
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                save_checkpoint(args.ckpt_dir / f"step-{step + 1}", model, optimizer,
                                {"step": step + 1, "losses": losses})
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()

    # per-rank memory next to an unsharded copy (params + grads + AdamW's two moments)
    mine = state_bytes(model, optimizer)
    full = {"params": full_param_bytes, "grads": full_param_bytes, "optimizer": 2 * full_param_bytes}
    report = {"losses": losses, "state_bytes": mine, "unsharded_bytes": full, "elapsed_s": elapsed,
              "profile": prof.summary() if prof is not None and prof.steps else None}
    if args.trace is not None and prof is not None and rank == 0:
        prof.export_chrome_trace(args.trace)
    if args.report is not None and rank == 0:
        args.report.write_text(json.dumps(report, indent=1))
    if rank == 0:
        print_report(args, losses, mine, full, world, elapsed, start)
        if prof is not None and prof.steps:
            print(prof.table())
    dist.barrier()
    dist.destroy_process_group()
    return report


def print_report(args: argparse.Namespace, losses: list[float], mine: dict[str, int], full: dict[str, int],
                 world: int, elapsed: float, start: int) -> None:
    n = len(losses)
    marks = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1})
    curve = "  ".join(f"{i + 1}:{losses[i]:.3f}" for i in marks if 0 <= i < n)
    head = sum(losses[:5]) / max(1, len(losses[:5]))
    tail = sum(losses[-5:]) / max(1, len(losses[-5:]))
    print(f"\nloss (step:loss) {curve}")
    print(f"loss mean of first 5 steps {head:.3f} -> last 5 steps {tail:.3f} (log(vocab) = "
          f"{math.log(args.vocab):.3f}); {args.steps - start} steps in {elapsed:.1f} s")
    mib = 1 / 2**20
    print(f"per-rank state (this rank's shards)  params {mine['params'] * mib:.2f} MiB  grads "
          f"{mine['grads'] * mib:.2f} MiB  optimizer {mine['optimizer'] * mib:.2f} MiB  = "
          f"{sum(mine.values()) * mib:.2f} MiB")
    print(f"unsharded model (one process)        params {full['params'] * mib:.2f} MiB  grads "
          f"{full['grads'] * mib:.2f} MiB  optimizer {full['optimizer'] * mib:.2f} MiB  = "
          f"{sum(full.values()) * mib:.2f} MiB  -> sharded/unsharded = "
          f"{sum(mine.values()) / sum(full.values()):.3f} (1/{world} = {1 / world:.3f})\n")


if __name__ == "__main__":
    main()
