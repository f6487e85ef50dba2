"""GPU readiness check: bf16 step benchmark, profiler trace, all-gathers on side streams overlapping compute.

    torchrun --nproc_per_node 1 benchmarks/gpu_check.py      # one GPU, NCCL, world size 1
    torchrun --nproc_per_node 8 benchmarks/gpu_check.py      # a node

One short script (well under 3 minutes on one H200). It

1. times a bf16 GPT step under this library, torch's fully_shard and DDP (autocast), taking turns;
2. profiles the library with ``fully_shard.profile`` (the CUDA timing-event path) and checks its numbers
   (one all-gather per unit in forward, bytes = 2x gathered for resharded units, exposed <= time);
3. records a ``torch.profiler`` trace and checks that the all-gather path (NCCL kernels, the copy-in on
   the all-gather stream) runs on streams other than the compute stream and overlaps compute kernels;
4. prints the step times, the profiler table, the exposed communication and the overlap.

Every failed check raises: the script exits non-zero with ``CHECK FAILED: ...``. Nothing is skipped:
without a CUDA device it fails too.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import GPT, add_model_args, model_config, synthetic_batch, timed_step, train_step, wrap_variant
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from fully_shard import profile
from fully_shard.core.state import get_state


class CheckFailed(AssertionError):
    pass


def check(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(f"CHECK FAILED: {message}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # big enough that the GPU, not Python, is the bottleneck (so overlap is observable): ~0.5B params
    add_model_args(ap, dim=2048, blocks=8, heads=16, seq=2048, vocab=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small model and few steps (for the test suite)")
    return ap.parse_args()


def build(base: GPT, name: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = wrap_variant(copy.deepcopy(base), name, bf16=True, device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step_benchmark(variants: dict[str, Any], x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace,
                   device: torch.device) -> dict[str, float]:
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.warmup + args.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            model, opt = variants[name]
            elapsed = timed_step(partial(train_step, name, model, opt, x, y, bf16=True, device=device), device)
            if i >= args.warmup:
                times[name].append(elapsed)
    return {n: statistics.median(ts) for n, ts in times.items()}


def check_profiler(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    gathered = {}
    for m in model.modules():
        state = get_state(m)
        if state is not None and state.group is not None:
            gathered[state.group.fqn] = state.group.unsharded_nbytes
    steps = 4
    with profile(model) as prof:
        for _ in range(steps):
            train_step("ours", model, opt, x, y, bf16=True, device=x.device)
            prof.step()
    check(len(prof.steps) == steps, f"profiler recorded {len(prof.steps)} steps, expected {steps}")
    for st in prof.steps:
        check(st.step_s > 0, "step time must be positive")
        check(st.peak_memory > 0, "CUDA peak memory must be positive")
        for name, u in st.units.items():
            g = gathered[name]
            check(u.all_gather_forward.count == 1 and u.all_gather_forward.bytes == g,
                  f"unit {name or '<root>'}: forward all-gathers {u.all_gather_forward}, expected 1 x {g} bytes")
            regather = 1 if name else 0  # blocks reshard after forward; the root keeps its params
            check(u.all_gather_backward.count == regather,
                  f"unit {name or '<root>'}: {u.all_gather_backward.count} backward all-gathers, expected {regather}")
            check(u.reduce_scatter.count == 1, f"unit {name or '<root>'}: {u.reduce_scatter.count} reduce-scatters")
        for c in st.collectives:
            check(c.t_done >= c.t_issue, f"{c.kind} {c.unit}: done before issued ({c.t_issue} > {c.t_done})")
            check(c.t_issue >= st.t_start - 1e-3 and c.t_done <= st.t_end + 1e-3,
                  f"{c.kind} {c.unit}: GPU times outside the step [{st.t_start}, {st.t_end}]: {c}")
            check(0.0 <= c.exposed_s <= c.time_s + 1e-6, f"{c.kind} {c.unit}: exposed {c.exposed_s} > time {c.time_s}")
    s = prof.summary()
    check(0.0 <= s["comm_share"] <= 1.0, f"comm share {s['comm_share']} outside [0, 1]")
    check(abs(s["bytes_over_model"] - s["expected_bytes_over_model"]) < 0.05,
          f"bytes/step {s['bytes_over_model']:.3f}x the model, expected {s['expected_bytes_over_model']:.3f}x")
    return prof


def check_streams(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, world: int) -> dict[str, float]:
    """torch.profiler trace of 2 steps: where the all-gather path's kernels run and whether they overlap."""
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(2):
            train_step("ours", model, opt, x, y, bf16=True, device=x.device)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"trace.{dist.get_rank()}.json"
        tp.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e and "stream" in e.get("args", {})]
    check(len(kernels) > 0, "the torch.profiler trace has no CUDA kernels")
    busy: dict[int, float] = {}
    for k in kernels:
        busy[k["args"]["stream"]] = busy.get(k["args"]["stream"], 0.0) + float(k["dur"])
    compute = max(busy, key=lambda s: busy[s])  # the stream with the most kernel time runs the model
    nccl = [k for k in kernels if "nccl" in k["name"].lower()]
    side = [k for k in kernels if k["args"]["stream"] != compute]
    on_compute = [k["name"] for k in nccl if k["args"]["stream"] == compute]
    check(not on_compute, f"NCCL kernels on the compute stream {compute}: {sorted(set(on_compute))[:3]}")
    if world > 1:
        gathers = [k for k in nccl if "allgather" in k["name"].lower().replace("_", "")]
        check(len(gathers) > 0, "no NCCL all-gather kernels in the trace")
    check(len(side) > 0, f"no kernel runs outside the compute stream {compute}: the all-gather copy-in and the "
                         f"collectives should run on the library's streams (streams seen: {sorted(busy)})")
    spans = sorted((float(k["ts"]), float(k["ts"]) + float(k["dur"]))
                   for k in kernels if k["args"]["stream"] == compute)
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    overlap = 0.0
    for k in side:
        s, e = float(k["ts"]), float(k["ts"]) + float(k["dur"])
        for ms, me in merged:
            if me <= s:
                continue
            if ms >= e:
                break
            overlap += min(e, me) - max(s, ms)
    side_time = sum(float(k["dur"]) for k in side)
    check(overlap > 0, f"side-stream kernels ({len(side)}, {side_time:.0f} us) never overlap compute kernels")
    return {"compute_stream": compute, "side_kernels": len(side), "nccl_kernels": len(nccl),
            "side_us": side_time, "overlap_us": overlap, "side_streams": len({k['args']['stream'] for k in side})}


def main() -> None:
    args = parse_args()
    if args.quick:
        args.dim, args.blocks, args.heads, args.seq, args.vocab, args.batch = 256, 4, 4, 256, 4096, 4
        args.steps, args.warmup = 4, 2
    check(torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine (run it there with "
                                     "torchrun --nproc_per_node N benchmarks/gpu_check.py)")
    check("RANK" in os.environ, "run under torchrun: torchrun --nproc_per_node 1 benchmarks/gpu_check.py")
    t_start = time.perf_counter()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        base = GPT(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    x, y = synthetic_batch(cfg, args.batch, 0, rank, device=device)
    variants = {name: build(base, name, device) for name in ("ours", "torch", "ddp")}
    del base
    med = step_benchmark(variants, x, y, args, device)
    if rank == 0:  # the figures first, so they are there even if a check below fails
        print(f"\ngpu_check: GPT {n_params / 1e6:.0f}M params ({cfg.blocks} blocks, d={cfg.dim}, seq {cfg.seq}, batch "
              f"{args.batch}/rank), bf16, {world} x {torch.cuda.get_device_name(device)}, NCCL, "
              f"torch {torch.__version__}")
        print(f"{'variant':<8}{'median ms':>11}{'vs torch':>10}")
        for n, t in med.items():
            print(f"{n:<8}{t * 1e3:>11.2f}{t / med['torch']:>10.3f}")
        print(f"ours / torch fully_shard = {med['ours'] / med['torch']:.3f}; "
              f"ours / DDP = {med['ours'] / med['ddp']:.3f}",
              flush=True)
    model, opt = variants["ours"]
    prof = check_profiler(model, opt, x, y)
    s = prof.summary()
    if rank == 0:
        print(prof.table(), flush=True)
    streams = check_streams(model, opt, x, y, world)
    if rank == 0:
        print(f"exposed communication: {s['exposed_comm_s'] * 1e3:.2f} ms of a {s['step_s'] * 1e3:.2f} ms step "
              f"({s['comm_share']:.1%}); collectives in flight {s['comm_busy_share']:.1%} of the step")
        print(f"streams: compute stream {streams['compute_stream']}; {streams['side_kernels']} kernels on "
              f"{streams['side_streams']} other stream(s) ({streams['nccl_kernels']} NCCL), "
              f"{streams['overlap_us']:.0f} of {streams['side_us']:.0f} us overlapping compute kernels")
        print(f"ALL CHECKS PASSED in {time.perf_counter() - t_start:.0f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except CheckFailed as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(1)
