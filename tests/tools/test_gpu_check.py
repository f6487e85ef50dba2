"""benchmarks/gpu_check.py --cpu-dry-run --quick: the GPU check's own code runs on CPU (fake PG, tiny models)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_dry_run(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-dry-run", "--quick",
           "--output-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (tmp_path / "gpu_check_dryrun.txt").read_text()
    for part in ("Part 1", "Part 2", "Part 3", "Part 4", "ALL CHECKS PASSED"):
        assert part in text, part
    result = json.loads((tmp_path / "gpu_check_dryrun.json").read_text())
    statuses = {c["status"] for c in result["checks"]}
    assert "FAIL" not in statuses and "PASS" in statuses
    skipped = [c for c in result["checks"] if c["status"] == "SKIP"]
    assert skipped and all("no CUDA" in c["detail"] for c in skipped)
    assert set(result["parts"]["memory"]["variants"]) == {"fsdp", "hsdp", "reshard_2", "cpu_offload"}


def test_gpu_check_fails_without_cuda_or_flag(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--output-dir", str(tmp_path)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "CHECK FAILED: no CUDA device" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_gpu_only_reporting_on_synthetic_data(tmp_path: Path) -> None:
    """The kernel-stream analysis and the CUDA branches of the report, which only a GPU run reaches."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check as gc

    def k(name: str, stream: int, ts: float, dur: float) -> dict[str, object]:
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    streams = gc.analyze_kernels([k("nvjet_tst_gemm", 7, 0, 100), k("CatArrayBatchedCopy", 13, 50, 20),
                                  k("elementwise_kernel", 7, 100, 10), {"cat": "cpu_op", "name": "x"}])
    assert streams["gemm_streams"] == [7] and streams["side_streams"] == [13]
    assert streams["side_cat_kernels"] == 1 and streams["overlap_us"] == 20
    rec = {"losses": [10.0, 9.9, 9.8], "peak": [100 * gc.MIB], "after_backward": [50 * gc.MIB]}
    data = {"params": 1, "cfg": {"dim": 8, "blocks": 1, "seq": 4, "vocab": 16}, "batch": 1, "fake_gather_fills": True,
            "variants": {"fsdp": {"ours": dict(rec, streams=streams), "torch": dict(rec, peak=[90 * gc.MIB])}}}
    rep = gc.Report()
    gc.report_memory(rep, data, cuda=True)
    failed = {c.name for c in rep.failures}
    assert failed == {"fsdp: peak ours <= torch x 1.02"}, rep.checks
    rep = gc.Report()
    gc.report_csan(rep, {"variants": {"fsdp": {"ours": {"losses": [1.0]}}}},
                   f"=== ours/fsdp ===\n{gc.CSAN_MARKER} on tensor ...\n", cuda=True)
    assert any(c.name == "ours/fsdp: no CSAN reports" and c.status == "FAIL" for c in rep.checks)
    steps = {"losses": [10.0], "step_s": [1.0], "fwd_bwd_s": [0.8], "opt_s": [0.2], "compile_s": 5.0}
    data = {"params": 10**9, "cfg": {"dim": 8, "blocks": 1, "seq": 4, "vocab": 16}, "batch": 1, "compile": True,
            "tokens_per_step": 16384, "max_memory_allocated": gc.MIB,
            "variants": {"plain": steps, "ours": dict(steps, step_s=[1.03]), "torch": steps},
            "profile": {"problems": [], "table": "t", "summary": {}}}
    rep = gc.Report()
    gc.report_step(rep, data, cuda=True)
    status = {c.name: c.status for c in rep.checks}
    assert status["ours/plain <= 1.05"] == "PASS" and status["ours/plain <= 1.02 (target)"] == "WARN"
    assert any("MFU" in line for line in rep.lines) and "9.9%" in "\n".join(rep.lines)
