"""GPU checks (marked ``gpu``; skipped with a reason on CPU): benchmarks/gpu_check.py end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (gpu_check.py runs on GPU machines)")
def test_gpu_check_quick(tmp_path: Path) -> None:
    """Every part of the GPU check (fake-PG memory, sanitizer, world-1 step time, profile) on small models."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--output-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ALL CHECKS PASSED" in proc.stdout
