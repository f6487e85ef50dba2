"""The GPU check's runner: each part in a child process with its own time budget; the report and result files.

``python benchmarks/gpu_check.py`` (its one command) runs this on the GPU machine (one GPU, no torchrun):
every part below in a child process with a timeout, so a hang or a crash in one leaves the others'
figures in ``benchmarks/results/gpu_check.txt`` / ``.json``; exit status non-zero with ``CHECK FAILED: ...``
when a check fails. Parts (each module's docstring says what it checks):

1. ``memory`` (tests/gpu/memory.py): world 8 on the fake process group, memory and allocator ours vs torch;
2. ``csan`` (tests/gpu/memory.py): the same variants of ours under ``TORCH_CUDA_SANITIZER=1``;
3. ``delay`` (tests/gpu/delay.py): every collective delayed on its stream, bitwise equal to
   ``CUDA_LAUNCH_BLOCKING=1``; two identical runs bitwise equal;
4. ``step`` (tests/gpu/step.py): a compiled ~1B GPT at world 1, ours vs torch's ``fully_shard`` vs plain;
   ``fully_shard.profile``'s numbers;
5. ``host`` (tests/gpu/host.py): no host syncs in a step, a launch-bound model and CPU offload, ours vs torch.

Budgets: each part gets its share of ``--budget-s`` (default 450 s, about 8 minutes with the start-up);
a part cut by its budget is reported by name as a warning with what it had written so far, and the
other parts still run. ``--parts`` runs some of them; ``--no-compile`` runs part step eager.
``--cpu-dry-run`` runs every part on the CPU with tiny models (memory as RSS; part csan on the stream
stand-in; CUDA-only checks "skipped: no CUDA"); without the flag and without CUDA the check fails.
It runs on whatever torch the machine has: what that torch lacks is listed in the output and the parts
needing it are reported as not run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.gpu.common import RESULTS, ROOT, write_json
from tests.gpu.report import Report

PARTS = {"memory": 0.14, "csan": 0.14, "delay": 0.2, "step": 0.38, "host": 0.14}  # shares of --budget-s
DELAY_CHILDREN = ("nccl", "nccl-blocking", "fake", "fake-blocking")
CHILD: subprocess.Popen[bytes] | None = None  # the part running now (the runner kills it on SIGTERM)


def missing_apis(cuda: bool) -> dict[str, str]:
    """What this torch lacks that a part needs: name -> what is not run without it."""
    missing: dict[str, str] = {}
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except Exception as e:
        missing["fake_pg.FakeStore"] = f"parts memory, csan and delay's world 8: {type(e).__name__}: {e}"
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: F401
    except Exception as e:
        missing["torch.distributed.fsdp.fully_shard/CPUOffloadPolicy"] = f"torch's side of parts memory, step, host: " \
                                                                          f"{e}"
    if cuda:
        if importlib.util.find_spec("torch.cuda._sanitizer") is None:
            missing["torch.cuda._sanitizer"] = "part csan (TORCH_CUDA_SANITIZER)"
        if not dist.is_nccl_available():
            missing["NCCL"] = "parts delay (world 1), step and host (world 1 on NCCL)"
        if importlib.util.find_spec("triton") is None:
            missing["triton"] = "part step's torch.compile (runs eager instead)"
        if not hasattr(torch.cuda, "_sleep"):
            missing["torch.cuda._sleep"] = "part delay's delays (the runs are compared undelayed)"
    return missing


def run_child(part: str, args: argparse.Namespace, timeout: float, workdir: Path, *, tag: str | None = None,
              env_extra: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, str, str, str | None]:
    """Run ``--part part`` in a child; (its JSON or None, stdout, stderr, why it failed or None)."""
    tag = tag or part
    out = workdir / f"{tag}.json"
    cmd = [sys.executable, "-m", "tests.gpu.runner", "--part", part, "--out", str(out), "--step-cap-s",
           str(args.step_cap_s), "--batch", str(args.batch), "--delay-ms", str(args.delay_ms)]
    cmd += ["--cpu-dry-run"] * args.cpu_dry_run + ["--quick"] * args.quick + ["--no-compile"] * args.no_compile
    if part == "delay":
        cmd += ["--world", tag.split("-")[0]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCH_CUDA_SANITIZER", "CUDA_LAUNCH_BLOCKING"):
        env.pop(key, None)
    env.setdefault("OMP_NUM_THREADS", "1" if args.cpu_dry_run else "8")
    env.update(env_extra or {})
    so, se = workdir / f"{tag}.out", workdir / f"{tag}.err"
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
            why = f"over its budget: cut after {timeout:.0f} s"
        finally:
            CHILD = None
    data = json.loads(out.read_text()) if out.exists() else None
    return data, so.read_text(errors="replace"), se.read_text(errors="replace"), why


def last_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip() and not ln.startswith(" ")]
    return lines[-1][:300] if lines else "(no stderr)"


def _completion(rep: Report, part: str, tag: str, why: str | None, err: str, cut: list[str]) -> None:
    """A child that crashed fails; one cut by its budget is a warning naming the part (it fails soft)."""
    if why is None:
        return
    sys.stderr.write(err[-4000:])
    if why.startswith("over its budget"):
        cut.append(part)
        rep.check(part, f"part {tag} within its budget", False, f"{why}; the checks below are what it wrote before",
                  warn=True)
    else:
        rep.check(part, f"part {tag} completes", False, f"{why}: {last_error_line(err)}")


def orchestrate(args: argparse.Namespace) -> int:
    from tests.gpu import delay, host, memory, step

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.cpu_dry_run
    if not cuda and not args.cpu_dry_run:
        print("CHECK FAILED: no CUDA device: this check is for a GPU machine (python benchmarks/gpu_check.py "
              "there); on CPU run it with --cpu-dry-run to test the check itself", file=sys.stderr)
        return 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("CHECK FAILED: run it as one process (python benchmarks/gpu_check.py), not under torchrun with "
              "several ranks", file=sys.stderr)
        return 1
    parts = [p for p in PARTS if p in (args.parts.split(",") if args.parts else PARTS)]
    rep = Report()
    device = torch.cuda.get_device_name(0) if cuda else "CPU (dry run)"
    rep.say(f"gpu_check {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}: {device}, "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}"
            f"{', --quick' if args.quick else ''}{', --no-compile' if args.no_compile else ''}; parts {parts}")
    missing = missing_apis(cuda)
    for name, what in missing.items():
        rep.say(f"MISSING in this torch: {name} -> not run: {what}")
        rep.check("setup", f"torch has {name}", False, what, warn=True)
    if not cuda:
        rep.say("CPU dry run: CUDA-only checks are skipped")
    datas: dict[str, Any] = {}
    cut: list[str] = []
    budget = args.budget_s if args.budget_s is not None else (450.0 if cuda else 3600.0)
    budgets = {p: max(30.0, budget * PARTS[p]) for p in parts}
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        workdir = Path(tmp)
        for part in parts:
            if part in ("memory", "csan") and "fake_pg.FakeStore" in missing:
                rep.check(part, f"part {part} runs", False, "not run: torch lacks fake_pg.FakeStore", warn=True)
                continue
            if part == "csan" and "torch.cuda._sanitizer" in missing:
                rep.check(part, "part csan runs", False, "not run: torch lacks torch.cuda._sanitizer", warn=True)
                continue
            print(f"-- part {part} (budget {budgets[part]:.0f} s)", flush=True)
            if part == "delay":
                runs: dict[str, dict[str, Any] | None] = {}
                start = time.perf_counter()
                children = [c for c in DELAY_CHILDREN if not (c.startswith("fake") and "fake_pg.FakeStore" in missing)]
                for i, tag in enumerate(children):
                    left = budgets[part] - (time.perf_counter() - start)
                    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
                    if tag.endswith("blocking"):
                        env["CUDA_LAUNCH_BLOCKING"] = "1"
                    data, out, err, why = run_child(part, args, max(20.0, left / (len(children) - i)), workdir,
                                                    tag=tag, env_extra=env)
                    sys.stdout.write(out)
                    runs[tag] = data
                    _completion(rep, part, tag, why, err, cut)
                datas[part] = runs
                delay.report(rep, runs, {t: workdir / f"{t}.json.pt" for t in children}, cuda, part in cut)
                continue
            env = {"TORCH_CUDA_SANITIZER": "1"} if part == "csan" and cuda else None
            data, out, err, why = run_child(part, args, budgets[part], workdir, env_extra=env)
            datas[part] = data
            sys.stdout.write(out)
            _completion(rep, part, part, why, err, cut)
            if part == "memory":
                memory.report(rep, data, cuda, part in cut)
            elif part == "csan":
                memory.report_csan(rep, data, err, cuda, part in cut)
            elif part == "step":
                step.report(rep, data, cuda, part in cut)
            else:
                host.report(rep, data, cuda, part in cut)
    elapsed = time.perf_counter() - t0
    rep.say("\n== Checks ==")
    for c in rep.checks:
        rep.say(f"{c.status:<5} [{c.part}] {c.name}: {c.detail}")
    fails = rep.failures
    counts = (f"{sum(c.status == 'WARN' for c in rep.checks)} warnings, "
              f"{sum(c.status == 'SKIP' for c in rep.checks)} skipped")
    if fails:
        verdict = (f"CHECK FAILED: {fails[0].part}: {fails[0].name}: {fails[0].detail}"
                   + (f" (and {len(fails) - 1} more)" if len(fails) > 1 else ""))
    elif cut:
        verdict = (f"CHECKS PASSED WHERE THEY RAN: part(s) {', '.join(dict.fromkeys(cut))} cut by their budget "
                   f"({counts})")
    else:
        verdict = f"ALL CHECKS PASSED ({counts})"
    rep.say(f"total {elapsed:.0f} s (budget {budget:.0f} s: " +
            ", ".join(f"{p} {b:.0f}" for p, b in budgets.items()) + ")")
    rep.say(verdict)
    out_dir = Path(args.output_dir) if args.output_dir else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check" if cuda else "gpu_check_dryrun"
    (out_dir / f"{stem}.txt").write_text("\n".join(rep.lines) + "\n")
    write_json(out_dir / f"{stem}.json", {
        "device": device, "torch": torch.__version__, "quick": args.quick, "dry_run": args.cpu_dry_run,
        "missing": missing, "elapsed_s": elapsed, "verdict": verdict, "cut": cut, "budgets": budgets,
        "checks": [c.__dict__ for c in rep.checks], "parts": datas})
    if fails:
        print(verdict, file=sys.stderr, flush=True)
        return 1
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the parts on CPU with tiny models")
    ap.add_argument("--quick", action="store_true", help="smaller models and fewer steps")
    ap.add_argument("--parts", default=None, help=f"comma-separated subset of {','.join(PARTS)} (default all)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="time for all parts together (default 450 s; 3600 s for the CPU dry run, whose "
                    "children start slowly on a loaded machine); each part gets its share: " +
                    ", ".join(f"{p} {s:.0%}" for p, s in PARTS.items()))
    ap.add_argument("--no-compile", action="store_true", help="part step without torch.compile (eager)")
    ap.add_argument("--step-cap-s", type=float, default=60.0, help="cap on part step's measured steps")
    ap.add_argument("--batch", type=int, default=8, help="part step's batch (sequences of 2048 tokens)")
    ap.add_argument("--delay-ms", type=float, default=2.0, help="part delay's sleep before each collective")
    ap.add_argument("--output-dir", default=None, help="where the .txt/.json go (default benchmarks/results)")
    ap.add_argument("--part", choices=tuple(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--world", choices=("nccl", "fake"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def exit_when_orphaned() -> None:
    """A child exits when the runner is gone (killed by a timeout of its own caller): a part in its own
    session would otherwise outlive it and hold the GPU."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    from tests.gpu import delay, host, memory, step

    if args.part == "memory":
        memory.run(args, args.out, ("ours", "torch"), memory.VARIANTS, 1 if args.quick else 2, csan=False)
    elif args.part == "csan":
        memory.run_csan(args, args.out)
    elif args.part == "delay":
        delay.run(args, args.out, args.world)
    elif args.part == "step":
        step.run(args, args.out)
    else:
        host.run(args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
