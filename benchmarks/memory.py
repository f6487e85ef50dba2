"""Memory benchmark: per-rank sharded state vs DDP, and peak RSS vs torch's fully_shard (~50M params).

    python benchmarks/memory.py            # runs each variant in fresh ranks (2 by default), prints a table
    python benchmarks/memory.py --variants ours,torch --steps 3
    python benchmarks/memory.py --variants ours,torch --shape large   # 4 blocks d=1024 (or: small, 48 blocks d=256)

Each variant (this library, torch's ``fully_shard``, DDP) trains the same ~50M-parameter GPT in its own
``torchrun`` launch, so the processes' peak resident set sizes are comparable. ``MALLOC_MMAP_THRESHOLD_=
65536`` is set for the ranks: freed tensors go back to the OS, so RSS tracks live memory. Per rank it
reports the state this rank holds (parameters, gradients and AdamW moments, counted from the tensors:
its shards under FSDP, full copies under DDP) and the peak RSS of the training steps above the idle
process (after ``init_process_group``, before the model is built), plus the absolute peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import GPT, ROOT, GPTConfig, header, loss_fn, machine, synthetic_batch, wrap_variant

from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory

SHAPES = {  # --shape: the ~50M-parameter GPT (default), fewer larger blocks, many small blocks
    "gpt": GPTConfig(vocab=8192, dim=512, blocks=14, heads=8, seq=128),
    "large": GPTConfig(vocab=8192, dim=1024, blocks=4, heads=16, seq=128),
    # vocab 2048: with 8192 the step's peak is the loss's backward, before any fully_shard hook runs
    # (small-v8192 keeps that shape: benchmarks/README.md, "Memory")
    "small": GPTConfig(vocab=2048, dim=256, blocks=48, heads=4, seq=128),
    "small-v8192": GPTConfig(vocab=8192, dim=256, blocks=48, heads=4, seq=128),
}
CONFIG = SHAPES["gpt"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--variants", default="ours,torch,ddp")
    ap.add_argument("--steps", type=int, default=2, help="measured steps (after one warm-up step)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt",
                    help="gpt: 14 blocks d=512; large: 4 blocks d=1024; small: 48 blocks d=256, vocab 2048")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # set for the launched ranks
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def local_bytes(t: Any) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def run_rank(args: argparse.Namespace) -> None:
    """One rank of one variant: build, shard, train, measure; rank 0 writes the JSON to ``--out``."""
    global CONFIG
    CONFIG = SHAPES[args.shape]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    idle = current_memory()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    n_params = sum(p.numel() for p in model.parameters())
    model = wrap_variant(model, args.variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = synthetic_batch(CONFIG, args.batch, 0, rank)

    def step(measure: bool) -> dict[str, int]:
        loss_fn(model(x), y).backward()
        state = {}
        if measure:
            params = list(model.parameters())
            state["params"] = sum(local_bytes(p) for p in params)
            state["grads"] = sum(local_bytes(p.grad) for p in params)
        opt.step()
        if measure:
            state["optimizer"] = sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                                     if isinstance(v, torch.Tensor) and v.dim() > 0)
        opt.zero_grad(set_to_none=True)
        return state

    step(False)  # warm-up: optimizer state exists from here on
    if not reset_peak_memory():  # the peak of the measured steps only
        raise SystemExit("memory.py: cannot reset the peak RSS (writing /proc/self/clear_refs failed); expected a "
                         "Linux kernel that allows it. Fix: run on Linux outside a restricted container.")
    state: dict[str, int] = {}
    for _ in range(args.steps):
        state = step(True)
    result = {"rank": rank, "state": state, "peak_rss": peak_memory(), "idle_rss": idle,
              "steady_rss": current_memory(), "params": n_params}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0 and args.out is not None:
        args.out.write_text(json.dumps({"variant": args.variant, "world": world, "ranks": gathered}))
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.variant is not None:
        run_rank(args)
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    results: dict[str, Any] = {}
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            out = Path(tmp) / f"{variant}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--variant", variant, "--out", str(out), "--steps", str(args.steps),
                   "--batch", str(args.batch), "--shape", args.shape]
            print(f"running {variant} on {args.nproc} ranks ...", flush=True)
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            results[variant] = json.loads(out.read_text())
    report(results, args)


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    global CONFIG
    CONFIG = SHAPES[args.shape]
    mib = 2**20
    first = next(iter(results.values()))
    world, n_params = first["world"], first["ranks"][0]["params"]
    print(f"\nmemory benchmark: GPT {n_params / 1e6:.1f}M params ({CONFIG.blocks} blocks, d={CONFIG.dim}, vocab "
          f"{CONFIG.vocab}), batch {args.batch}x{CONFIG.seq} per rank, {world} ranks on CPU (gloo), fp32 + AdamW, "
          f"MALLOC_MMAP_THRESHOLD_=65536; max over ranks")
    print(f"machine: {machine()}")
    head = f"{'variant':<8}{'params':>9}{'grads':>9}{'AdamW':>9}{'state':>9}{'vs DDP':>8}{'peak RSS':>10}" \
           f"{'above idle':>12}{'vs torch':>10}"
    print(header(head, "   (MiB per rank)"))
    rows: dict[str, dict[str, float]] = {}
    for variant, data in results.items():
        ranks = data["ranks"]
        state = {k: max(r["state"][k] for r in ranks) for k in ("params", "grads", "optimizer")}
        total = sum(state.values())
        peak = max(r["peak_rss"] for r in ranks)
        above = max(r["peak_rss"] - r["idle_rss"] for r in ranks)
        rows[variant] = {**state, "state": total, "peak": peak, "above": above}
    ddp = rows.get("ddp", {}).get("state")
    torch_above = rows.get("torch", {}).get("above")
    for variant, r in rows.items():
        vs_ddp = f"{r['state'] / ddp:.3f}" if ddp else "-"
        vs_torch = f"{r['above'] / torch_above:.3f}" if torch_above else "-"
        print(f"{variant:<8}{r['params'] / mib:>9.1f}{r['grads'] / mib:>9.1f}{r['optimizer'] / mib:>9.1f}"
              f"{r['state'] / mib:>9.1f}{vs_ddp:>8}{r['peak'] / mib:>10.1f}{r['above'] / mib:>12.1f}{vs_torch:>10}")
    if ddp and "ours" in rows:
        print(f"ours: sharded state = {rows['ours']['state'] / ddp:.4f} of DDP's (1/{world} = {1 / world:.4f}; the "
              f"rest is dim-0 padding)")
    if torch_above and "ours" in rows:
        print(f"ours: training peak RSS above idle = {rows['ours']['above'] / torch_above:.3f}x torch's fully_shard "
              f"({rows['ours']['above'] / mib:.1f} vs {torch_above / mib:.1f} MiB)")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "raw": results, "machine": machine()}, indent=1))


if __name__ == "__main__":
    main()
