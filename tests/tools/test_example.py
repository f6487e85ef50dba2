"""The main example end to end on 2 CPU ranks: trains, checkpoints, resumes exactly, reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--blocks", "2", "--dim", "32", "--heads", "2", "--seq", "16", "--vocab", "128", "--batch", "4",
         "--ckpt-every", "2", "--profile-steps", "2", "--no-progress"]


def _run(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "train_gpt.py"), *SMALL, "--ckpt-dir", str(tmp / "ckpt"), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_example_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    first = _run(tmp_path, "--steps", "4", "--report", str(tmp_path / "a.json"), "--trace", str(tmp_path / "t.json"))
    a = json.loads((tmp_path / "a.json").read_text())
    assert len(a["losses"]) == 4
    assert (tmp_path / "ckpt" / "step-2").is_dir() and (tmp_path / "ckpt" / "step-4").is_dir()
    out = first.stdout
    for text in ("loss (step:loss)", "per-rank state", "unsharded model", "sharded/unsharded = 0.5",
                 "fully_shard profile", "blocks.1", "bytes/step"):
        assert text in out, out
    state, full = a["state_bytes"], a["unsharded_bytes"]
    assert sum(state.values()) / sum(full.values()) < 0.51  # 1/2 plus padding
    assert a["profile"]["steps"] == 2 and a["profile"]["bytes_over_model"] > 2.0
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    # resume from step 2 (drop the step-4 checkpoint): steps 3 and 4 must reproduce the first run
    shutil.rmtree(tmp_path / "ckpt" / "step-4")
    second = _run(tmp_path, "--steps", "4", "--resume", "--report", str(tmp_path / "b.json"))
    assert "resumed from" in second.stdout and "step-2" in second.stdout
    b = json.loads((tmp_path / "b.json").read_text())
    assert len(b["losses"]) == 4
    assert b["losses"][:2] == a["losses"][:2]  # restored from the checkpoint's extra
    for x, y in zip(b["losses"][2:], a["losses"][2:]):
        assert abs(x - y) < 1e-5, (b["losses"], a["losses"])
