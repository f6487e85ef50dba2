"""Communication benchmark: bytes per step vs the theoretical minimum per strategy; bandwidth vs raw.

    python benchmarks/traffic.py              # launches 2 ranks itself
    torchrun --nproc_per_node 2 benchmarks/traffic.py --steps 5

Bytes: the same GPT (6 blocks, d=256) trains under FULL_SHARD (reshard after forward), SHARD_GRAD_OP
(keep gathered params until backward) and DDP; ``fully_shard.profile`` counts the all-gather and
reduce-scatter bytes per step (DDP's all-reduce bytes come from a comm hook). The minimum is what the
strategy has to move for this model without padding: FULL_SHARD gathers every unit in forward and every
non-root unit again in backward and reduce-scatters every gradient (3P minus the root's share),
SHARD_GRAD_OP gathers and reduce-scatters once (2P), DDP all-reduces once (P). "wire/rank" is what one
rank sends for that with ring algorithms: (W-1)/W of an all-gather/reduce-scatter buffer, 2(W-1)/W of an
all-reduce buffer.

Quantized all-gather: the FULL_SHARD bytes with bf16 parameters (fp32 reduce), and the same with
``QuantizedAllGather(block_size=256)`` (int8 blocks + float32 scales, dequantized into bf16).

Bandwidth: for each unit size, a raw ``all_gather_into_tensor`` of the same size (this transport's
physical limit here) vs this library's unshard (copy-in + all-gather + copy-out, nothing else running)
and vs the all-gathers inside training steps (issue -> done, while compute competes for the cores).

Per mesh axis (``--hsdp``; 4 ranks by default, taken as 2 'nodes' of ``--ranks-per-node 2``):

    python benchmarks/traffic.py --hsdp

bytes per optimizer step on each process group, counted at the dispatcher for every c10d collective the
steps issue (and checked against the profiler's totals), for HSDP on the (nodes, ranks per node) mesh
("replicate", "shard"): one batch per step; ``--accum`` micro-batches with ``set_requires_all_reduce(False)``
on all but the last; the same with the all-reduce every micro-batch; with ``set_requires_gradient_sync(False)``
on all but the last; and FSDP on a 1-D mesh over all ranks. A group is inter-node when its ranks are on
more than one node (torchrun numbers each node's ranks consecutively).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    GPT,
    AxisBytes,
    GPTConfig,
    header,
    init,
    launch_if_needed,
    loss_fn,
    machine,
    rank0_print,
    synthetic_batch,
    timed_step,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fully_shard import MixedPrecisionPolicy, QuantizedAllGather, fully_shard, profile

MIB = 2**20
CPU = torch.device("cpu")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default 2; 4 with --hsdp)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hsdp", action="store_true", help="only the bytes per mesh axis (HSDP across 'nodes')")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="--hsdp: the shard group's size")
    ap.add_argument("--accum", type=int, default=4, help="--hsdp: micro-batches per optimizer step")
    ap.add_argument("--iters", type=int, default=15, help="timed collectives per bandwidth measurement")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def train(model: torch.nn.Module, cfg: GPTConfig, steps: int, batch: int, prof: Any = None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(steps):
        x, y = synthetic_batch(cfg, batch, i, dist.get_rank())
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if prof is not None:
            prof.step()


def fsdp_bytes(base: GPT, cfg: GPTConfig, raf: bool, args: argparse.Namespace, *, steps: int | None = None,
               **kwargs: Any) -> tuple[dict[str, Any], Any]:
    """Bytes per step under ``fully_shard(..., reshard_after_forward=raf, **kwargs)`` (profiler counts)."""
    model = copy.deepcopy(base)
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=raf, **kwargs)
    fully_shard(model, **kwargs)
    train(model, cfg, 1, args.batch)
    with profile(model) as prof:
        train(model, cfg, steps or args.steps, args.batch, prof)
    s = prof.summary()
    return {"all_gather": s["all_gather_bytes"], "reduce_scatter": s["reduce_scatter_bytes"], "all_reduce": 0.0}, \
        (model, prof)


def ddp_bytes(base: GPT, cfg: GPTConfig, args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(copy.deepcopy(base))
    counted: list[int] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the runtime annotations
        buf = bucket.buffer()
        counted.append(buf.numel() * buf.element_size())
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    train(model, cfg, 1, args.batch)
    counted.clear()
    train(model, cfg, args.steps, args.batch)
    return {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": sum(counted) / args.steps}


def timed(fn: Any, iters: int) -> float:
    for _ in range(3):
        fn()
    return statistics.median(timed_step(fn, CPU) for _ in range(iters))


def bandwidth(model: Any, prof: Any, reference: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per unit (root, first block): raw all-gather vs our unshard (and torch's fully_shard unshard of
    the same unit), and the in-step all-gathers."""
    world = dist.get_world_size()
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows = []
    for name, unit, ref in (("<root>", model, reference), ("blocks.0", model.blocks[0], reference.blocks[0])):
        group = unit._fsdp.group
        nbytes = group.unsharded_nbytes
        numel = group.flat.total_numel
        out = torch.empty(numel)
        inp = torch.ones(numel // world)
        raw = timed(lambda out=out, inp=inp: ag(out, inp), args.iters)
        rs_out = torch.empty(numel // world)
        rs_in = torch.ones(numel)
        raw_rs = timed(lambda o=rs_out, i=rs_in: rs(o, i), args.iters)

        def unshard(unit: Any = unit) -> None:
            unit.unshard()
            unit.reshard()

        ours = timed(unshard, args.iters)
        theirs = timed(lambda ref=ref: (ref.unshard(), ref.reshard()), args.iters)
        key = "" if name == "<root>" else name
        in_step = [c.nbytes / c.time_s for st in prof.steps for c in st.collectives
                   if c.unit == key and c.kind == "all_gather" and c.time_s > 0]
        in_step_rs = [c.nbytes / c.time_s for st in prof.steps for c in st.collectives
                      if c.unit == key and c.kind == "reduce_scatter" and c.time_s > 0]
        rows.append({"unit": name, "bytes": nbytes, "raw_ag_s": raw, "ours_unshard_s": ours,
                     "raw_ag_bw": nbytes / raw, "ours_unshard_bw": nbytes / ours, "torch_unshard_bw": nbytes / theirs,
                     "in_step_ag_bw": statistics.median(in_step) if in_step else 0.0,
                     "raw_rs_bw": nbytes / raw_rs,
                     "in_step_rs_bw": statistics.median(in_step_rs) if in_step_rs else 0.0})
    return rows


def accumulate_step(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: GPTConfig, batch: int, step: int,
                    accum: int, skip: str) -> None:
    """One optimizer step of ``accum`` micro-batches; ``skip`` = "all_reduce" / "gradient_sync": that sync is
    off on all but the last micro-batch ("" keeps every collective)."""
    for micro in range(accum):
        last = micro == accum - 1
        if skip == "all_reduce":
            model.set_requires_all_reduce(last)  # type: ignore[operator]
        elif skip == "gradient_sync":
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
        x, y = synthetic_batch(cfg, batch, step * accum + micro, dist.get_rank())
        (loss_fn(model(x), y) / accum).backward()
    opt.step()
    opt.zero_grad()


def axis_bytes(base: GPT, cfg: GPTConfig, mesh: DeviceMesh, accum: int, skip: str,
               args: argparse.Namespace) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """Bytes per optimizer step by (process group, kind) at the dispatcher, and the profiler's per kind."""
    model = copy.deepcopy(base)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    accumulate_step(model, opt, cfg, args.batch, 0, accum, skip)  # warm-up (lazy init)
    with profile(model) as prof, AxisBytes() as counted:
        for step in range(1, args.steps + 1):
            accumulate_step(model, opt, cfg, args.batch, step, accum, skip)
            prof.step()
    per_group: dict[tuple[str, str], float] = {}
    for kind, group, nbytes in counted.records:
        per_group[(group, kind)] = per_group.get((group, kind), 0.0) + nbytes / args.steps
    s = prof.summary()
    return per_group, {k: s[f"{k}_bytes"] for k in ("all_gather", "reduce_scatter", "all_reduce")}


def hsdp_axes(args: argparse.Namespace) -> None:
    """Bytes per optimizer step on the intra-node (shard) and inter-node (replicate) axes."""
    world, per_node = dist.get_world_size(), args.ranks_per_node
    if per_node < 1 or world % per_node or world == per_node:
        raise SystemExit(f"--hsdp: expected --ranks-per-node to divide --nproc into 2 or more nodes, found "
                         f"{per_node} ranks per node of {world}. Fix: e.g. --nproc 4 --ranks-per-node 2.")
    nodes = world // per_node
    cfg = GPTConfig(vocab=2048, dim=256, blocks=6, heads=8, seq=128)
    torch.manual_seed(0)
    base = GPT(cfg)
    p_all = sum(p.numel() * p.element_size() for p in base.parameters())
    hsdp = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    k = args.accum
    variants = [("HSDP, 1 batch/step", hsdp, 1, ""),
                (f"HSDP, {k} micro, set_requires_all_reduce(False)", hsdp, k, "all_reduce"),
                (f"HSDP, {k} micro, all-reduce each", hsdp, k, ""),
                (f"HSDP, {k} micro, set_requires_gradient_sync(False)", hsdp, k, "gradient_sync"),
                (f"FSDP 1-D over {world}, 1 batch/step", flat, 1, "")]
    names: dict[str, list[int]] = {}
    for mesh in (hsdp, flat):
        for dim in mesh.mesh_dim_names or ():
            group = mesh.get_group(dim)
            names[group.group_name] = dist.get_process_group_ranks(group)
    rows = []
    for label, mesh, accum, skip in variants:
        per_group, profiled = axis_bytes(base, cfg, mesh, accum, skip, args)
        for kind, expected in profiled.items():  # nothing issued behind the trace's back
            found = sum(v for (_, kd), v in per_group.items() if kd == kind)
            if abs(found - expected) > 0.5:
                raise SystemExit(f"{label}: the dispatcher counted {found:.0f} {kind} bytes per step, the "
                                 f"profiler {expected:.0f}; expected equal. Fix: count every collective in both.")
        for group in sorted({g for g, _ in per_group}, key=lambda g: (len(names.get(g, ())), names.get(g, []))):
            ranks = names.get(group, [])
            n = len(ranks)
            inter = len({r // per_node for r in ranks}) > 1
            ag, rs, ar = (per_group.get((group, kd), 0.0) for kd in ("all_gather", "reduce_scatter", "all_reduce"))
            wire = (n - 1) / n * (ag + rs) + 2 * (n - 1) / n * ar if n else 0.0
            rows.append({"variant": label, "accum": accum, "group_ranks": ranks,
                         "axis": "inter-node" if inter else "intra-node", "all_gather": ag, "reduce_scatter": rs,
                         "all_reduce": ar, "total": ag + rs + ar, "wire_per_rank": wire})
    rank0_print(f"\nbytes per optimizer step by mesh axis: GPT {p_all / 4 / 1e6:.1f}M params (P = {p_all / MIB:.2f} "
                f"MiB fp32), {world} ranks as {nodes} nodes x {per_node} (gloo, CPU); rank 0's groups; "
                f"load average {Path('/proc/loadavg').read_text().split()[:3]}")
    rank0_print(f"machine: {machine()}")
    head = f"{'variant':<48}{'group':>14}{'axis':>12}{'all-gather':>12}{'reduce-scat':>12}{'all-reduce':>12}" \
           f"{'total':>9}{'x P':>7}{'wire/rank':>11}"
    rank0_print(header(head, "   (MiB)"))
    for r in rows:
        rank0_print(f"{r['variant']:<48}{r['group_ranks']!s:>14}{r['axis']:>12}{r['all_gather'] / MIB:>12.2f}"
                    f"{r['reduce_scatter'] / MIB:>12.2f}{r['all_reduce'] / MIB:>12.2f}{r['total'] / MIB:>9.2f}"
                    f"{r['total'] / p_all:>7.3f}{r['wire_per_rank'] / MIB:>11.2f}")
    rank0_print("wire/rank: what this rank sends with ring algorithms, (n-1)/n of an all-gather/reduce-scatter "
                "buffer and 2(n-1)/n of an all-reduce buffer, n = the group's ranks")
    if args.json is not None and dist.get_rank() == 0:
        args.json.write_text(json.dumps({"axes": rows, "model_bytes": p_all, "nodes": nodes, "ranks_per_node":
                                         per_node, "machine": machine()}, indent=1))


def main() -> None:
    args = parse_args()
    launch_if_needed(__file__, args.nproc or (4 if args.hsdp else 2))
    init("gloo")
    if args.hsdp:
        hsdp_axes(args)
        dist.destroy_process_group()
        return
    world = dist.get_world_size()
    cfg = GPTConfig(vocab=2048, dim=256, blocks=6, heads=8, seq=128)
    torch.manual_seed(0)
    base = GPT(cfg)
    p_all = sum(p.numel() * p.element_size() for p in base.parameters())
    p_blocks = sum(p.numel() * p.element_size() for p in base.blocks.parameters())
    measured: dict[str, dict[str, Any]] = {}
    minimum = {
        "FULL_SHARD": {"all_gather": p_all + p_blocks, "reduce_scatter": p_all, "all_reduce": 0},
        "SHARD_GRAD_OP": {"all_gather": p_all, "reduce_scatter": p_all, "all_reduce": 0},
        "DDP": {"all_gather": 0, "reduce_scatter": 0, "all_reduce": p_all},
    }
    measured["FULL_SHARD"], (model, prof) = fsdp_bytes(base, cfg, True, args)
    measured["SHARD_GRAD_OP"], _ = fsdp_bytes(base, cfg, False, args)
    measured["DDP"] = ddp_bytes(base, cfg, args)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    quantized = {name: fsdp_bytes(base, cfg, True, args, steps=1, mp_policy=bf16, **extra)[0]
                 for name, extra in (("bf16", {}), ("int8", {"all_gather_policy": QuantizedAllGather()}))}
    reference = copy.deepcopy(base)
    for blk in reference.blocks:
        torch_fully_shard(blk)
    torch_fully_shard(reference)
    train(reference, cfg, 1, args.batch)
    bw = bandwidth(model, prof, reference, args)

    frac = (world - 1) / world
    rank0_print(f"\ncomm benchmark: GPT {p_all / 4 / 1e6:.1f}M params (P = {p_all / MIB:.1f} MiB fp32; root unit "
                f"{(p_all - p_blocks) / MIB:.1f} MiB, 6 blocks), {world} ranks on CPU (gloo), per step")
    rank0_print(f"machine: {machine()}")
    head = f"{'strategy':<14}{'all-gather':>12}{'reduce-scat':>12}{'all-reduce':>12}{'total':>10}{'x P':>7}" \
           f"{'minimum':>10}{'vs min':>8}{'wire/rank':>11}"
    rank0_print(header(head, "   (MiB)"))
    rows = {}
    for name, m in measured.items():
        total = m["all_gather"] + m["reduce_scatter"] + m["all_reduce"]
        low = sum(minimum[name].values())
        wire = frac * (m["all_gather"] + m["reduce_scatter"]) + 2 * frac * m["all_reduce"]
        rows[name] = {**m, "total": total, "minimum": low, "wire_per_rank": wire}
        rank0_print(f"{name:<14}{m['all_gather'] / MIB:>12.2f}{m['reduce_scatter'] / MIB:>12.2f}"
                    f"{m['all_reduce'] / MIB:>12.2f}{total / MIB:>10.2f}{total / p_all:>7.2f}{low / MIB:>10.2f}"
                    f"{total / low:>8.3f}{wire / MIB:>11.2f}")
    rank0_print("\nquantized all-gather (FULL_SHARD, bf16 params, fp32 reduce; QuantizedAllGather(block_size=256))")
    rank0_print(header(f"{'all-gather':<14}{'all-gather':>12}{'reduce-scat':>12}{'vs bf16 AG':>12}", "   (MiB)"))
    for name, m in quantized.items():
        rank0_print(f"{name:<14}{m['all_gather'] / MIB:>12.2f}{m['reduce_scatter'] / MIB:>12.2f}"
                    f"{m['all_gather'] / quantized['bf16']['all_gather']:>12.4f}")
    rank0_print("\nall-gather bandwidth (MiB/s, algorithm bandwidth = gathered bytes / time)")
    head = f"{'unit':<10}{'MiB':>7}{'raw AG':>10}{'ours unshard':>14}{'/raw':>7}{'torch unshard':>15}{'/raw':>7}" \
           f"{'in-step AG':>12}{'raw RS':>10}{'in-step RS':>12}"
    rank0_print(header(head))
    for r in bw:
        rank0_print(f"{r['unit']:<10}{r['bytes'] / MIB:>7.2f}{r['raw_ag_bw'] / MIB:>10.0f}"
                    f"{r['ours_unshard_bw'] / MIB:>14.0f}"
                    f"{r['ours_unshard_bw'] / r['raw_ag_bw']:>7.2f}{r['torch_unshard_bw'] / MIB:>15.0f}"
                    f"{r['torch_unshard_bw'] / r['raw_ag_bw']:>7.2f}{r['in_step_ag_bw'] / MIB:>12.0f}"
                    f"{r['raw_rs_bw'] / MIB:>10.0f}{r['in_step_rs_bw'] / MIB:>12.0f}")
    rank0_print("ours/torch unshard = module.unshard() + reshard() of the unit (copy-in + all-gather + copy-out into "
                "freshly allocated params) with nothing else running; in-step = issue -> done inside training steps "
                "(the collective shares the cores with compute)")
    if args.json is not None and dist.get_rank() == 0:
        args.json.write_text(json.dumps({"bytes": rows, "quantized": quantized, "bandwidth": bw,
                                         "machine": machine()}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
