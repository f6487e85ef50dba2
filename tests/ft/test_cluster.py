"""fully_shard.ft under the real torchft: 2 replica groups x 2 gloo ranks on 127.0.0.1, the lighthouse in
this process, ranks forked from a forkserver (examples/fault_tolerant.py's launcher), SIGKILLs at chosen
points. Every run has a deadline after which every rank is killed (a hang fails the test), and every rank
has its own watchdog.

- no failure: every step commits with both groups, the replicas are bitwise equal after every step and
  within 2e-5 of an unsharded model trained on the same global batches (one group built through torch's
  names after ``compat.patch_torch()``);
- one run kills a rank in its forward, its backward, the cross-replica all-reduce, the optimizer step,
  and during a heal: after each the survivors commit at quorum 1, the restarted group heals, and the
  replicas end bitwise equal (parameters and optimizer state);
- a joiner sharded another way gets ShardLayoutError and the survivor trains on as if it had been alone;
- ``init_sync=True`` with the synchronous quorum: replicas initialized differently are synced before step 0
  and every group's gradient counts in step 0.

Heavier variants (3 groups, 20 random kills, torch's fully_shard side by side, larger models) run from
``benchmarks/ft.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

os.environ.setdefault("RUST_LOG", "warn")  # before torchft's import (the launcher's): its Rust side logs quorums

from examples.fault_tolerant import (
    Cluster,
    Kill,
    Recipe,
    build_model,
    compare_replicas,
    dataset,
    make_optimizer,
    summarize,
)
from fully_shard.ft import StepSampler

TOL = 2e-5


def _run(recipe: Recipe, tmp_path: Path, deadline_s: float, **kwargs: Any) -> Any:
    lines: list[str] = []
    cluster = Cluster(recipe, tmp_path, echo=lines.append)
    try:
        report = cluster.run(deadline_s=deadline_s, **kwargs)
    finally:
        cluster.close()
    stderr = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("*.stderr"))
                       if "Error" in p.read_text())
    report.text = "\n".join(lines) + "\n" + stderr  # for the assertion messages
    assert not report.hung, report.text
    return report


def _reference(recipe: Recipe, contributors: list[list[int]],
               init: list[torch.Tensor] | None = None) -> list[list[torch.Tensor]]:
    """Unsharded: step ``s`` trains on the slots of the replica groups in ``contributors[s]``."""
    model = build_model(recipe)
    if init is not None:
        with torch.no_grad():
            for p, t in zip(model.parameters(), init):
                p.copy_(t)
    opt = make_optimizer(model, recipe)
    x, y = dataset(recipe)
    sampler = StepSampler(recipe.samples, batch_size=recipe.batch, replica_id=0, num_replica_groups=recipe.groups,
                          group_rank=0, group_world_size=recipe.ranks, seed=recipe.seed)
    out = []
    for step, replicas in enumerate(contributors):
        batch = sampler.global_batch(step)
        span = recipe.ranks * recipe.batch
        idx = [i for r in replicas for i in batch[r * span:(r + 1) * span]]
        opt.zero_grad()
        nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _full(report: Any, replica: int, recipe: Recipe) -> list[list[torch.Tensor]]:
    """Replica ``replica``'s parameters after every committed step, gathered from its ranks' row shards."""
    per_rank = [report.finals[(replica, rank)]["records"] for rank in range(recipe.ranks)]
    return [[torch.cat(shards) for shards in zip(*(rec["params"] for rec in step))] for step in zip(*per_rank)]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.timeout(280)
def test_no_failure_replicas_bitwise_equal_and_match_unsharded(tmp_path: Path) -> None:
    recipe = Recipe(steps=8, min_replicas=2, record=True, variants=("ours", "compat"), optimizer="sgd", lr=0.05)
    report = _run(recipe, tmp_path, 240)
    assert not report.errors and not report.kills, report.text
    steps = [e for e in report.events if e["ev"] == "step"]
    assert steps and all(e["committed"] and e["participants"] == 2 and e["contributed"] for e in steps), report.text
    for rank in range(recipe.ranks):  # bitwise equal after every step
        a, b = (report.finals[(r, rank)]["records"] for r in range(2))
        assert [rec["step"] for rec in a] == [rec["step"] for rec in b] == list(range(1, 9))
        for ra, rb in zip(a, b):
            assert all(torch.equal(x, y) for x, y in zip(ra["params"], rb["params"])), (rank, ra["step"])
    assert not compare_replicas(report, recipe)
    ours = _full(report, 0, recipe)
    ref = _reference(recipe, [[0, 1]] * 8)
    diffs = [_max_diff(o, r) for o, r in zip(ours, ref)]
    assert max(diffs) < TOL, diffs


@pytest.mark.timeout(420)
def test_kills_in_every_phase_survivors_go_on_and_the_restart_heals(tmp_path: Path) -> None:
    recipe = Recipe(hold=True, step_sleep=0.02)
    plan = [Kill(1, 0, "forward"), Kill(0, 1, "backward"), Kill(1, 1, "allreduce"), Kill(0, 0, "optimizer"),
            Kill(1, 0, "heal")]
    report = _run(recipe, tmp_path, 380, plan=plan)
    assert not report.errors, report.text
    problems = compare_replicas(report, recipe)
    assert not problems, "\n".join(problems) + "\n" + report.text
    phases = [k["phase"] for k in report.kills]
    assert phases == ["forward", "backward", "allreduce", "optimizer", "forward", "heal"], report.text
    rows = summarize(report, recipe.groups)
    for row in rows:  # the survivors commit without the killed group
        assert row["to_next_commit_s"] is not None and row["quorum_after"] == 1, (row, report.text)
    # every restarted group heals (but the one killed during its heal), every rank of it
    for restart in report.restarts:
        heals = {e["rank"] for e in report.events if e["ev"] == "heal" and e["replica"] == restart["replica"]
                 and e["incarnation"] == restart["incarnation"]}
        if any(k["phase"] == "heal" and k["incarnation"] == restart["incarnation"]
               and k["replica"] == restart["replica"] for k in report.kills):
            continue  # this incarnation was killed while its heal was arriving
        assert heals == {0, 1}, f"{restart}\n{report.text}"
    assert len(report.restarts) == 6 and sum(bool(r["healed_to_step"]) for r in rows) == 5
    final = report.finals[(0, 0)]["step"]
    assert final > max(k["step"] for k in report.kills)
    # AdamW's step count is the number of committed steps, on the survivors and the healed alike: the state
    # was made without a step, and a heal copies the peer's count
    for key, state in report.finals.items():
        counts = state["optim"][2::3]  # exp_avg, exp_avg_sq, step per parameter (sorted keys)
        assert {float(t) for t in counts} == {float(final)}, key


@pytest.mark.timeout(280)
def test_a_joiner_with_another_layout_gets_a_clear_error_and_the_survivor_is_untouched(tmp_path: Path) -> None:
    recipe = Recipe(hold=True, full_quorum=1, layouts=("rows", "cols"), record=True, step_sleep=0.02,
                    optimizer="sgd", lr=0.05)
    report = _run(recipe, tmp_path, 240, late={1: 3}, expect_failure=frozenset({1}))
    joiner = [e for e in report.all_errors if e["replica"] == 1]
    assert {e["rank"] for e in joiner} == {0, 1}, report.text
    for e in joiner:
        msg = e["msg"]
        assert msg.startswith("ShardLayoutError") and "laid out differently" in msg, msg
        assert "param:0.weight" in msg and "Shard(dim=0)" in msg and "Shard(dim=1)" in msg and "Fix:" in msg, msg
    assert not report.errors and not report.hung, report.text
    assert {key for key in report.finals} == {(0, 0), (0, 1)}
    # the survivor: every committed step its own batches only, as an unsharded model trained on them alone
    records = report.finals[(0, 0)]["records"]
    last = report.finals[(0, 0)]["step"]
    assert all(rec["contributed"] for rec in records) and [rec["step"] for rec in records] == list(range(1, last + 1))
    joined = min(e["t"] for e in report.events if e["replica"] == 1 and e["ev"] == "up")
    assert any(e["ev"] == "step" and e["replica"] == 0 and e["t"] > max(x["t"] for x in joiner) for e in report.events)
    assert joined < max(x["t"] for x in joiner)
    ref = _reference(recipe, [[0]] * last)
    diffs = [_max_diff(o, r) for o, r in zip(_full(report, 0, recipe), ref)]
    assert max(diffs) < TOL, diffs
    heals = [e for e in report.events if e["ev"] == "heal"]
    assert not heals, report.text


@pytest.mark.timeout(280)
def test_init_sync_with_the_sync_quorum_syncs_before_step_0_and_counts_every_group(tmp_path: Path) -> None:
    recipe = Recipe(steps=4, min_replicas=2, record=True, async_quorum=False, init_sync=True, init_seeds=(0, 7),
                    optimizer="sgd", lr=0.05)
    report = _run(recipe, tmp_path, 240)
    assert not report.errors, report.text
    assert not compare_replicas(report, recipe)
    first = [e for e in report.events if e["ev"] == "step" and e["step"] == 1]
    assert first and all(e["contributed"] and e["participants"] == 2 for e in first), report.text
    # torchft's step-0 sources: group rank g takes its shard from replica g % 2 (participants sorted by id)
    inits = [build_model(recipe, r) for r in range(2)]
    synced = []
    for a, b in zip(inits[0].parameters(), inits[1].parameters()):
        rows = a.detach().chunk(2)[0], b.detach().chunk(2)[1]
        synced.append(torch.cat(rows))
    ref = _reference(recipe, [[0, 1]] * 4, init=synced)
    diffs = [_max_diff(o, r) for o, r in zip(_full(report, 0, recipe), ref)]
    assert max(diffs) < TOL, diffs

