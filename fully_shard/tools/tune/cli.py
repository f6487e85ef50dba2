"""The tuner's command line: parse it, count the blocks, run the sweep, print and write the report."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .config import SweepSpec, TuneResult, sweep_configs
from .factories import find_blocks, load_object
from .report import format_table, plot, recommend
from .sweep import run_sweep

DESCRIPTION = "Wrap-granularity tuner: sweep blocks-per-unit x reshard_after_forward, measure, recommend."


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fully_shard.tune", description=DESCRIPTION)
    ap.add_argument("--model", required=True, help="module:function returning the unsharded model")
    ap.add_argument("--batch", required=True, help="module:function returning (inputs, targets) or inputs")
    ap.add_argument("--loss", default=None, help="module:function(output, targets) -> loss (optional)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--memory-budget-mb", type=float, default=None, help="peak memory per rank allowed (MiB)")
    ap.add_argument("--out", type=Path, default=Path("runs/tune"))
    ap.add_argument("--blocks", default=None, help="name of the ModuleList of blocks (default: the largest)")
    ap.add_argument("--granularities", default=None, help="comma-separated blocks per unit (default 1,2,4,..,all)")
    ap.add_argument("--reshard", default="true,false", help="reshard_after_forward values to try")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bf16 all-gather/compute, fp32 reductions")
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may take before a rank fails")
    ap.add_argument("--agree-timeout", type=float, default=30.0,
                    help="seconds ranks wait for each other after a configuration before relaunching")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    n_blocks, n_params = _count(args)
    configs = sweep_configs(n_blocks, _granularities(args.granularities, n_blocks),
                            [s.strip().lower() in ("1", "true", "yes") for s in args.reshard.split(",") if s.strip()])
    spec = SweepSpec(model=args.model, batch=args.batch, loss=args.loss, blocks=args.blocks, steps=args.steps,
                     warmup=args.warmup, bf16=args.bf16, device=args.device, threads=args.threads,
                     timeout_s=args.timeout, agree_timeout_s=args.agree_timeout, sys_path=[os.getcwd()])
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and args.device == "auto" else "cpu"
    print(f"tuning {args.model}: {n_params / 1e6:.2f}M params, {n_blocks} blocks, {len(configs)} configurations, "
          f"{args.world_size} ranks on {device}", flush=True)
    t0 = time.perf_counter()
    results = run_sweep(spec, configs, args.world_size, args.out / "work", progress=not args.no_progress)
    budget = int(args.memory_budget_mb * 2**20) if args.memory_budget_mb is not None else None
    best, reason = recommend(results, budget)
    table = format_table(results, budget, best)
    mem_kind = "CUDA allocator peak" if device == "cuda" else "peak RSS above the idle process"
    _print_verdict(table, mem_kind, args.steps, best, reason)
    title = (f"{args.model}: {n_params / 1e6:.1f}M params, {n_blocks} blocks, {args.world_size} ranks on {device}"
             + (f", budget {args.memory_budget_mb:.0f} MiB" if budget is not None else ""))
    plot(results, budget, best, args.out / "tune.png", title)
    report = {
        "model": args.model, "batch": args.batch, "world_size": args.world_size, "device": device,
        "params": n_params, "blocks": n_blocks, "memory_budget_bytes": budget, "memory_kind": mem_kind,
        "recommended": asdict(best.config) if best is not None else None, "reason": reason,
        "elapsed_s": time.perf_counter() - t0,
        "results": [asdict(r) for r in results],
    }
    (args.out / "tune.json").write_text(json.dumps(report, indent=1))
    (args.out / "tune.txt").write_text(table + "\n\n" + (f"recommended: {best.config.label} -- " if best else "")
                                       + reason + "\n")
    print(f"wrote {args.out / 'tune.json'}, {args.out / 'tune.png'}")
    return report


def _count(args: argparse.Namespace) -> tuple[int, int]:
    """Blocks and parameters of the model, built on the meta device; checks the factories load."""
    try:
        load_object(args.batch, "batch")
        if args.loss:
            load_object(args.loss, "loss")
        with torch.device("meta"):  # only to count the blocks: no memory, any size
            model = load_object(args.model, "model")()
        n_blocks = len(find_blocks(model, args.blocks))
    except ValueError as e:
        raise SystemExit(f"fully_shard.tune: {e}") from None
    return n_blocks, sum(p.numel() for p in model.parameters())


def _granularities(text: str | None, n_blocks: int) -> list[int] | None:
    """``--granularities 1,2,all`` -> [1, 2, n_blocks]; None (the default sweep) when not given."""
    if not text:
        return None
    ks = [n_blocks if s.strip() == "all" else int(s) for s in text.split(",") if s.strip()]
    bad = [k for k in ks if not 1 <= k <= n_blocks]
    if bad:
        raise SystemExit(f"--granularities {text}: expected values in 1..{n_blocks} or 'all', found {bad}")
    return ks


def _print_verdict(table: str, mem_kind: str, steps: int, best: TuneResult | None, reason: str) -> None:
    print(f"\n{table}\n\npeak memory = {mem_kind}, max over ranks; step = median of {steps} steps, "
          f"slowest rank; comm wait = exposed communication / step")
    if best is not None:
        print(f"recommended: {best.config.blocks_per_unit} block(s) per unit, reshard_after_forward="
              f"{best.config.reshard_after_forward} -- {reason}")
    else:
        print(f"no recommendation: {reason}")
