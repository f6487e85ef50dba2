"""The GPU check (tests/gpu/runner.py and its parts; one command: benchmarks/gpu_check.py).

On a GPU machine (marked ``gpu``): every part with ``--quick``. In CI (no GPU): the CPU dry run of every part
(the same code on CPU with tiny models), the refusal without CUDA and without the flag, and the reports'
CUDA branches on synthetic data (which only a GPU run reaches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import delay, host, memory, step
from tests.gpu.common import MIB, ROOT
from tests.gpu.report import Report

COMMAND = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def _statuses(checks: list[dict[str, str]]) -> dict[str, str]:
    return {f"[{c['part']}] {c['name']}": c["status"] for c in checks}


@pytest.mark.timeout(3000)  # nine child processes; each starts slowly on a loaded machine
def test_gpu_check_cpu_dry_run(tmp_path: Path) -> None:
    proc = subprocess.run([*COMMAND, "--cpu-dry-run", "--quick", "--output-dir", str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=2900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (tmp_path / "gpu_check_dryrun.txt").read_text()
    assert "ALL CHECKS PASSED" in text, text[-3000:]  # (no part cut by its budget either)
    for part in ("Part memory", "Part csan", "Part delay", "Part step", "Part host"):
        assert part in text, part
    result = json.loads((tmp_path / "gpu_check_dryrun.json").read_text())
    status = _statuses(result["checks"])
    assert "FAIL" not in status.values() and not result["cut"]
    skipped = [c for c in result["checks"] if c["status"] == "SKIP"]
    assert skipped and all("no CUDA" in c["detail"] for c in skipped), skipped
    assert set(result["parts"]["memory"]["variants"]) == {"fsdp", "hsdp", "reshard_2", "cpu_offload"}
    # every variant of the delay part ran in both worlds and both modes, its collectives went through the delays
    for kind, variants in delay.WORLDS.items():
        for variant in variants:
            for what in ("the delays reached all-gathers and reduce-scatters", "two identical runs bitwise equal",
                         "delayed run bitwise equal to CUDA_LAUNCH_BLOCKING=1's"):
                assert status[f"[delay] {kind}/{variant}: {what}"] == "PASS", (kind, variant, what)
    assert status["[host] launch_bound: losses equal torch's on every step (|diff| <= 0.02, bf16)"] == "PASS"
    assert status["[step] profile numbers consistent"] == "PASS"


def test_gpu_check_fails_without_cuda_or_flag(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the check runs for real")
    proc = subprocess.run([*COMMAND, "--output-dir", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "CHECK FAILED: no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_reports_on_synthetic_gpu_data(tmp_path: Path) -> None:
    """The CUDA branches of the reports, which only a GPU run reaches: each fails where it must."""
    def k(name: str, stream: int, ts: float, dur: float) -> dict[str, object]:
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    streams = memory.analyze_kernels([k("nvjet_tst_gemm", 7, 0, 100), k("CatArrayBatchedCopy", 13, 50, 20),
                                      k("elementwise_kernel", 7, 100, 10), {"cat": "cpu_op", "name": "x"}])
    assert streams["gemm_streams"] == [7] and streams["side_streams"] == [13]
    assert streams["side_cat_kernels"] == 1 and streams["overlap_us"] == 20
    allocator = {"num_alloc_retries": 0, "reserved_peak": 120 * MIB, "allocated_peak": 100 * MIB}
    rec = {"losses": [10.0, 9.9, 9.8], "peak": [100 * MIB], "after_backward": [50 * MIB], "allocator": allocator}
    data = {"params": 1, "cfg": {"dim": 8, "blocks": 1, "seq": 4, "vocab": 16}, "batch": 1,
            "fake_writes": {"all_gather": True, "reduce_scatter": True},
            "variants": {"fsdp": {"ours": dict(rec, streams=streams),
                                  "torch": dict(rec, peak=[90 * MIB], losses=[10.0, 9.9, 9.0],
                                                allocator=dict(allocator, num_alloc_retries=3))}}}
    rep = Report()
    memory.report(rep, data, cuda=True)
    failed = {c.name for c in rep.failures}
    # peak over torch's and the third step's loss (the fake reduce-scatter writes: every step is compared)
    assert failed == {"fsdp: peak ours <= torch x 1.02", "fsdp: losses equal torch's (3 steps)"}, rep.checks
    assert any("retries ours 0 torch 3" in line for line in rep.lines), rep.lines
    rep = Report()
    memory.report_csan(rep, {"variants": {"fsdp": {"ours": {"losses": [1.0]}}}},
                       f"=== ours/fsdp ===\n{memory.CSAN_MARKER} on tensor ...\n", cuda=True)
    assert any(c.name == "ours/fsdp: no CSAN reports" and c.status == "FAIL" for c in rep.checks)
    steps = {"losses": [10.0], "step_s": [1.0], "fwd_bwd_s": [0.8], "opt_s": [0.2], "first_step_s": 5.0}
    data = {"params": 10**9, "cfg": {"dim": 8, "blocks": 1, "seq": 4, "vocab": 16}, "batch": 1, "compile": True,
            "tokens_per_step": 16384, "max_memory_allocated": MIB, "compile_s": 30.0, "phase": "done",
            "variants": {"plain": dict(steps, step_s=[0.5]), "ours": dict(steps, step_s=[1.03]), "torch": steps},
            "profile": {"problems": [], "table": "t", "summary": {}}}
    rep = Report()
    step.report(rep, data, cuda=True)
    status = {c.name: c.status for c in rep.checks}
    # ours/plain (2.06 here) is reported, not checked; ours/torch is
    assert status["ours/torch <= 1.05"] == "PASS" and status["ours/torch <= 1.02 (target)"] == "WARN", status
    assert not any("plain" in name for name in status) and any("ours / plain = 2.060" in line for line in rep.lines)
    assert "9.9%" in "\n".join(rep.lines)  # MFU of the 1.03 s step
    first, every = ("the first step's loss equals torch's (same weights and batch; compiled kernels: |diff| <= 1e-3)",
                    "losses on every step within bf16 noise of torch's (|ours - torch| <= 0.02 + |torch - fp32 "
                    "autocast|)")
    assert status[first] == "PASS" and status[every] == "PASS", status
    # later steps: bounded by torch's own spread from the fp32 + autocast reference on that step
    for ours, verdicts in (([10.0, 9.5, 10.9], ("PASS", "PASS")),  # 0.9 off torch, plain 1.5 off it
                           ([10.0, 9.5, 11.6], ("PASS", "FAIL")),  # 2.6 > 0.02 + 1.5
                           ([10.01, 9.5, 9.0], ("FAIL", "PASS"))):  # the first step 0.01 off
        data["variants"].update(ours=dict(steps, step_s=[1.03], losses=ours),
                                torch=dict(steps, losses=[10.0, 9.5, 10.0]),
                                plain=dict(steps, step_s=[0.5], losses=[10.0, 9.5, 8.5]))
        rep = Report()
        step.report(rep, data, cuda=True)
        status = {c.name: c.status for c in rep.checks}
        assert (status[first], status[every]) == verdicts, (ours, status)
    data["variants"]["ours"]["step_s"] = []  # cut by the budget before measuring: a skip, not a failure
    rep = Report()
    step.report(rep, data, cuda=True, cut=True)
    assert {c.name: c.status for c in rep.checks}["ours measured"] == "SKIP"
    rep = Report()
    host.report(rep, {"host_cfg": data["cfg"], "host_batch": 2, "offload_cfg": data["cfg"],
                      "sync": {"ours": {"forward_backward": "RuntimeError: called a synchronizing CUDA operation",
                                        "optimizer": None}, "torch": {"forward_backward": None, "optimizer": None}},
                      "launch_bound": {"ours": {"step_s": [1.0], "losses": [1.0]},
                                       "torch": {"step_s": [2.0], "losses": [1.0]}}}, cuda=True)
    status = {c.name: c.status for c in rep.checks}
    assert status["no host sync in a steady-state forward+backward (set_sync_debug_mode)"] == "FAIL"
    assert status["launch_bound: ours/torch step time <= 1.00"] == "PASS" and status["offload runs"] == "FAIL"


def test_delay_report_fails_on_a_difference_from_the_blocking_run(tmp_path: Path) -> None:
    same = {"w": torch.ones(4)}
    torch.save({"fsdp": same}, tmp_path / "a.pt")
    torch.save({"fsdp": {"w": torch.tensor([1.0, 1.0, 1.0, 1.0 + 2**-20])}}, tmp_path / "b.pt")
    run = {"world": 1, "kind": "nccl", "delay_ms": 2.0, "delay_cycles": 1, "steps": 3,
           "variants": {"fsdp": {"losses": [1.0], "delayed": {"all_gather": 2, "reduce_scatter": 1}, "repeat": None}}}
    rep = Report()
    runs = {"nccl": run, "nccl-blocking": run}
    delay.report(rep, runs, {"nccl": tmp_path / "a.pt", "nccl-blocking": tmp_path / "b.pt"}, cuda=True)
    status = {c.name: (c.status, c.detail) for c in rep.checks}
    bad = status["nccl/fsdp: delayed run bitwise equal to CUDA_LAUNCH_BLOCKING=1's"]
    assert bad[0] == "FAIL" and "w differs" in bad[1], bad
    assert status["nccl/fsdp: two identical runs bitwise equal"][0] == "PASS"
    assert status["fake: both runs"][0] == "FAIL"  # the other world did not run
    rep = Report()
    delay.report(rep, runs, {"nccl": tmp_path / "a.pt", "nccl-blocking": tmp_path / "a.pt"}, cuda=True, cut=True)
    status = {c.name: (c.status, c.detail) for c in rep.checks}
    assert status["nccl/fsdp: delayed run bitwise equal to CUDA_LAUNCH_BLOCKING=1's"][0] == "PASS"
    assert status["fake: both runs"][0] == "SKIP"  # cut by the budget: reported once, by the runner


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU check runs on GPU machines)")
def test_gpu_check_quick(tmp_path: Path) -> None:
    """Every part of the GPU check on small models; no check fails, no part cut."""
    proc = subprocess.run([*COMMAND, "--quick", "--output-dir", str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ALL CHECKS PASSED" in proc.stdout
