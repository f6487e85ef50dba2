"""examples/multinode_hsdp.py: two torchrun agents as two 'nodes' (c10d rendezvous on localhost, 2 ranks
each) train HSDP (2 x 2) with the same losses and parameters as one agent of 4 ranks; the shard groups
stay within a node; with set_requires_all_reduce(False) the cross-node all-reduce runs once per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--steps", "2", "--accum", "2", "--batch", "2", "--blocks", "1", "--dim", "32", "--heads", "2",
         "--seq", "16", "--vocab", "128"]


def test_two_agents_equal_one_agent(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "examples" / "multinode_hsdp.py"), *SMALL, "--out", str(tmp_path),
           "--timeout", "150"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=330)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout and proc.stdout.count("-> EQUAL") == 2, proc.stdout
    two = json.loads((tmp_path / "two_nodes" / "report.json").read_text())
    one = json.loads((tmp_path / "one_node" / "report.json").read_text())
    assert two["topology"]["nodes"] == [0, 0, 1, 1], two["topology"]  # one agent's ranks are consecutive
    assert two["topology"]["shard_group"] == [0, 1] and two["topology"]["replicate_group"] == [0, 2]
    assert one["topology"]["nodes"] == [0, 0, 0, 0] and one["mesh"] == two["mesh"] == [2, 2]
    for report in (two, one):
        sync, accum = report["runs"]["sync"], report["runs"]["accumulate"]
        assert len(sync["losses"]) == 2 and len(accum["losses"]) == 4
        assert sync["losses"] == one["runs"]["sync"]["losses"]  # bit for bit across the two launches
        assert accum["losses"] == one["runs"]["accumulate"]["losses"]
        # per optimizer step: the all-gathers and reduce-scatters run every micro-batch, inside the node;
        # the all-reduce across nodes once (the other micro-batch's is skipped), 1/2 of the gradient bytes
        assert accum["bytes"]["shard"] == 2 * sync["bytes"]["shard"], (sync, accum)
        assert accum["bytes"]["replicate"] == sync["bytes"]["replicate"] > 0, (sync, accum)
        assert sync["bytes"]["replicate"] < 0.51 * sync["bytes"]["model"], sync
