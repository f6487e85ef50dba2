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
                          text=True, timeout=90)
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
