"""Parts 1-2 of the GPU check: world 8 on the fake process group, memory and allocator ours vs torch, the sanitizer.

Part ``memory``: this library's and torch's ``fully_shard`` on the same bf16 GPT at world 8 simulated in
one process (torch's ``"fake"`` backend: collectives do not communicate; buffers, streams, events and the
memory of rank 0's layout are real), variants FSDP, HSDP (2, 4), ``reshard_after_forward=2`` and
``CPUOffloadPolicy()``: peak allocated memory per step, memory after backward, the caching allocator's
``num_alloc_retries`` and reserved vs allocated, losses (on every step where this torch's fake backend
writes the collectives' outputs, else the first), and a profiler trace (copy-in off the compute stream).
Part ``csan``: the same variants of this library under ``TORCH_CUDA_SANITIZER=1`` (torch's FSDP variant as
a control); on the CPU dry run the CUDA branch on the stream stand-in instead.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory
from models.gpt import GPT, loss_fn, synthetic_batch
from tests.gpu.common import MIB, VARIANTS, device_of, error_text, log, mb, mesh_for, shard, sizes, sync, write_json
from tests.gpu.report import Report

CSAN_MARKER = "CSAN detected a possible data race"
STANDIN_MARKER = "stream stand-in violation"  # the CPU dry run's stand-in for CSAN


def allocator_stats(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's counters that matter here (None off CUDA)."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {"num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "reserved_peak": int(stats.get("reserved_bytes.all.peak", 0)),
            "allocated_peak": int(stats.get("allocated_bytes.all.peak", 0))}


def run_variant(base: GPT, lib: str, variant: str, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                steps: int, trace_streams: bool) -> dict[str, Any]:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    retries0 = (allocator_stats(device) or {}).get("num_alloc_retries", 0)
    model = copy.deepcopy(base).to(device)
    shard(model, lib, mesh_for(variant, device.type, 8), 2 if variant == "reshard_2" else True,
          variant == "cpu_offload", cuda)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rec: dict[str, Any] = {"losses": [], "peak": [], "after_backward": [], "before_step": [], "step_s": []}
    for i in range(1 + steps):  # step 0 is the warm-up (lazy init, optimizer states)
        gc.collect()
        sync(device)
        if i:
            rec["before_step"].append(current_memory(device))
            reset_peak_memory(device)
        t = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        sync(device)
        if i:
            rec["after_backward"].append(current_memory(device))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i:
            rec["peak"].append(peak_memory(device))
            rec["step_s"].append(time.perf_counter() - t)
        rec["losses"].append(float(loss.detach()))
    stats = allocator_stats(device)
    if stats is not None:
        stats["num_alloc_retries"] -= retries0
        rec["allocator"] = stats
    if trace_streams:
        try:
            rec["streams"] = stream_trace(model, opt, x, y)
        except Exception as e:
            rec["streams"] = {"error": error_text(e), "traceback": traceback.format_exc()[-2000:]}
    del model, opt, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def run_under_stand_in(base: GPT, variant: str, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, Any]:
    """CPU dry run of part csan: CSAN needs CUDA, so the CUDA branch runs on the stream stand-in
    (tests/distributed/stream_standin.py: simulated streams and allocator reuse; it logs every race)."""
    from fully_shard.comm import streams
    from tests.distributed.stream_standin import StreamStandIn

    with StreamStandIn() as sim, streams.stand_in(sim):
        model = copy.deepcopy(base)
        shard(model, "ours", mesh_for(variant, "cpu", 8), 2 if variant == "reshard_2" else True,
              variant == "cpu_offload", False)
        if variant == "cpu_offload":
            sim.mark_host(list(model.parameters()))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses = []
        for _ in range(1 + steps):
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        del model, opt, loss
        gc.collect()
    for v in sim.violations:
        print(f"{STANDIN_MARKER}: {v}", file=sys.stderr, flush=True)
    return {"losses": losses, "stand_in_violations": len(sim.violations), "stand_in_waits": len(sim.log)}


def stream_trace(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One step under torch.profiler: which streams the kernels ran on (GEMMs = the compute stream)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return analyze_kernels(events)


def analyze_kernels(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Kernels per stream in a chrome trace: the GEMM (compute) streams, the rest, and their overlap."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e and "stream" in e.get("args", {})]

    def is_gemm(name: str) -> bool:
        n = name.lower()
        return any(s in n for s in ("gemm", "sm90", "cutlass", "nvjet", "flash", "fmha"))

    gemm_streams = sorted({k["args"]["stream"] for k in kernels if is_gemm(k["name"])})
    if not gemm_streams and kernels:  # unknown GEMM kernel names: the busiest stream runs the model
        busy: dict[int, float] = {}
        for k in kernels:
            busy[k["args"]["stream"]] = busy.get(k["args"]["stream"], 0.0) + float(k["dur"])
        gemm_streams = [max(busy, key=lambda st: busy[st])]
    side = [k for k in kernels if k["args"]["stream"] not in gemm_streams]
    compute = sorted((float(k["ts"]), float(k["ts"]) + float(k["dur"]))
                     for k in kernels if k["args"]["stream"] in gemm_streams)
    overlap = 0.0
    for k in side:
        s, e = float(k["ts"]), float(k["ts"]) + float(k["dur"])
        overlap += sum(max(0.0, min(e, ce) - max(s, cs)) for cs, ce in compute)
    names: dict[str, int] = {}
    for k in side:
        names[k["name"][:80]] = names.get(k["name"][:80], 0) + 1
    return {"kernels": len(kernels), "gemm_streams": gemm_streams,
            "side_streams": sorted({k["args"]["stream"] for k in side}), "side_kernels": len(side),
            "side_cat_kernels": sum("cat" in k["name"].lower() for k in side),
            "side_us": sum(float(k["dur"]) for k in side), "overlap_us": overlap,
            "side_kernel_names": dict(sorted(names.items(), key=lambda kv: -kv[1])[:8])}


def fake_backend_writes(device: torch.device) -> dict[str, bool]:
    """Whether this torch's fake backend writes the all-gather's and the reduce-scatter's outputs (the
    reduce-scatter family only since pytorch #182365): only then do losses after the first step mean
    anything."""
    gathered = torch.full((16,), -1.0, device=device)
    dist.all_gather_into_tensor(gathered, torch.ones(2, device=device))
    reduced = torch.full((2,), -1.0, device=device)
    dist.reduce_scatter_tensor(reduced, torch.ones(16, device=device))
    return {"all_gather": bool((gathered != -1).all()), "reduce_scatter": bool((reduced != -1).all())}


def run(args: argparse.Namespace, out: str, libs: tuple[str, ...], variants: tuple[str, ...], steps: int,
        csan: bool) -> None:
    """Child of part ``memory`` (``csan`` False) or ``csan``: every (variant, lib) into ``out``'s JSON."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    t0 = time.perf_counter()
    device = device_of(args)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    s = sizes(args)
    cfg = s.csan_cfg if csan else s.mem_cfg
    torch.manual_seed(0)
    base = GPT(cfg)
    x, y = synthetic_batch(cfg, s.mem_batch, 0, 0, device=device)
    writes = fake_backend_writes(device)
    res: dict[str, Any] = {"params": sum(p.numel() for p in base.parameters()), "cfg": cfg.__dict__,
                           "batch": s.mem_batch, "csan": csan, "variants": {}, "fake_writes": writes,
                           "fake_gather_fills": writes["all_gather"]}
    for variant in variants:
        for lib in libs:
            print(f"=== {lib}/{variant} ===", file=sys.stderr, flush=True)
            log(f"{lib}/{variant}", t0)
            try:
                if csan and device.type == "cpu" and lib == "ours":
                    rec = run_under_stand_in(base, variant, x, y, steps)
                else:
                    rec = run_variant(base, lib, variant, x, y, device, steps,
                                      trace_streams=(not csan and lib == "ours" and variant == "fsdp"
                                                     and device.type == "cuda"))
            except Exception as e:
                rec = {"error": error_text(e), "traceback": traceback.format_exc()[-3000:]}
                print(rec["traceback"], file=sys.stderr, flush=True)
            res["variants"].setdefault(variant, {})[lib] = rec
            write_json(out, res)
    res["elapsed_s"] = time.perf_counter() - t0
    write_json(out, res)
    dist.destroy_process_group()


def run_csan(args: argparse.Namespace, out: str) -> None:
    """Child of part csan: ours under the sanitizer, then torch's FSDP variant as the control."""
    run(args, out, ("ours",), VARIANTS, 1, csan=True)
    if args.cpu_dry_run:
        return
    data = json.loads(Path(out).read_text())
    run(args, out + ".torch", ("torch",), ("fsdp",), 1, csan=True)
    ctl = json.loads(Path(out + ".torch").read_text())
    data["variants"]["fsdp"]["torch"] = ctl["variants"]["fsdp"]["torch"]
    write_json(out, data)


def report(rep: Report, data: dict[str, Any] | None, cuda: bool, cut: bool = False) -> None:
    rep.say("\n== Part memory: world 8 on the fake process group (rank 0's layout), memory per step ==")
    if data is None:
        return
    cfg = data["cfg"]
    what = "CUDA allocator" if cuda else "RSS (CPU dry run; not checked)"
    writes = data.get("fake_writes", {"all_gather": data.get("fake_gather_fills", True), "reduce_scatter": False})
    rep.say(f"GPT {data['params'] / 1e6:.1f}M params (d={cfg['dim']}, {cfg['blocks']} blocks, seq {cfg['seq']}, "
            f"vocab {cfg['vocab']}), batch {data['batch']}, bf16 params / fp32 reduce; memory: {what}, MiB; "
            f"the fake backend writes the all-gather's output: {writes['all_gather']}, the reduce-scatter's: "
            f"{writes['reduce_scatter']}")
    rep.say(f"{'variant':<12}{'ours peak':>10}{'torch peak':>11}{'ratio':>7}{'ours aft.bwd':>13}"
            f"{'torch aft.bwd':>14}{'ours loss':>11}{'torch loss':>11}")
    skip = None if cuda else "skipped: no CUDA"
    part = "memory"
    for variant, libs in data["variants"].items():
        o, t = libs.get("ours", {}), libs.get("torch", {})
        for lib, rec in (("ours", o), ("torch", t)):
            if "error" in rec:
                rep.check(part, f"{variant}: {lib} runs", False, rec["error"])
        if not o or not t:
            rep.missing(part, f"{variant}: ours and torch run", "not run", cut=cut)
            continue
        if "error" in o or "error" in t:
            continue
        op, tp = max(o["peak"]), max(t["peak"])
        oa, ta = max(o["after_backward"]), max(t["after_backward"])
        rep.say(f"{variant:<12}{mb(op):>10}{mb(tp):>11}{op / tp:>7.3f}{mb(oa):>13}{mb(ta):>14}"
                f"{o['losses'][0]:>11.4f}{t['losses'][0]:>11.4f}")
        rep.check(part, f"{variant}: peak ours <= torch x 1.02", op <= tp * 1.02,
                  f"{mb(op)} vs {mb(tp)} MiB ({op / tp:.3f})", skip=skip)
        slack = max(1 * MIB, 0.01 * ta)
        rep.check(part, f"{variant}: after backward ours <= torch + {mb(slack)} MiB", oa <= ta + slack,
                  f"{mb(oa)} vs {mb(ta)} MiB", skip=skip)
        # losses: every step where the backend writes both collectives' outputs, else the first only
        # (later steps then train on gradients the fake reduce-scatter never wrote: uninitialized memory)
        n = min(len(o["losses"]), len(t["losses"])) if writes["reduce_scatter"] else 1
        why = "" if writes["all_gather"] else (" (a warning only: this torch's fake all-gather leaves its output "
                                               "unwritten)")
        steps = f"{n} step{'s' if n > 1 else ''}" if writes["reduce_scatter"] else "the first step"
        finite = all(math.isfinite(v) for v in o["losses"][:n] + t["losses"][:n])
        rep.check(part, f"{variant}: losses finite ({steps}){why}", finite, warn=not writes["all_gather"],
                  detail=f"ours {[round(v, 4) for v in o['losses']]}, torch {[round(v, 4) for v in t['losses']]}")
        gap = max(abs(a - b) for a, b in zip(o["losses"][:n], t["losses"][:n]))
        rep.check(part, f"{variant}: losses equal torch's ({steps}){why}",
                  gap <= 1e-2 * max(1.0, abs(t["losses"][0])), warn=not writes["all_gather"],
                  detail=f"max |ours - torch| = {gap:.2e}")
        oal, tal = o.get("allocator"), t.get("allocator")
        if cuda and oal and tal:
            rep.say(f"{'':<12}allocator: retries ours {oal['num_alloc_retries']} torch {tal['num_alloc_retries']}; "
                    f"reserved/allocated peak ours {mb(oal['reserved_peak'])}/{mb(oal['allocated_peak'])} MiB "
                    f"({oal['reserved_peak'] / max(oal['allocated_peak'], 1):.3f}), torch "
                    f"{mb(tal['reserved_peak'])}/{mb(tal['allocated_peak'])} MiB "
                    f"({tal['reserved_peak'] / max(tal['allocated_peak'], 1):.3f})")
            rep.check(part, f"{variant}: num_alloc_retries ours <= torch's", oal["num_alloc_retries"] <= tal[
                "num_alloc_retries"], f"{oal['num_alloc_retries']} vs {tal['num_alloc_retries']}", warn=True)
            rep.check(part, f"{variant}: reserved peak ours <= torch x 1.05",
                      oal["reserved_peak"] <= 1.05 * tal["reserved_peak"],
                      f"{mb(oal['reserved_peak'])} vs {mb(tal['reserved_peak'])} MiB", warn=True)
        else:
            rep.check(part, f"{variant}: allocator retries and reserved vs allocated", None, "",
                      skip=skip or "no stats")
    streams = data["variants"].get("fsdp", {}).get("ours", {}).get("streams")
    name = "copy-in kernels off the compute stream (torch.profiler)"
    if not cuda:
        rep.check(part, name, None, "", skip="skipped: no CUDA")
    elif streams is None:
        rep.check(part, name, False, "no trace recorded")
    elif "error" in streams:
        rep.check(part, name, False, streams["error"])
    else:
        rep.say(f"streams (ours, FSDP, one step): {streams['kernels']} kernels; GEMM stream(s) "
                f"{streams['gemm_streams']}; {streams['side_kernels']} kernels on other streams "
                f"{streams['side_streams']} ({streams['side_cat_kernels']} cat), {streams['side_us']:.0f} us, "
                f"{streams['overlap_us']:.0f} us overlapping compute; names: {streams['side_kernel_names']}")
        rep.check(part, name, bool(streams["gemm_streams"]) and streams["side_kernels"] > 0,
                  f"{streams['side_kernels']} kernels ({streams['side_cat_kernels']} cat) on streams "
                  f"{streams['side_streams']}, GEMMs on {streams['gemm_streams']}")
        rep.check(part, "side-stream kernels overlap compute", streams["overlap_us"] > 0,
                  f"{streams['overlap_us']:.0f} of {streams['side_us']:.0f} us", warn=True)


def report_csan(rep: Report, data: dict[str, Any] | None, stderr: str, cuda: bool, cut: bool = False) -> None:
    if cuda:
        rep.say("\n== Part csan: this library under TORCH_CUDA_SANITIZER=1 (fake process group, world 8) ==")
    else:
        rep.say("\n== Part csan (CPU dry run): CSAN needs CUDA; this library's CUDA branch on the stream stand-in "
                "(fake process group, world 8) ==")
    marker, what = (CSAN_MARKER, "CSAN reports") if cuda else (STANDIN_MARKER, "stand-in violations")
    sections: dict[str, str] = {}
    current = ""
    for line in stderr.splitlines(keepends=True):
        if line.startswith("=== ") and line.rstrip().endswith(" ==="):
            current = line.strip()[4:-4]
            continue
        sections[current] = sections.get(current, "") + line
    first: str | None = None
    part = "csan"
    for key in [f"ours/{v}" for v in VARIANTS] + ["torch/fsdp"] * cuda:
        lib, variant = key.split("/")
        rec = (data or {}).get("variants", {}).get(variant, {}).get(lib)
        text = sections.get(key, "")
        if not cuda and rec is not None and "error" not in rec:  # the stand-in really ran the CUDA branch
            rep.check(part, f"{key}: the stand-in saw stream waits", rec.get("stand_in_waits", 0) > 0,
                      f"{rec.get('stand_in_waits')} waits logged")
        n = text.count(marker)
        err = None if rec is None else rec.get("error")
        status = "not run" if rec is None else (f"{len(rec['losses'])} steps" if err is None else err)
        rep.say(f"{key:<18} {what}: {n}; {status}")
        if n and first is None:
            i = text.index(marker)
            first = f"{key}:\n" + "\n".join(text[max(0, i - 200):].splitlines()[:60])
        if lib == "torch":
            continue  # the control: reported, not checked
        if rec is None:
            rep.missing(part, f"{key}: runs under {'the sanitizer' if cuda else 'the stand-in'}", "not run", cut=cut)
            continue
        rep.check(part, f"{key}: no {what}", n == 0, f"{n} report(s)")
        rep.check(part, f"{key}: runs under {'the sanitizer' if cuda else 'the stand-in'}",
                  err is None, status if err is None else f"{err} (a CSAN report raises CUDASanitizerErrors)")
    if not cuda:
        rep.check(part, "TORCH_CUDA_SANITIZER run", None, "", skip="skipped: no CUDA")
    if first:
        rep.say(f"first of the {what}:\n" + first)
