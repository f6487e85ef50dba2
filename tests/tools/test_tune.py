"""Tuner: a real 2-rank sweep with a raising and a crashing configuration, and the recommendation logic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fully_shard.tools.tune import (
    TuneConfig,
    TuneResult,
    format_table,
    granularities,
    recommend,
    sweep_configs,
)

ROOT = Path(__file__).resolve().parents[2]


def test_sweep_survives_a_raising_and_a_crashing_config(tmp_path: Path) -> None:
    """tests.tools.tune_models: with 2 blocks the sweep is k in {1, 2} x reshard {True, False}; k=2 without
    resharding raises on every rank, k=1 without resharding kills rank 1 mid-step (a crash)."""
    out = tmp_path / "tune"
    env = dict(os.environ, FS_TUNE_TEST_CRASH="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "fully_shard.tune", "--model", "tests.tools.tune_models:build_model",
         "--batch", "tests.tools.tune_models:build_batch", "--world-size", "2", "--out", str(out),
         "--steps", "2", "--warmup", "1", "--agree-timeout", "5", "--memory-budget-mb", "4096"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "tune.json").read_text())
    results = {(r["config"]["blocks_per_unit"], r["config"]["reshard_after_forward"]): r for r in report["results"]}
    assert set(results) == {(1, True), (1, False), (2, True), (2, False)}
    assert "refuses grouped blocks" in results[(2, False)]["error"], results[(2, False)]
    crashed = results[(1, False)]["error"]
    assert "died" in crashed and "rank 1 exit code 3" in crashed, crashed
    for key in ((1, True), (2, True)):
        r = results[key]
        assert r["error"] is None, r
        assert r["step_s"] > 0 and len(r["step_times_s"]) == 2
        assert r["peak_bytes"] > 0 and len(r["peak_bytes_per_rank"]) == 2
        assert 0.0 <= r["comm_share"] <= 1.0
        assert r["units"] == (3 if key[0] == 1 else 2)  # blocks-per-unit groups + the root
        assert 2.5 < r["bytes_over_model"] < 3.0  # re-gathered blocks, root kept
        assert r["fits"] is True
    assert report["recommended"] is not None
    best = (report["recommended"]["blocks_per_unit"], report["recommended"]["reshard_after_forward"])
    assert best in {(1, True), (2, True)}
    assert results[best]["step_s"] == min(results[k]["step_s"] for k in ((1, True), (2, True)))
    png = (out / "tune.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "recommended:" in proc.stdout and "FAILED" in proc.stdout and "tune:" in proc.stderr  # tqdm bar


def _result(i: int, k: int, raf: bool, step: float | None, peak: int | None, error: str | None = None) -> TuneResult:
    return TuneResult(TuneConfig(i, k, raf), units=2, step_s=step, peak_bytes=peak, comm_share=0.1,
                      comm_busy_share=0.2, bytes_over_model=2.5, error=error)


def test_recommend_fastest_within_budget() -> None:
    mib = 2**20
    results = [_result(0, 1, True, 0.30, 100 * mib), _result(1, 1, False, 0.20, 300 * mib),
               _result(2, 2, True, 0.25, 150 * mib), _result(3, 2, False, None, None, "boom")]
    best, reason = recommend(results, 200 * mib)
    assert best is results[2], reason
    assert [r.fits for r in results] == [True, False, True, None]
    assert "2 of 3 configurations within 200 MiB" in reason and "k=1 reshard" in reason
    assert "the fastest overall (k=1 keep, 200.0 ms) needs 300.0 MiB, over the budget" in reason, reason
    table = format_table(results, 200 * mib, best)
    assert "<- recommended" in table and "FAILED: boom" in table and " no" in table
    best, reason = recommend(results, None)
    assert best is results[1] and "no memory budget" in reason
    best, reason = recommend(results, 50 * mib)
    assert best is None and "no configuration fits" in reason and "100.0 MiB" in reason
    best, reason = recommend([results[3]], None)
    assert best is None and "no configuration ran" in reason


def test_granularities() -> None:
    assert granularities(1) == [1]
    assert granularities(6) == [1, 2, 4, 6]
    assert granularities(8) == [1, 2, 4, 8]
    configs = sweep_configs(3)
    assert [(c.blocks_per_unit, c.reshard_after_forward) for c in configs] == [
        (1, True), (1, False), (2, True), (2, False), (3, True), (3, False)]
    assert [c.id for c in configs] == list(range(6))
