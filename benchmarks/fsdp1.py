"""FSDP1 side by side: this library's FullyShardedDataParallel vs torch's FSDP1 on the founding note's model.

    python benchmarks/fsdp1.py                          # step time (same ranks, taking turns) + peak RSS
    python benchmarks/fsdp1.py --parts step --steps 20  # only the step-time part

The model is models/note.py's GPT (the note's ``TransformerBlock``/``build_model``) at the size
given by ``--dim --blocks --seq --vocab``, wrapped by the note's code: ``FSDP(build_model(),
sharding_strategy=FULL_SHARD, auto_wrap_policy=transformer_auto_wrap_policy per block,
mixed_precision=MixedPrecision(param_dtype=bf16))`` (fp32: no mixed precision); torch's FSDP1 gets the
same arguments plus ``device_id`` (it refuses to start on CPU without one). AdamW, clip_grad_norm_ 1.0.

Step time: both models in the same ranks, fp32 and bf16, the variants taking turns every step; the
median of the slowest rank's step and the median of per-step paired ratios. Peak RSS: each (variant,
dtype) trains in its own launch (fresh processes, ``MALLOC_MMAP_THRESHOLD_=65536``), peak RSS of the
measured steps above the idle process, max over ranks.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import linecache
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import ROOT, header, machine, median, rank0_print

from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory
from fully_shard.tools.timing import timed_step
from models.note import NoteSizes, TransformerBlock, build_model

VARIANTS = ("ours", "torch")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--parts", default="step,memory")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per variant and dtype (after warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mem-steps", type=int, default=3)
    # the defaults are the quickstart's sizes (models/note.py's QUICKSTART, 0.27M params)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--rank-task", default=None, help=argparse.SUPPRESS)  # "step" or "mem:<variant>:<dtype>"
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return ap.parse_args()


def sizes(args: argparse.Namespace) -> NoteSizes:
    """The note's model at this size."""
    return NoteSizes(vocab=args.vocab, dim=args.dim, heads=args.heads, blocks=args.blocks, seq=args.seq)


def build(variant: str, bf16: bool, sizes: NoteSizes) -> Any:
    """The note's FSDP call with this library's class or torch's (``device_id`` for torch's, on CPU)."""
    if variant == "ours":
        from fully_shard import FullyShardedDataParallel as FSDP
        from fully_shard import MixedPrecision, ShardingStrategy
        from fully_shard.wrap import transformer_auto_wrap_policy
        extra: dict[str, Any] = {}
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
        from torch.distributed.fsdp import MixedPrecision, ShardingStrategy  # type: ignore[assignment]
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy  # type: ignore[assignment]
        extra = {"device_id": torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                 else torch.device("cpu")}
    auto_wrap = partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    return FSDP(build_model(sizes), sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=auto_wrap,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None, **extra)


def batch(args: argparse.Namespace, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    return data[:, :-1], data[:, 1:]


def step_fn(model: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, losses: list[float]) -> Any:
    def step() -> None:
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return step


def run_step_part(args: argparse.Namespace) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    runs: dict[str, Any] = {}
    for bf16 in (False, True):
        label = "bf16" if bf16 else "fp32"
        models = {v: build(v, bf16, sizes(args)) for v in VARIANTS}
        opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for i in range(args.warmup + args.steps):
            x, y = batch(args, i, device)
            order = VARIANTS[i % 2:] + VARIANTS[:i % 2]  # taking turns: neither always goes first
            for v in order:
                t = timed_step(step_fn(models[v], opts[v], x, y, losses[v]), device)
                if i >= args.warmup:
                    times[v].append(t)
        med = {v: median(ts) for v, ts in times.items()}
        paired = median([a / b for a, b in zip(times["ours"], times["torch"])])
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["torch"]))
        runs[label] = {"median_s": med, "paired": paired, "ratio": med["ours"] / med["torch"], "loss_gap": gap,
                       "times_s": times}
        del models, opts
    n_params = sum(p.numel() for p in build_model(sizes(args)).parameters())
    rank0_print(f"\nFSDP1 step time: the note's GPT {n_params / 1e6:.2f}M params ({args.blocks} blocks, d={args.dim}, "
                f"seq {args.seq}, vocab {args.vocab}), batch {args.batch}/rank, {dist.get_world_size()} ranks on "
                f"{device.type} ({dist.get_backend()}), FULL_SHARD, per-block units, AdamW + clip_grad_norm_; "
                f"{args.steps} steps after {args.warmup} warm-up, slowest rank")
    rank0_print(f"machine: {machine()}")
    rank0_print(header(f"{'dtype':<6}{'ours ms':>10}{'torch ms':>10}{'ours/torch':>12}{'paired':>9}"
                       f"{'loss gap':>11}"))
    for label, r in runs.items():
        rank0_print(f"{label:<6}{r['median_s']['ours'] * 1e3:>10.1f}{r['median_s']['torch'] * 1e3:>10.1f}"
                    f"{r['ratio']:>12.3f}{r['paired']:>9.3f}{r['loss_gap']:>11.1e}")
    if dist.get_rank() == 0 and args.out is not None:
        args.out.write_text(json.dumps(runs))


def run_mem_part(args: argparse.Namespace, variant: str, dtype: str) -> None:
    # both variants' modules imported before the idle reading: the training memory is compared, not the code's
    importlib.import_module("fully_shard.wrap.fsdp1")
    importlib.import_module("torch.distributed.fsdp.fully_sharded_data_parallel")
    idle, idle_kinds, idle_lines = current_memory(), rss_by_kind(), cached_source_bytes()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build(variant, dtype == "bf16", sizes(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses: list[float] = []
    x, y = batch(args, 0, device)
    step_fn(model, opt, x, y, losses)()  # warm-up: the optimizer state exists from here on
    if not reset_peak_memory():
        raise SystemExit("fsdp1.py: cannot reset the peak RSS (/proc/self/clear_refs); run on Linux.")
    for i in range(args.mem_steps):
        x, y = batch(args, i + 1, device)
        step_fn(model, opt, x, y, losses)()
    result = {"peak": peak_memory(), "idle": idle, "steady": current_memory()}
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what stays is live (glibc: free pages inside the heap too)
    result["kinds"] = {k: v - idle_kinds[k] for k, v in rss_by_kind().items()}
    result["linecache"] = cached_source_bytes() - idle_lines
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0 and args.out is not None:
        args.out.write_text(json.dumps(gathered))


def rss_by_kind() -> dict[str, int]:
    """Resident bytes of this process by mapping kind (/proc/self/smaps): file-backed (code and data of the
    libraries), the brk heap, other anonymous memory (mmap'd allocations, thread arenas, stacks)."""
    out = {"file": 0, "heap": 0, "anon": 0}
    kind = "anon"
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields[0] == "Rss:":
                out[kind] += int(fields[1]) * 1024
            elif "-" in fields[0] and ":" not in fields[0]:  # a mapping's header: address range ... [path]
                path = fields[5] if len(fields) > 5 else ""
                kind = "heap" if path == "[heap]" else "file" if path.startswith("/") else "anon"
    return out


def cached_source_bytes() -> int:
    """Bytes of source lines ``linecache`` holds (tracebacks and stack captures read whole files into it)."""
    return sum(sum(sys.getsizeof(line) for line in entry[2]) for entry in list(linecache.cache.values())
               if len(entry) > 2)


def launch(args: argparse.Namespace, task: str, out: Path) -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", __file__,
           *sys.argv[1:], "--rank-task", task, "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=None if task == "step" else subprocess.DEVNULL)


def main() -> None:
    args = parse_args()
    if args.rank_task is not None:
        torch.set_num_threads(1)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if args.rank_task == "step":
            run_step_part(args)
        else:
            _, variant, dtype = args.rank_task.split(":")
            run_mem_part(args, variant, dtype)
        dist.destroy_process_group()
        return
    parts = {p.strip() for p in args.parts.split(",")}
    results: dict[str, Any] = {"machine": machine(), "config": {k: v for k, v in vars(args).items()
                                                                if k not in ("json", "out", "rank_task")}}
    with tempfile.TemporaryDirectory() as tmp:
        if "step" in parts:
            launch(args, "step", Path(tmp) / "step.json")
            results["step"] = json.loads((Path(tmp) / "step.json").read_text())
        if "memory" in parts:
            mem: dict[str, Any] = {}
            for dtype in ("fp32", "bf16"):
                for variant in VARIANTS:
                    out = Path(tmp) / f"mem-{variant}-{dtype}.json"
                    print(f"peak RSS: {variant} {dtype} in fresh ranks ...", flush=True)
                    launch(args, f"mem:{variant}:{dtype}", out)
                    ranks = json.loads(out.read_text())
                    mem[f"{variant}-{dtype}"] = {"above": max(r["peak"] - r["idle"] for r in ranks),
                                                 "peak": max(r["peak"] for r in ranks),
                                                 "kinds": ranks[0]["kinds"], "linecache": ranks[0]["linecache"]}
            results["memory"] = mem
            mib = 2**20
            print("\nFSDP1 peak RSS (MiB per rank, max over ranks; training steps above the idle process):")
            print(header(f"{'dtype':<6}{'ours':>10}{'torch':>10}{'ours/torch':>12}{'ours peak':>11}{'torch peak':>12}"))
            for dtype in ("fp32", "bf16"):
                o, t = mem[f"ours-{dtype}"], mem[f"torch-{dtype}"]
                print(f"{dtype:<6}{o['above'] / mib:>10.1f}{t['above'] / mib:>10.1f}{o['above'] / t['above']:>12.3f}"
                      f"{o['peak'] / mib:>11.1f}{t['peak'] / mib:>12.1f}")
            print("\nWhere it is (rank 0, after the steps and malloc_trim, above the idle process; MiB ours / torch):")
            print(header(f"{'dtype':<6}{'file-backed':>16}{'heap':>16}{'other anon':>16}{'linecache':>16}"))
            for dtype in ("fp32", "bf16"):
                o, t = mem[f"ours-{dtype}"], mem[f"torch-{dtype}"]
                cells = [f"{o['kinds'][k] / mib:.1f} / {t['kinds'][k] / mib:.1f}" for k in ("file", "heap", "anon")]
                cells.append(f"{o['linecache'] / mib:.2f} / {t['linecache'] / mib:.2f}")
                print(f"{dtype:<6}" + "".join(f"{c:>16}" for c in cells))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
