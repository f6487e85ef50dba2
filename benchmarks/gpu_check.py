"""GPU readiness check for the CUDA branch (streams, events, held buffers, CPU-offload copies): one command.

On the GPU machine (one GPU; no torchrun, every part starts its own process and process group)::

    python benchmarks/gpu_check.py

It writes ``benchmarks/results/gpu_check.txt`` and ``.json`` and exits non-zero with ``CHECK FAILED: ...``
when a check fails. Time budget: under 8 minutes on one H200 (``--budget-s``, default 450 s, caps the
parts; a part cut short by it fails). Each part runs in a child process with a timeout, so a hang or a
crash in one still leaves the others' figures in the result file. Parts:

1. **memory** -- world 8 simulated in one process on torch's ``"fake"`` process-group backend
   (collectives are no-ops; buffers, streams, events and memory of rank 0's layout are real): this
   library's and torch's ``fully_shard`` on the same bf16 GPT (``MixedPrecisionPolicy(bf16, fp32)``),
   variants FSDP, HSDP on a (2, 4) mesh, ``reshard_after_forward=2`` and ``CPUOffloadPolicy()``.
   Checks: peak ``torch.cuda.max_memory_allocated`` of a step after a warm-up step, ours <= torch's x 1.02;
   ``memory_allocated`` right after ``backward()`` ours <= torch's + slack (held buffers released at the
   end of backward); losses finite and equal to torch's on the first step (later steps train on
   gradients the fake reduce-scatter never wrote, so their losses are printed, not checked). Also (part 4 of the old
   script) a ``torch.profiler`` trace of one FSDP step: the all-gather copy-in runs on a stream other
   than the compute (GEMM) stream.
2. **csan** -- part 1's four variants of this library again, in a child with ``TORCH_CUDA_SANITIZER=1``:
   zero "CSAN detected a possible data race" reports (the first one is copied into the output).
   torch's ``fully_shard`` FSDP variant runs too, as a control (reported, not checked).
3. **step** -- world 1 on NCCL, a ~1B-parameter GPT (d=2048, 18 blocks, seq 2048, vocab 32000), each
   block ``torch.compile``d before ``fully_shard``, no activation checkpointing: step time of the plain
   model with bf16 parameters, this library and torch's ``fully_shard`` (bf16 compute, fp32 master
   weights and reductions), taking turns step by step after warm-up (compile excluded, measuring
   capped by ``--step-cap-s``). Reports ours/plain, ours/torch and MFU (6 x params x tokens / step time /
   989 TFLOP/s, H200 dense bf16). Checks: ours/plain <= 1.05 (a warning above 1.02), losses equal to
   torch's within bf16 noise. Then ``fully_shard.profile`` on this library's model: one all-gather per
   unit per forward, bytes, backward re-gathers, exposed <= time (the old script's checks).

``--cpu-dry-run`` runs the same parts on the CPU with tiny models; memory figures are RSS; every
CUDA-only check reports "skipped: no CUDA". CSAN cannot be enabled without CUDA, so the dry run's part 2
runs the CUDA branch on the library's stream stand-in instead (tests/distributed/stream_standin.py:
simulated streams and allocator reuse, every race logged) and checks it logged none. Without the
flag and without CUDA the script fails. ``--quick`` shrinks further (tests/tools/test_gpu_check.py runs
``--cpu-dry-run --quick``; tests/tools/test_gpu.py runs ``--quick`` on a GPU). It uses public torch APIs plus
``torch.testing._internal.distributed.fake_pg.FakeStore``; what the installed torch lacks is listed in
the output and the parts needing it are reported as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    from _common import GPT, ROOT, loss_fn, synthetic_batch

    from examples.train_gpt import GPTConfig
    from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory
except Exception as _e:  # the library or torch's FSDP may not import on this torch: say so, do not crash
    traceback.print_exc()
    print(f"CHECK FAILED: cannot import the library / the benchmark model with torch {torch.__version__}: "
          f"{type(_e).__name__}: {_e}", file=sys.stderr)
    raise SystemExit(1) from None

RESULTS = ROOT / "benchmarks" / "results"
H200_BF16_FLOPS = 989e12
VARIANTS = ("fsdp", "hsdp", "reshard_2", "cpu_offload")
CSAN_MARKER = "CSAN detected a possible data race"
STANDIN_MARKER = "stream stand-in violation"  # the CPU dry run's stand-in for CSAN
MIB = 2**20
CHILD: subprocess.Popen[bytes] | None = None  # the part running now (the orchestrator kills it on SIGTERM)


# --- configuration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    mem_cfg: GPTConfig
    mem_batch: int
    csan_cfg: GPTConfig  # the sanitizer's Python-level bookkeeping per op makes big steps slow
    step_cfg: GPTConfig
    step_batch: int
    step_warmup: int
    step_steps: int
    compile: bool


def sizes(args: argparse.Namespace) -> Sizes:
    if args.cpu_dry_run:
        tiny = GPTConfig(vocab=256, dim=64, blocks=2, heads=4, seq=32)
        return Sizes(tiny, 2, tiny, tiny, 2, 1, 1 if args.quick else 3, False)
    if args.quick:
        small = GPTConfig(vocab=4096, dim=256, blocks=4, heads=4, seq=256)
        return Sizes(small, 2, small, GPTConfig(vocab=8192, dim=512, blocks=4, heads=8, seq=512), 4, 2, 4, True)
    return Sizes(GPTConfig(vocab=32000, dim=1024, blocks=8, heads=16, seq=1024), 4,
                 GPTConfig(vocab=8192, dim=512, blocks=4, heads=8, seq=512),
                 GPTConfig(vocab=32000, dim=2048, blocks=18, heads=16, seq=2048), args.batch, 3, 10, True)


def missing_apis(cuda: bool) -> dict[str, str]:
    """What this torch lacks that a part needs: name -> what is not run without it."""
    missing: dict[str, str] = {}
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except Exception as e:
        missing["fake_pg.FakeStore"] = f"parts 1-2 (world 8 on the fake backend): {type(e).__name__}: {e}"
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: F401
    except Exception as e:
        missing["torch.distributed.fsdp.fully_shard/CPUOffloadPolicy"] = f"torch's side of parts 1 and 3: {e}"
    if cuda:
        if importlib.util.find_spec("torch.cuda._sanitizer") is None:
            missing["torch.cuda._sanitizer"] = "part 2 (TORCH_CUDA_SANITIZER)"
        if not dist.is_nccl_available():
            missing["NCCL"] = "part 3 (world 1 on NCCL)"
        if importlib.util.find_spec("triton") is None:
            missing["triton"] = "part 3's torch.compile (runs eager instead)"
    return missing


# --- shared helpers (children) ---------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


def shard(model: GPT, lib: str, mesh: Any, reshard: bool | int | None, offload: bool, cuda: bool) -> GPT:
    if lib == "ours":
        from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # type: ignore[no-redef]
    kw: dict[str, Any] = {"mesh": mesh,
                          "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if reshard is not None:  # None: each library's default (blocks reshard, the root keeps its parameters)
        kw["reshard_after_forward"] = reshard
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy() if cuda else CPUOffloadPolicy(pin_memory=False)
    for blk in model.blocks:
        fully_shard(blk, **kw)  # type: ignore[operator]
    fully_shard(model, **kw)  # type: ignore[operator]
    return model


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


# --- parts 1 and 2: world 8 on the fake process group ----------------------------------------------
def mesh_for(variant: str, device_type: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    if variant == "hsdp":
        return init_device_mesh(device_type, (2, 4), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (8,))


def run_memory_variant(base: GPT, lib: str, variant: str, x: torch.Tensor, y: torch.Tensor,
                       device: torch.device, steps: int, trace_streams: bool) -> dict[str, Any]:
    cuda = device.type == "cuda"
    model = copy.deepcopy(base).to(device)
    shard(model, lib, mesh_for(variant, device.type), 2 if variant == "reshard_2" else True,
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
    """CPU dry run of part 2: CSAN needs CUDA, so the CUDA branch runs on the library's stream stand-in
    (tests/distributed/stream_standin.py: simulated streams and allocator reuse; it logs every race)."""
    from fully_shard.comm import streams
    from tests.distributed.stream_standin import StreamStandIn

    with StreamStandIn() as sim, streams.stand_in(sim):
        model = copy.deepcopy(base)
        shard(model, "ours", mesh_for(variant, "cpu"), 2 if variant == "reshard_2" else True,
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


def part_memory(args: argparse.Namespace, out: str, libs: tuple[str, ...], variants: tuple[str, ...],
                steps: int, csan: bool) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    t0 = time.perf_counter()
    device = torch.device("cuda", 0) if not args.cpu_dry_run else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    s = sizes(args)
    cfg = s.csan_cfg if csan else s.mem_cfg
    torch.manual_seed(0)
    base = GPT(cfg)
    x, y = synthetic_batch(cfg, s.mem_batch, 0, 0, device=device)
    # does this torch's fake all-gather fill the output (with this rank's shard)? If not, gathered
    # parameters are uninitialized memory and the losses mean nothing
    probe = torch.full((16,), -1.0, device=device)
    dist.all_gather_into_tensor(probe, torch.ones(2, device=device))
    res: dict[str, Any] = {"params": sum(p.numel() for p in base.parameters()), "cfg": cfg.__dict__,
                           "batch": s.mem_batch, "csan": csan, "variants": {},
                           "fake_gather_fills": bool((probe == 1).all())}
    for variant in variants:
        for lib in libs:
            print(f"=== {lib}/{variant} ===", file=sys.stderr, flush=True)
            log(f"{lib}/{variant}", t0)
            try:
                if csan and device.type == "cpu" and lib == "ours":
                    rec = run_under_stand_in(base, variant, x, y, steps)
                else:
                    rec = run_memory_variant(base, lib, variant, x, y, device, steps,
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


# --- part 3: world 1, step time ----------------------------------------------------------------------
def part_step(args: argparse.Namespace, out: str) -> None:
    t0 = time.perf_counter()
    cuda = not args.cpu_dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    s = sizes(args)
    do_compile = s.compile and cuda and importlib.util.find_spec("triton") is not None
    res: dict[str, Any] = {"cfg": s.step_cfg.__dict__, "batch": s.step_batch, "compile": do_compile,
                           "variants": {}, "order": ["plain", "ours", "torch"]}
    torch.manual_seed(0)
    with torch.device(device):
        base = GPT(s.step_cfg)
    n_params = sum(p.numel() for p in base.parameters())
    res["params"] = n_params
    res["tokens_per_step"] = s.step_batch * s.step_cfg.seq
    x, y = synthetic_batch(s.step_cfg, s.step_batch, 0, 0, device=device)
    mesh = init_device_mesh(device.type, (1,))
    models: dict[str, tuple[GPT, torch.optim.Optimizer]] = {}
    for name in ("plain", "ours", "torch"):
        model = copy.deepcopy(base)
        if name == "plain":
            model = model.to(torch.bfloat16)
        if do_compile:
            for blk in model.blocks:
                blk.compile()
        if name != "plain":
            shard(model, name, mesh, None, False, cuda)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda))
        res["variants"][name] = {"losses": [], "step_s": [], "fwd_bwd_s": [], "opt_s": [], "compile_s": None}
    del base
    log(f"built {n_params / 1e6:.2f}M-parameter models (compile={do_compile})", t0)
    write_json(out, res)
    names = list(models)
    total = s.step_warmup + s.step_steps
    t_measure = None
    for i in range(total):
        if i == s.step_warmup:
            t_measure = time.perf_counter()
        if t_measure is not None and i >= s.step_warmup + 3 and time.perf_counter() - t_measure > args.step_cap_s:
            res["capped_after_steps"] = i - s.step_warmup
            break
        for name in names[i % len(names):] + names[:i % len(names)]:
            model, opt = models[name]
            rec = res["variants"][name]
            if "error" in rec:
                continue
            try:
                sync(device)
                t = time.perf_counter()
                loss = loss_fn(model(x), y)
                loss.backward()
                sync(device)
                t_bwd = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(device)
                t_end = time.perf_counter()
            except Exception as e:
                rec["error"] = error_text(e)
                rec["traceback"] = traceback.format_exc()[-3000:]
                print(rec["traceback"], file=sys.stderr, flush=True)
                continue
            rec["losses"].append(float(loss.detach()))
            if i == 0:
                rec["compile_s"] = t_end - t
            if i >= s.step_warmup:
                rec["step_s"].append(t_end - t)
                rec["fwd_bwd_s"].append(t_bwd - t)
                rec["opt_s"].append(t_end - t_bwd)
        if i == 0:
            log("first step of each (compile) done", t0)
        write_json(out, res)
    log("timing done", t0)
    if "error" not in res["variants"]["ours"]:
        model, opt = models["ours"]
        try:
            res["profile"] = profile_check(model, opt, x, y, device)
        except Exception as e:
            res["profile"] = {"problems": [f"profile run failed: {error_text(e)}"],
                              "traceback": traceback.format_exc()[-3000:]}
    res["elapsed_s"] = time.perf_counter() - t0
    res["max_memory_allocated"] = torch.cuda.max_memory_allocated(device) if cuda else None
    write_json(out, res)
    log("profile done", t0)
    dist.destroy_process_group()


def profile_check(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                  device: torch.device) -> dict[str, Any]:
    """fully_shard.profile over 3 steps; the problems found (empty: the numbers are consistent)."""
    from fully_shard import profile
    from fully_shard.core.state import get_state

    gathered = {}
    for m in model.modules():
        state = get_state(m)
        if state is not None and state.group is not None:
            gathered[state.group.fqn] = state.group.unsharded_nbytes
    problems: list[str] = []
    steps = 3
    with profile(model) as prof:
        for _ in range(steps):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    if len(prof.steps) != steps:
        problems.append(f"profiler recorded {len(prof.steps)} steps, expected {steps}")
    for st in prof.steps:
        if not st.step_s > 0:
            problems.append("step time not positive")
        if not st.peak_memory > 0:
            problems.append("peak memory not positive")
        for name, u in st.units.items():
            g = gathered.get(name)
            unit = name or "<root>"
            if u.all_gather_forward.count != 1 or u.all_gather_forward.bytes != g:
                problems.append(f"unit {unit}: forward all-gathers {u.all_gather_forward}, expected 1 x {g} bytes")
            regather = 1 if name else 0  # blocks reshard after forward; the root keeps its parameters
            if u.all_gather_backward.count != regather:
                problems.append(f"unit {unit}: {u.all_gather_backward.count} backward all-gathers, expected {regather}")
            if u.reduce_scatter.count != 1:
                problems.append(f"unit {unit}: {u.reduce_scatter.count} reduce-scatters, expected 1")
        for c in st.collectives:
            if c.t_done < c.t_issue:
                problems.append(f"{c.kind} {c.unit}: done before issued")
            if not (c.t_issue >= st.t_start - 1e-3 and c.t_done <= st.t_end + 1e-3):
                problems.append(f"{c.kind} {c.unit}: times outside the step")
            if not 0.0 <= c.exposed_s <= c.time_s + 1e-6:
                problems.append(f"{c.kind} {c.unit}: exposed {c.exposed_s} > time {c.time_s}")
    summ = prof.summary()
    if abs(summ["bytes_over_model"] - summ["expected_bytes_over_model"]) >= 0.05:
        problems.append(f"bytes/step {summ['bytes_over_model']:.3f}x the model, expected "
                        f"{summ['expected_bytes_over_model']:.3f}x")
    keep = ("step_s", "exposed_comm_s", "comm_share", "comm_busy_share", "bytes_over_model",
            "expected_bytes_over_model", "peak_memory")
    return {"problems": sorted(set(problems))[:20], "summary": {k: summ.get(k) for k in keep},
            "table": prof.table(), "device": str(device)}


# --- the orchestrator ------------------------------------------------------------------------------
@dataclass
class Check:
    part: str
    name: str
    status: str  # PASS, FAIL, WARN, SKIP
    detail: str


class Report:
    def __init__(self) -> None:
        self.checks: list[Check] = []
        self.lines: list[str] = []

    def check(self, part: str, name: str, ok: bool | None, detail: str, *, warn: bool = False,
              skip: str | None = None) -> None:
        if skip is not None:
            status = "SKIP"
            detail = f"{skip}; {detail}" if detail else skip
        elif ok:
            status = "PASS"
        else:
            status = "WARN" if warn else "FAIL"
        self.checks.append(Check(part, name, status, detail))

    def say(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]


def run_child(part: str, args: argparse.Namespace, timeout: float, workdir: Path,
              env_extra: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, str, str, str | None]:
    """Run ``--part part`` in a child; (its JSON or None, stdout, stderr, why it failed or None)."""
    out = workdir / f"{part}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--out", str(out),
           "--step-cap-s", str(args.step_cap_s), "--batch", str(args.batch)]
    cmd += ["--cpu-dry-run"] * args.cpu_dry_run + ["--quick"] * args.quick
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_CUDA_SANITIZER"):
        env.pop(key, None)
    env.setdefault("OMP_NUM_THREADS", "1" if args.cpu_dry_run else "8")
    env.update(env_extra or {})
    so, se = workdir / f"{part}.out", workdir / f"{part}.err"
    why = None
    with open(so, "w") as fo, open(se, "w") as fe:
        global CHILD
        proc = CHILD = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
            if rc != 0:
                why = f"exited with status {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = f"timed out after {timeout:.0f} s (the time budget)"
        finally:
            CHILD = None
    data = json.loads(out.read_text()) if out.exists() else None
    return data, so.read_text(errors="replace"), se.read_text(errors="replace"), why


def last_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip() and not ln.startswith(" ")]
    return lines[-1][:300] if lines else "(no stderr)"


def mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f}"


def report_memory(rep: Report, data: dict[str, Any] | None, cuda: bool) -> None:
    rep.say("\n== Part 1: world 8 on the fake process group (rank 0's layout), peak memory per step ==")
    if data is None:
        return
    cfg = data["cfg"]
    what = "CUDA allocator" if cuda else "RSS (CPU dry run; not checked)"
    rep.say(f"GPT {data['params'] / 1e6:.1f}M params (d={cfg['dim']}, {cfg['blocks']} blocks, seq {cfg['seq']}, "
            f"vocab {cfg['vocab']}), batch {data['batch']}, bf16 params / fp32 reduce; memory: {what}, MiB; "
            f"fake all-gather fills its output: {data.get('fake_gather_fills')}")
    rep.say(f"{'variant':<12}{'ours peak':>10}{'torch peak':>11}{'ratio':>7}{'ours aft.bwd':>13}"
            f"{'torch aft.bwd':>14}{'ours loss':>11}{'torch loss':>11}")
    for variant, libs in data["variants"].items():
        o, t = libs.get("ours", {}), libs.get("torch", {})
        for lib, rec in (("ours", o), ("torch", t)):
            if "error" in rec:
                rep.check("1 memory", f"{variant}: {lib} runs", False, rec["error"])
        if "error" in o or "error" in t or not o or not t:
            continue
        op, tp = max(o["peak"]), max(t["peak"])
        oa, ta = max(o["after_backward"]), max(t["after_backward"])
        rep.say(f"{variant:<12}{mb(op):>10}{mb(tp):>11}{op / tp:>7.3f}{mb(oa):>13}{mb(ta):>14}"
                f"{o['losses'][0]:>11.4f}{t['losses'][0]:>11.4f}")
        skip = None if cuda else "skipped: no CUDA"
        rep.check("1 memory", f"{variant}: peak ours <= torch x 1.02", op <= tp * 1.02,
                  f"{mb(op)} vs {mb(tp)} MiB ({op / tp:.3f})", skip=skip)
        slack = max(1 * MIB, 0.01 * ta)
        rep.check("1 memory", f"{variant}: after backward ours <= torch + {mb(slack)} MiB", oa <= ta + slack,
                  f"{mb(oa)} vs {mb(ta)} MiB", skip=skip)
        fills = data.get("fake_gather_fills", True)
        why = "" if fills else " (a warning only: this torch's fake all-gather leaves its output unwritten)"
        # the first step's only: later steps train on gradients the fake reduce-scatter never wrote
        # (uninitialized memory: NaN is possible, and seen on torch 2.11, for torch's side as for ours)
        finite = all(math.isfinite(v) for v in o["losses"][:1] + t["losses"][:1])
        rep.check("1 memory", f"{variant}: first-step losses finite{why}", finite, warn=not fills,
                  detail=f"ours {[round(v, 4) for v in o['losses']]}, torch {[round(v, 4) for v in t['losses']]}")
        gap = abs(o["losses"][0] - t["losses"][0])
        rep.check("1 memory", f"{variant}: first-step loss equals torch's{why}",
                  gap <= 1e-2 * max(1.0, abs(t["losses"][0])), warn=not fills,
                  detail=f"|{o['losses'][0]:.5f} - {t['losses'][0]:.5f}| = {gap:.2e}")
    streams = data["variants"].get("fsdp", {}).get("ours", {}).get("streams")
    if not cuda:
        rep.check("1 memory", "copy-in kernels off the compute stream (torch.profiler)", None, "",
                  skip="skipped: no CUDA")
    elif streams is None:
        rep.check("1 memory", "copy-in kernels off the compute stream (torch.profiler)", False, "no trace recorded")
    elif "error" in streams:
        rep.check("1 memory", "copy-in kernels off the compute stream (torch.profiler)", False, streams["error"])
    else:
        rep.say(f"streams (ours, FSDP, one step): {streams['kernels']} kernels; GEMM stream(s) "
                f"{streams['gemm_streams']}; {streams['side_kernels']} kernels on other streams "
                f"{streams['side_streams']} ({streams['side_cat_kernels']} cat), {streams['side_us']:.0f} us, "
                f"{streams['overlap_us']:.0f} us overlapping compute; names: {streams['side_kernel_names']}")
        rep.check("1 memory", "copy-in kernels off the compute stream (torch.profiler)",
                  bool(streams["gemm_streams"]) and streams["side_kernels"] > 0,
                  f"{streams['side_kernels']} kernels ({streams['side_cat_kernels']} cat) on streams "
                  f"{streams['side_streams']}, GEMMs on {streams['gemm_streams']}")
        rep.check("1 memory", "side-stream kernels overlap compute", streams["overlap_us"] > 0,
                  f"{streams['overlap_us']:.0f} of {streams['side_us']:.0f} us", warn=True)


def report_csan(rep: Report, data: dict[str, Any] | None, stderr: str, cuda: bool) -> None:
    if cuda:
        rep.say("\n== Part 2: this library under TORCH_CUDA_SANITIZER=1 (fake process group, world 8) ==")
    else:
        rep.say("\n== Part 2 (CPU dry run): CSAN needs CUDA; this library's CUDA branch on the stream stand-in "
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
    for key in [f"ours/{v}" for v in VARIANTS] + ["torch/fsdp"] * cuda:
        lib, variant = key.split("/")
        rec = (data or {}).get("variants", {}).get(variant, {}).get(lib)
        text = sections.get(key, "")
        if not cuda and rec is not None and "error" not in rec:  # the stand-in really ran the CUDA branch
            rep.check("2 csan", f"{key}: the stand-in saw stream waits", rec.get("stand_in_waits", 0) > 0,
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
        rep.check("2 csan", f"{key}: no {what}", n == 0, f"{n} report(s)")
        rep.check("2 csan", f"{key}: runs under {'the sanitizer' if cuda else 'the stand-in'}",
                  rec is not None and err is None,
                  status if err is None else f"{err} (a CSAN report raises CUDASanitizerErrors)")
    if not cuda:
        rep.check("2 csan", "TORCH_CUDA_SANITIZER run", None, "", skip="skipped: no CUDA")
    if first:
        rep.say(f"first of the {what}:\n" + first)


def report_step(rep: Report, data: dict[str, Any] | None, cuda: bool) -> None:
    rep.say("\n== Part 3: world 1, step time (plain bf16 params vs ours vs torch's fully_shard) ==")
    if data is None:
        return
    cfg = data["cfg"]
    rep.say(f"GPT {data['params'] / 1e6:.2f}M params (d={cfg['dim']}, {cfg['blocks']} blocks, seq {cfg['seq']}, "
            f"vocab {cfg['vocab']}), batch {data['batch']} ({data['tokens_per_step']} tokens/step), "
            f"torch.compile per block: {data['compile']}; "
            f"{'NCCL' if cuda else 'gloo (CPU dry run, tiny model)'}")
    med: dict[str, float] = {}
    rep.say(f"{'variant':<8}{'step ms':>9}{'fwd+bwd ms':>11}{'optim ms':>9}{'first step s':>13}{'MFU':>7}{'steps':>6}")
    for name, rec in data["variants"].items():
        if "error" in rec:
            rep.check("3 step", f"{name} runs", False, rec["error"])
            continue
        if not rec["step_s"]:
            rep.check("3 step", f"{name} measured", False, "no measured steps (time budget?)")
            continue
        m = statistics.median(rec["step_s"])
        med[name] = m
        mfu = 6 * data["params"] * data["tokens_per_step"] / m / H200_BF16_FLOPS
        comp = rec["compile_s"]
        rep.say(f"{name:<8}{m * 1e3:>9.1f}{statistics.median(rec['fwd_bwd_s']) * 1e3:>11.1f}"
                f"{statistics.median(rec['opt_s']) * 1e3:>9.1f}{comp if comp is not None else float('nan'):>13.1f}"
                f"{(f'{mfu:.1%}' if cuda else 'n/a'):>7}{len(rec['step_s']):>6}")
    if data.get("max_memory_allocated"):
        rep.say(f"max_memory_allocated over part 3 (all three models held): {mb(data['max_memory_allocated'])} MiB")
    if "capped_after_steps" in data:
        rep.say(f"(measuring capped after {data['capped_after_steps']} rounds by --step-cap-s)")
    skip = None if cuda else "skipped: no CUDA"
    if "ours" in med and "plain" in med:
        r = med["ours"] / med["plain"]
        fb = (statistics.median(data["variants"]["ours"]["fwd_bwd_s"])
              / statistics.median(data["variants"]["plain"]["fwd_bwd_s"]))
        rep.say(f"ours / plain = {r:.3f} (target <= 1.02; fwd+bwd only {fb:.3f}; plain steps bf16 AdamW "
                f"states, ours fp32 master weights)")
        rep.check("3 step", "ours/plain <= 1.05", r <= 1.05, f"{r:.3f}", skip=skip)
        rep.check("3 step", "ours/plain <= 1.02 (target)", r <= 1.02, f"{r:.3f}", warn=True, skip=skip)
    if "ours" in med and "torch" in med:
        r = med["ours"] / med["torch"]
        rep.say(f"ours / torch fully_shard = {r:.3f}")
        rep.check("3 step", "ours/torch <= 1.02", r <= 1.02, f"{r:.3f}", warn=True, skip=skip)
        lo, lt = data["variants"]["ours"]["losses"], data["variants"]["torch"]["losses"]
        n = min(len(lo), len(lt))
        gap = max((abs(a - b) for a, b in zip(lo[:n], lt[:n])), default=float("nan"))
        rep.say(f"losses ours  {[round(v, 4) for v in lo]}\nlosses torch {[round(v, 4) for v in lt]}\n"
                f"losses plain {[round(v, 4) for v in data['variants'].get('plain', {}).get('losses', [])]}")
        rep.check("3 step", "losses equal torch's within bf16 noise (|diff| <= 0.02)",
                  n > 0 and gap <= 0.02, f"max |diff| {gap:.2e} over {n} steps")
        rep.check("3 step", "losses finite", all(math.isfinite(v) for v in lo + lt), "")
    prof = data.get("profile")
    rep.say("\n== Part 4: fully_shard.profile on this library's part-3 model ==")
    if prof is None:
        rep.check("4 profile", "profile numbers consistent", False, "not run")
        return
    if "table" in prof:
        rep.say(prof["table"])
        rep.say(f"summary: {prof['summary']}")
    rep.check("4 profile", "profile numbers consistent", not prof["problems"], "; ".join(prof["problems"]) or
              "one all-gather per unit per forward, bytes, re-gathers, exposed <= time")


def orchestrate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.cpu_dry_run
    if not cuda and not args.cpu_dry_run:
        print("CHECK FAILED: no CUDA device: this check is for a GPU machine (python benchmarks/gpu_check.py "
              "there); on CPU run it with --cpu-dry-run to test the script itself", file=sys.stderr)
        return 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("CHECK FAILED: run it as one process (python benchmarks/gpu_check.py), not under torchrun with "
              "several ranks", file=sys.stderr)
        return 1
    rep = Report()
    device = torch.cuda.get_device_name(0) if cuda else "CPU (dry run)"
    rep.say(f"gpu_check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}: {device}, "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}"
            f"{', --quick' if args.quick else ''}")
    missing = missing_apis(cuda)
    for name, what in missing.items():
        rep.say(f"MISSING in this torch: {name} -> not run: {what}")
        rep.check("0 setup", f"torch has {name}", False, what, warn=True)
    rep.say("not yet run on a GPU before this run" if cuda else "CPU dry run: CUDA-only checks are skipped")
    budget = args.budget_s
    caps = {"memory": 0.25, "csan": 0.3, "step": 1.0}  # shares of the remaining budget
    datas: dict[str, dict[str, Any] | None] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        workdir = Path(tmp)
        for part in ("memory", "csan", "step"):
            if part in ("memory", "csan") and "fake_pg.FakeStore" in missing:
                rep.check(part, f"part {part} runs", False, "not run: torch lacks fake_pg.FakeStore", warn=True)
                datas[part] = None
                continue
            if part == "csan" and "torch.cuda._sanitizer" in missing:
                rep.check(part, "part csan runs", False, "not run: torch lacks torch.cuda._sanitizer", warn=True)
                datas[part] = None
                continue
            left = budget - (time.perf_counter() - t0)
            timeout = max(30.0, left * caps[part]) if part != "step" else max(30.0, left - 5)
            print(f"-- part {part} (timeout {timeout:.0f} s)", flush=True)
            # on CPU the sanitizer cannot be enabled (it needs CUDA): the child runs without it
            env = {"TORCH_CUDA_SANITIZER": "1"} if part == "csan" and cuda else None
            data, out, err, why = run_child(part, args, timeout, workdir, env)
            datas[part] = data
            sys.stdout.write(out)
            if why is not None:
                rep.check(part, f"part {part} completes", False, f"{why}: {last_error_line(err)}")
                sys.stderr.write(err[-4000:])
            if part == "memory":
                report_memory(rep, data, cuda)
            elif part == "csan":
                report_csan(rep, data, err, cuda)
            else:
                report_step(rep, data, cuda)
    elapsed = time.perf_counter() - t0
    rep.say("\n== Checks ==")
    for c in rep.checks:
        rep.say(f"{c.status:<5} [{c.part}] {c.name}: {c.detail}")
    fails = rep.failures
    verdict = (f"CHECK FAILED: {fails[0].part}: {fails[0].name}: {fails[0].detail}"
               + (f" (and {len(fails) - 1} more)" if len(fails) > 1 else "")) if fails \
        else f"ALL CHECKS PASSED ({sum(c.status == 'WARN' for c in rep.checks)} warnings, " \
             f"{sum(c.status == 'SKIP' for c in rep.checks)} skipped)"
    rep.say(f"total {elapsed:.0f} s (budget {budget:.0f} s)")
    rep.say(verdict)
    out_dir = Path(args.output_dir) if args.output_dir else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check" if cuda else "gpu_check_dryrun"
    (out_dir / f"{stem}.txt").write_text("\n".join(rep.lines) + "\n")
    write_json(str(out_dir / f"{stem}.json"), {
        "device": device, "torch": torch.__version__, "quick": args.quick, "dry_run": args.cpu_dry_run,
        "missing": missing, "elapsed_s": elapsed, "verdict": verdict,
        "checks": [c.__dict__ for c in rep.checks], "parts": datas})
    if fails:
        print(verdict, file=sys.stderr, flush=True)
        return 1
    return 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the parts on CPU with tiny models")
    ap.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    ap.add_argument("--budget-s", type=float, default=450.0, help="time cap for all parts together")
    ap.add_argument("--step-cap-s", type=float, default=60.0, help="cap on part 3's measured steps")
    ap.add_argument("--batch", type=int, default=8, help="part 3's batch (sequences of 2048 tokens)")
    ap.add_argument("--output-dir", default=None, help="where the .txt/.json go (default benchmarks/results)")
    ap.add_argument("--part", choices=("memory", "csan", "step"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args()


def exit_when_orphaned() -> None:
    """A child exits when the orchestrator is gone (killed by a timeout of its own caller): a part in
    its own session would otherwise outlive it and hold the GPU."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main() -> int:
    args = parse_args()
    if args.part is None:
        def stop(signum: int, _frame: object) -> None:  # SIGTERM/SIGINT: take the running part down too
            if CHILD is not None:
                with contextlib.suppress(OSError):
                    os.killpg(CHILD.pid, signal.SIGKILL)
            raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        return orchestrate(args)
    exit_when_orphaned()
    if args.cpu_dry_run:
        torch.set_num_threads(1)
    if args.part == "memory":
        part_memory(args, args.out, ("ours", "torch"), VARIANTS, 1 if args.quick else 2, csan=False)
    elif args.part == "csan":
        part_memory(args, args.out, ("ours",), VARIANTS, 1, csan=True)
        if args.cpu_dry_run:
            return 0
        # the control, in the same process: torch's fully_shard FSDP variant
        data = json.loads(Path(args.out).read_text())
        part_memory(args, args.out + ".torch", ("torch",), ("fsdp",), 1, csan=True)
        ctl = json.loads(Path(args.out + ".torch").read_text())
        data["variants"]["fsdp"]["torch"] = ctl["variants"]["fsdp"]["torch"]
        write_json(args.out, data)
    else:
        part_step(args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
