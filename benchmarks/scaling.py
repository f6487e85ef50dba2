"""How cost grows: step time, peak memory and bytes per step of ours, torch's fully_shard and DDP per axis.

    python benchmarks/scaling.py                    # all three axes, 2 rounds (~20 min on 2 loaded cores)
    python benchmarks/scaling.py --axis units       # one axis: units | width | world
    python benchmarks/scaling.py --axis units --quick   # smoke run: the smallest point, 2 ranks, 2 steps

The example GPT (every block one unit, then the root; fp32, AdamW) grows along one axis at a time:

* units: 4 -> 8 -> 16 -> 32 -> 64 blocks of a tiny width (d=64), 2 ranks: the per-unit host cost;
* width: d = 128 -> 256 -> 512 -> 1024 at 4 blocks, 2 ranks: the per-byte cost;
* world: 2 -> 4 -> 8 ranks (8 blocks, d=128, same batch per rank): the per-rank cost. The machine has
  2 cores, so 4 and 8 ranks share them (1 thread each): the step time then measures time-sharing too.

Per point and round, two kinds of launch, each of fresh rank processes (gloo, 1 thread per rank), forked
from this process after its imports: a ``torchrun`` launch imports torch anew in every rank, ~12 s of
wall time per launch on this loaded machine, and the axes need ~50 launches per round:

* time: the variants train side by side in the same processes, taking turns each step in a rotating
  order; a step's time is the slowest rank's (``fully_shard.tools.timing.timed_step``), the median over
  the measured steps is reported, and ours/torch is also given as the median of per-step paired ratios;
  next to it the CPU time of a step (``time.process_time``: every thread of the process, gloo's included),
  summed over the ranks: the work itself, less sensitive than wall time to other jobs on the machine
  and to how much of the communication the compute hides;
  then one more step per variant with a counting wrapper around ``torch.distributed``'s collectives
  (both FSDP libraries call them through the module) gives the bytes per step; DDP's all-reduce bytes
  come from a comm hook on a separate copy (its C++ reducer calls the process group directly);
* memory: one launch per variant (fresh processes, so peak RSS is that variant's own), with
  ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors go back to the OS: the peak RSS of the measured
  steps above the idle process (after ``init_process_group``), max over ranks
  (``fully_shard.tools.memory``).

Bytes are the collectives' buffer sizes (the gathered output of an all-gather, the input of a
reduce-scatter, the tensor of an all-reduce) per rank and step, the convention of ``traffic.py`` and the
profiler. Results: ``benchmarks/results/scaling.{txt,json}`` and one plot per axis
(``results/scaling_<axis>.png``, when matplotlib is importable: the ``tools`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import datetime
import functools
import json
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    GPT,
    ROOT,
    AxisBytes,
    GPTConfig,
    header,
    machine,
    median,
    synthetic_batch,
    timed_step,
    train_step,
    wrap_variant,
)

from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory

MIB = 2**20
RESULTS = ROOT / "benchmarks" / "results"
AXES = ("units", "width", "world")
DEFAULT_VARIANTS = ("ours", "torch", "ddp")


@dataclass(frozen=True)
class Point:
    """One measured configuration: the axis value, the ranks and the model."""

    axis: str
    value: int
    world: int
    cfg: GPTConfig
    batch: int  # sequences per rank
    steps: int  # measured steps per variant (time launch)
    warmup: int


def axis_points(axis: str, quick: bool) -> list[Point]:
    """The points of ``axis`` (only the smallest, 2 steps after 1 warm-up, with ``quick``)."""
    if axis == "units":
        pts = [Point(axis, n, 2, GPTConfig(vocab=512, dim=64, blocks=n, heads=4, seq=32), 2, 8, 2)
               for n in (4, 8, 16, 32, 64)]
    elif axis == "width":
        pts = [Point(axis, d, 2, GPTConfig(vocab=1024, dim=d, blocks=4, heads=4, seq=32), 2, 4, 1)
               for d in (128, 256, 512, 1024)]
    elif axis == "world":
        pts = [Point(axis, w, w, GPTConfig(vocab=1024, dim=128, blocks=8, heads=4, seq=32), 2, 6, 1)
               for w in (2, 4, 8)]
    else:
        raise SystemExit(f"scaling.py: unknown axis {axis!r}; expected one of {', '.join(AXES)}")
    return [replace(pts[0], steps=2, warmup=1)] if quick else pts


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--axis", default="all", help="units | width | world | all")
    ap.add_argument("--quick", action="store_true", help="smoke run: the smallest point of each axis, 2 steps")
    ap.add_argument("--values", default=None, help="only these axis values (comma list, e.g. --axis world --values 8)")
    ap.add_argument("--rounds", type=int, default=2, help="times each point is measured (fresh launches each)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="ours,torch,ddp (ours and torch needed "
                                                                          "for the ratios)")
    ap.add_argument("--mem-steps", type=int, default=2, help="measured steps of a memory launch (after 1 warm-up)")
    ap.add_argument("--output-dir", type=Path, default=RESULTS, help="where scaling.{txt,json} and the plots go")
    ap.add_argument("--no-plots", action="store_true")
    return ap.parse_args()


# --- counting collectives ---------------------------------------------------------------------------
@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Bytes per kind of every c10d collective issued inside, at the dispatcher (``AxisBytes``: whether a
    library calls ``torch.distributed``'s functions or the process group's methods)."""
    counts: dict[str, int] = {}
    with AxisBytes() as counted:
        yield counts
    for kind, _group, nbytes in counted.records:
        counts[kind] = counts.get(kind, 0) + nbytes


def ddp_bytes(base: GPT, cfg: GPTConfig, batch: int, rank: int) -> dict[str, int]:
    """DDP's all-reduce bytes of one step (its second: buckets rebuilt), from a comm hook on a copy."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(copy.deepcopy(base))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counted: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the runtime annotations
        counted.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    for i in range(2):
        counted.clear()
        x, y = synthetic_batch(cfg, batch, i, rank)
        train_step("ddp", model, opt, x, y, bf16=False, device=torch.device("cpu"))
    return {"all_reduce": sum(counted)}


# --- the ranks ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """What the ranks of one launch run: the point, the variants (in turn, or one for memory), the steps."""

    pt: Point
    role: str  # "time" | "memory"
    names: tuple[str, ...]
    steps: int
    warmup: int


def one_step(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             first_loss: dict[str, float], cpu: list[float]) -> None:
    """One training step; its loss (the first one kept) and this process's CPU seconds (all threads)."""
    c0 = time.process_time()
    loss = float(train_step(name, model, opt, x, y, bf16=False, device=torch.device("cpu")))
    cpu.append(time.process_time() - c0)
    first_loss.setdefault(name, loss)


def run_time(job: Launch) -> dict[str, Any]:
    """One time launch: every variant takes turns each step in these processes; then bytes per step."""
    device = torch.device("cpu")
    rank = dist.get_rank()
    cfg, names = job.pt.cfg, list(job.names)
    torch.manual_seed(0)
    base = GPT(cfg)
    variants = {}
    for name in names:
        model = wrap_variant(copy.deepcopy(base), name, device=device)
        variants[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    times: dict[str, list[float]] = {n: [] for n in names}
    first_loss: dict[str, float] = {}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for i in range(job.warmup + job.steps):
        x, y = synthetic_batch(cfg, job.pt.batch, i, rank)
        for name in names[i % len(names):] + names[:i % len(names)]:
            model, opt = variants[name]
            t = timed_step(functools.partial(one_step, name, model, opt, x, y, first_loss, cpu[name]), device)
            if i >= job.warmup:
                times[name].append(t)
    cpu_sum = torch.tensor([cpu[n][job.warmup:] for n in names], dtype=torch.float64)
    dist.all_reduce(cpu_sum)  # CPU seconds per step summed over the ranks
    nbytes: dict[str, dict[str, int]] = {}
    x, y = synthetic_batch(cfg, job.pt.batch, job.warmup + job.steps, rank)
    for name in names:
        if name == "ddp":
            nbytes[name] = ddp_bytes(base, cfg, job.pt.batch, rank)
            continue
        model, opt = variants[name]
        with count_collectives() as counts:
            train_step(name, model, opt, x, y, bf16=False, device=device)
        nbytes[name] = dict(counts)
    return {"params": sum(p.numel() for p in base.parameters()), "times_s": times, "bytes": nbytes,
            "cpu_s": {n: cpu_sum[i].tolist() for i, n in enumerate(names)}, "first_loss": first_loss}


def run_memory(job: Launch) -> dict[str, Any]:
    """One memory launch (one variant, fresh processes): peak RSS of the measured steps above idle."""
    device = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    (name,) = job.names
    idle = current_memory()
    torch.manual_seed(0)
    model = wrap_variant(GPT(job.pt.cfg), name, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = synthetic_batch(job.pt.cfg, job.pt.batch, 0, rank)
    for _ in range(job.warmup):  # optimizer state exists from here on
        train_step(name, model, opt, x, y, bf16=False, device=device)
    if not reset_peak_memory():
        raise SystemExit("scaling.py: cannot reset the peak RSS (writing /proc/self/clear_refs failed); expected a "
                         "Linux kernel that allows it. Fix: run on Linux outside a restricted container.")
    for _ in range(job.steps):
        train_step(name, model, opt, x, y, bf16=False, device=device)
    mine = torch.tensor([peak_memory() - idle, peak_memory()], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return {"above_idle": max(float(g[0]) for g in gathered), "peak": max(float(g[1]) for g in gathered)}


def rank_main(rank: int, port: int, job: Launch, conn: Any) -> None:
    """A forked rank: join the gloo group, run the job; rank 0 sends the result (or any rank its error)."""
    world = job.pt.world
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        if job.role == "memory":  # freed tensors go back to the OS: RSS tracks live memory (as memory.py's
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)  # MALLOC_MMAP_THRESHOLD_=65536)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        result = run_time(job) if job.role == "time" else run_memory(job)
        dist.destroy_process_group()
        if rank == 0:
            conn.send(("ok", result))
    except BaseException:
        conn.send(("err", f"rank {rank}:\n{traceback.format_exc()}"))
        raise


# --- the orchestrator ----------------------------------------------------------------------------------
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(job: Launch, timeout_s: float = 900.0) -> dict[str, Any]:
    """Fork ``job.pt.world`` fresh ranks that run ``job``; rank 0's result, or SystemExit with the failure."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, job, send), daemon=True) for r in range(job.pt.world)]
    for p in procs:
        p.start()
    what = f"the {job.role} launch of {job.pt.axis}={job.pt.value} ({','.join(job.names)})"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if recv.poll(0.5):
                status, payload = recv.recv()
                if status != "ok":
                    raise SystemExit(f"scaling.py: {what} failed; expected every rank to finish.\n{payload}")
                break
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise SystemExit(f"scaling.py: {what} ended without a result (exit codes "
                                 f"{[p.exitcode for p in procs]}, {timeout_s:.0f} s limit); expected rank 0's "
                                 "result. Fix: run that point alone (--axis) and read the ranks' output above.")
        for p in procs:
            p.join(timeout=60)
        return payload  # type: ignore[no-any-return]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def measure(pt: Point, names: list[str], mem_steps: int) -> dict[str, Any]:
    """One round of one point: the time launch, then a memory launch per variant."""
    t0 = time.perf_counter()
    timing = launch(Launch(pt, "time", tuple(names), pt.steps, pt.warmup))
    memory = {n: launch(Launch(pt, "memory", (n,), mem_steps, 1)) for n in names}
    med = {n: median(ts) for n, ts in timing["times_s"].items()}
    row: dict[str, Any] = {"axis": pt.axis, "value": pt.value, "world": pt.world, "cfg": asdict(pt.cfg),
                           "batch": pt.batch, "params": timing["params"], "step_s": med,
                           "cpu_s": {n: median(cs) for n, cs in timing["cpu_s"].items()},
                           "above_idle": {n: m["above_idle"] for n, m in memory.items()},
                           "peak": {n: m["peak"] for n, m in memory.items()},
                           "bytes": {n: sum(b.values()) for n, b in timing["bytes"].items()},
                           "bytes_by_kind": timing["bytes"], "first_loss": timing["first_loss"],
                           "times_s": timing["times_s"], "cpu_steps_s": timing["cpu_s"], "loadavg": loadavg(),
                           "wall_s": time.perf_counter() - t0}
    if "ours" in med and "torch" in med:
        row["paired"] = median([a / b for a, b in zip(timing["times_s"]["ours"], timing["times_s"]["torch"])])
    return row


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (axis, value): medians over rounds of each figure, and the per-round ours/torch ratios."""
    out: list[dict[str, Any]] = []
    for key in dict.fromkeys((r["axis"], r["value"]) for r in rows):
        rs = [r for r in rows if (r["axis"], r["value"]) == key]
        names = list(rs[0]["step_s"])
        s: dict[str, Any] = {"axis": key[0], "value": key[1], "world": rs[0]["world"], "params": rs[0]["params"],
                             "rounds": len(rs)}
        for fig in ("step_s", "cpu_s", "above_idle", "bytes"):
            s[fig] = {n: median([r[fig][n] for r in rs]) for n in names}
        s["time_ratios"] = [ratio(r["step_s"].get("ours"), r["step_s"].get("torch")) for r in rs]
        s["cpu_ratios"] = [ratio(r["cpu_s"].get("ours"), r["cpu_s"].get("torch")) for r in rs]
        s["paired"] = [r.get("paired") for r in rs]
        s["mem_ratios"] = [ratio(r["above_idle"].get("ours"), r["above_idle"].get("torch")) for r in rs]
        s["bytes_ratio"] = ratio(s["bytes"].get("ours"), s["bytes"].get("torch"))
        s["loss_gap"] = max(abs(v - r["first_loss"][names[0]]) for r in rs for v in r["first_loss"].values())
        out.append(s)
    return out


def span(xs: list[float | None]) -> str:
    vals = [x for x in xs if x is not None]
    if not vals:
        return "-"
    return f"{min(vals):.2f}" if len(vals) == 1 or min(vals) == max(vals) else f"{min(vals):.2f}-{max(vals):.2f}"


def table(summary: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for axis in dict.fromkeys(s["axis"] for s in summary):
        ss = [s for s in summary if s["axis"] == axis]
        names = list(ss[0]["step_s"])

        def cols(fig: str, scale: float, spec: str, s: dict[str, Any], names: list[str] = names) -> str:
            return "/".join(fmt(s[fig][n] / scale if n in s[fig] else None, spec) for n in names)

        lines.append(f"\naxis {axis} ({'/'.join(names)}; medians over rounds; ratios ours/torch, the range over "
                     "rounds)")
        head = f"{axis:>6}{'params':>8}{'wall ms':>22}{'wall':>11}{'paired':>11}{'CPU ms, all ranks':>22}" \
               f"{'CPU':>11}{'above idle MiB':>22}{'mem':>11}{'MiB/step':>22}{'bytes':>7}"
        lines.append(header(head))
        for s in ss:
            lines.append(f"{s['value']:>6}{s['params'] / 1e6:>7.2f}M{cols('step_s', 1e-3, '.1f', s):>22}"
                         f"{span(s['time_ratios']):>11}{span(s['paired']):>11}{cols('cpu_s', 1e-3, '.0f', s):>22}"
                         f"{span(s['cpu_ratios']):>11}{cols('above_idle', MIB, '.1f', s):>22}"
                         f"{span(s['mem_ratios']):>11}{cols('bytes', MIB, '.2f', s):>22}"
                         f"{fmt(s['bytes_ratio'], '.3f'):>7}")
    return lines


def plot(summary: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One figure per axis: step time, memory above idle, bytes per step, and the ours/torch ratios."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable (pip install -e '.[tools]'): no plots written")
        return []
    written = []
    for axis in dict.fromkeys(s["axis"] for s in summary):
        ss = [s for s in summary if s["axis"] == axis]
        if len(ss) < 2:
            continue
        xs = [s["value"] for s in ss]
        names = list(ss[0]["step_s"])
        fig, axes = plt.subplots(1, 4, figsize=(17, 4))
        for ax, fig_key, scale, title in ((axes[0], "step_s", 1e-3, "step ms: wall (-), CPU of all ranks (--)"),
                                          (axes[1], "above_idle", MIB, "peak RSS above idle (MiB, max rank)"),
                                          (axes[2], "bytes", MIB, "collective bytes per step (MiB/rank)")):
            for i, n in enumerate(names):
                ax.plot(xs, [s[fig_key][n] / scale for s in ss], marker="o", label=n, color=f"C{i}")
                if fig_key == "step_s":
                    ax.plot(xs, [s["cpu_s"][n] / scale for s in ss], marker=".", ls="--", color=f"C{i}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(axis)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.legend(fontsize=8)
        ax = axes[3]
        for key, label in (("time_ratios", "wall time"), ("cpu_ratios", "CPU time (all ranks)"),
                           ("mem_ratios", "memory above idle")):
            ax.plot(xs, [median([v for v in s[key] if v is not None]) for s in ss], marker="o", label=label)
        ax.plot(xs, [s["bytes_ratio"] for s in ss], marker="o", label="bytes")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_title("ours / torch fully_shard", fontsize=10)
        ax.set_xlabel(axis)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"scaling_{axis}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    args = parse_args()
    axes = AXES if args.axis == "all" else tuple(a.strip() for a in args.axis.split(","))
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    for n in names:
        if n not in DEFAULT_VARIANTS:
            raise SystemExit(f"scaling.py: unknown variant {n!r}; expected some of {', '.join(DEFAULT_VARIANTS)}")
    points = [pt for a in axes for pt in axis_points(a, args.quick)]
    if args.values:
        points = [pt for pt in points if str(pt.value) in args.values.split(",")]
    rounds = 1 if args.quick else args.rounds
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    suffix = "_quick" if args.quick else ""
    partial = args.output_dir / f"scaling{suffix}.json"  # rewritten after each point; the summary at the end
    t0 = time.perf_counter()
    for rnd in range(rounds):
        for pt in points:
            row = measure(pt, names, args.mem_steps)
            row["round"] = rnd
            rows.append(row)
            partial.write_text(json.dumps({"rows": rows, "machine": machine(), "partial": True}))
            ratio_s = fmt(ratio(row["step_s"].get("ours"), row["step_s"].get("torch")), ".3f")
            print(f"round {rnd + 1}/{rounds} {pt.axis}={pt.value}: ours/torch time {ratio_s}, "
                  f"{row['wall_s']:.0f} s, load {row['loadavg']}", flush=True)
    summary = summarize(rows)
    lines = [f"scaling benchmark: example GPT (each block a unit + the root), fp32, AdamW, gloo, 1 thread per rank; "
             f"{rounds} round(s), {time.perf_counter() - t0:.0f} s",
             f"machine: {machine()}; load average at each point: {', '.join(r['loadavg'] for r in rows)}",
             "units: d=64, heads 4, seq 32, vocab 512, batch 2/rank, 2 ranks; width: 4 blocks, seq 32, vocab 1024, "
             "batch 2/rank, 2 ranks; world: 8 blocks, d=128, seq 32, vocab 1024, batch 2/rank "
             f"(this machine has {os.cpu_count()} cores: 4 and 8 ranks share them)",
             *table(summary),
             f"\nfirst-step loss spread across variants (same init, same batch), max over points: "
             f"{max(s['loss_gap'] for s in summary):.2e}"]
    text = "\n".join(lines)
    print(text)
    (args.output_dir / f"scaling{suffix}.txt").write_text(text + "\n")
    (args.output_dir / f"scaling{suffix}.json").write_text(json.dumps({"summary": summary, "rows": rows,
                                                                       "machine": machine()}, indent=1))
    if not args.no_plots and not args.quick:
        for path in plot(summary, args.output_dir):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
