"""examples/quickstart.py (the founding note's code) end to end on 2 CPU ranks, with the note's own torch
imports after compat.patch_torch(fsdp1=True): five units, 1/W of the parameters per rank, and the loss
continuing exactly after FULL and SHARDED state-dict round trips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_runs_the_note_and_resumes(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "quickstart.py"), "--steps", "3", "--torch-imports"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "FullyShardedDataParallel: 5 units (the root + 4 blocks)" in out, out
    assert "FULL_SHARD     per-rank parameters   533,760 B of 1,067,520 B (0.500" in out, out
    assert "NO_SHARD       per-rank parameters 1,067,520 B of 1,067,520 B (1.000" in out, out
    assert "the loss continues: True" in out, out
