"""benchmarks/scaling.py --quick: the smallest units point on 2 ranks runs, and its figures add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scaling_quick_units(tmp_path: Path) -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from models.gpt import GPT, GPTConfig

    cmd = [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--axis", "units", "--quick",
           "--output-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (tmp_path / "scaling_quick.txt").read_text()
    assert "axis units (ours/torch/ddp" in text and "axis width" not in text
    data = json.loads((tmp_path / "scaling_quick.json").read_text())
    (row,) = data["summary"]
    assert (row["axis"], row["value"], row["world"], row["rounds"]) == ("units", 4, 2, 1)
    lines = [line for line in text.splitlines() if line.split()[:1] == ["4"]]
    assert len(lines) == 1, text

    (raw,) = data["rows"]
    model = GPT(GPTConfig(**raw["cfg"]))
    p_all = sum(p.numel() * p.element_size() for p in model.parameters())
    p_blocks = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    assert row["params"] * 4 == p_all
    # every unit gathered in forward, the blocks again in backward; every gradient reduced once
    for name in ("ours", "torch"):
        kinds = raw["bytes_by_kind"][name]
        assert kinds["all_gather"] == p_all + p_blocks, (name, kinds)
        assert kinds.get("reduce_scatter", 0) + kinds.get("all_reduce", 0) == p_all, (name, kinds)
    assert raw["bytes_by_kind"]["ddp"] == {"all_reduce": p_all}
    for name in ("ours", "torch", "ddp"):
        assert 0 < row["step_s"][name] < 60
        assert 0 < row["above_idle"][name] < 2**30
    assert row["bytes_ratio"] == 1.0 and row["loss_gap"] <= 1e-6
