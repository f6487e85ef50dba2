"""examples/train_tp.py on 4 CPU ranks: TP + AC + per-block compile + FSDP (dp 2 x tp 2) matches the
dp-only run on the same global batch (the same recipe on torch's fully_shard: ``--impl torch``; TP parity
with torch is tests/parallel/test_tp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp: Path, impl: str) -> dict[str, list[float]]:
    report = tmp / f"{impl}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(ROOT / "examples" / "train_tp.py"), "--impl", impl, "--steps", "4", "--report", str(report)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loss gap" in proc.stdout, proc.stdout
    return json.loads(report.read_text())


def test_tp_example_matches_dp_only(tmp_path: Path) -> None:
    ours = _run(tmp_path, "ours")
    assert len(ours["two_d"]) == 4 and ours["two_d"][-1] < ours["two_d"][0]  # it learns
    assert ours["gap"] < 1e-5, ours  # 2-D vs dp-only on the same global batch
