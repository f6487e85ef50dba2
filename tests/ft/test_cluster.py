"""fully_shard.ft under the real torchft: replica groups of gloo ranks on 127.0.0.1, the lighthouse in this
process, ranks forked from a forkserver (examples/fault_tolerant.py's launcher) or run by torchrun, SIGKILLs
at chosen points. Every run has a deadline after which every rank is killed (a hang fails the test), and
every rank has its own watchdog.

- no failure (2 groups x 2 ranks): every step commits with both groups, the replicas are bitwise equal
  after every step and within 2e-5 of an unsharded model trained on the same global batches (one group
  built through torch's names after ``compat.patch_torch()``);
- 3 groups x 2 ranks, a rank killed in its backward, the cross-replica all-reduce, the optimizer step, in
  its forward and then again during the restart's heal, in its forward and then the live peer it heals
  from as that one starts sending: after each the survivors commit without it, the restarted groups heal,
  the replicas end bitwise equal (parameters and optimizer state), and every committed step is within
  2e-5 of an unsharded model trained on the batches of the groups that contributed to it;
- a group run by ``torchrun --max-restarts``: a rank killed, torchrun restarts the group, it heals;
- a 2-D mesh (HSDP 2 x 2) inside each of 2 groups: a kill, a heal, bitwise equal, the reference;
- a joiner sharded another way gets ShardLayoutError and the survivor trains on as if it had been alone;
- ``init_sync=True`` with the synchronous quorum: replicas initialized differently are synced before step 0
  and every group's gradient counts in step 0.

Heavier variants (20 random kills, torch's fully_shard side by side, larger models) run from
``benchmarks/ft.py``.
"""

from __future__ import annotations

import itertools
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
    contributions,
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
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("torchrun_*.log")))
    report.text = "\n".join(lines) + "\n" + stderr + logs  # for the assertion messages
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
    """Replica ``replica``'s parameters after every committed step of its last incarnation, gathered from
    the row shards of its ranks on the first row of its mesh (HSDP: the other rows hold the same shards)."""
    shards = recipe.mesh_shape()[-1]
    per_rank = [report.finals[(replica, rank)]["records"] for rank in range(shards)]
    return [[torch.cat(parts) for parts in zip(*(rec["params"] for rec in step))] for step in zip(*per_rank)]


def _steps(report: Any, replica: int) -> list[int]:
    return [rec["step"] for rec in report.finals[(replica, 0)]["records"]]


def _every_step_or_healed(report: Any, replica: int) -> None:
    """``replica`` committed every step from 1 to its last, except where it healed: a peer's commit it missed (its
    own attempt failed when a killed group broke the step's collectives) arrives in the heal, as torchft does."""
    steps = _steps(report, replica)
    healed = {e["step"] for e in report.events if e["ev"] == "heal" and e["replica"] == replica}
    assert steps and steps[0] == 1 and steps[-1] == report.finals[(replica, 0)]["step"], (steps, report.text)
    gaps = [(a, b) for a, b in itertools.pairwise(steps) if b != a + 1 and b not in healed]
    assert not gaps, (f"replica {replica} skipped steps without a heal: {gaps}; healed at {sorted(healed)}",
                      report.text)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _against_reference(report: Any, recipe: Recipe) -> dict[int, float]:
    """Every replica's parameters after each committed step of its last incarnation vs an unsharded model
    trained on the batches of the groups that contributed to each step: the worst difference per replica."""
    per_step = contributions(report)
    last = max(per_step)
    assert sorted(per_step) == list(range(1, last + 1)), sorted(per_step)
    ref = _reference(recipe, [per_step[s] for s in range(1, last + 1)])
    return {replica: max(_max_diff(params, ref[step - 1])
                         for step, params in zip(_steps(report, replica), _full(report, replica, recipe)))
            for replica in range(recipe.groups)}


def _source_joiner_incarnation(report: Any) -> int:
    """The incarnation of the group whose heal lost its source: the restart after its forward kill."""
    source = next(i for i, k in enumerate(report.kills) if k["phase"] == "source")
    victim = report.kills[source - 1]  # killed in its forward, just before
    return int(victim["incarnation"]) + 1


def _every_restart_healed(report: Any, recipe: Recipe, but: frozenset[tuple[int, int]] = frozenset()) -> None:
    """Each restarted incarnation (but those in ``but``: killed during their heal) healed on every rank."""
    for restart in report.restarts:
        key = (restart["replica"], restart["incarnation"])
        if key in but:
            continue
        heals = {e["rank"] for e in report.events if e["ev"] == "heal" and (e["replica"], e["incarnation"]) == key}
        assert len(heals) == recipe.ranks, f"{restart}: heals on ranks {heals}\n{report.text}"


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


@pytest.mark.timeout(300)
def test_kills_in_every_phase_with_3_groups_survivors_go_on_restarts_heal_and_match_the_reference(
        tmp_path: Path) -> None:
    recipe = Recipe(groups=3, hold=True, step_sleep=0.02, record=True, optimizer="sgd", lr=0.05)
    # replica 0 is never killed; "heal": replica 1 is killed in its forward, then again during its restart's
    # heal; "source": replica 2 in its forward, then replica 1 rank 1, its rank 1's source, as it sends
    plan = [Kill(1, 1, "backward"), Kill(2, 0, "allreduce"), Kill(1, 0, "optimizer"), Kill(1, 0, "heal"),
            Kill(2, 1, "source")]
    report = _run(recipe, tmp_path, 260, plan=plan)
    assert not report.errors, report.text
    problems = compare_replicas(report, recipe)
    assert not problems, "\n".join(problems) + "\n" + report.text
    kills = [(k["replica"], k["rank"], k["phase"]) for k in report.kills]
    assert kills == [(1, 1, "backward"), (2, 0, "allreduce"), (1, 0, "optimizer"), (1, 0, "forward"), (1, 0, "heal"),
                     (2, 1, "forward"), (1, 1, "source")], report.text
    for row in summarize(report, recipe.groups):  # the survivors commit without the killed group
        assert row["to_next_commit_s"] is not None and row["quorum_after"] < 3, (row, report.text)
    assert len(report.restarts) == 7, report.text
    heal_killed = next(k for k in report.kills if k["phase"] == "heal")
    _every_restart_healed(report, recipe, but=frozenset({(1, heal_killed["incarnation"])}))
    # the joiner whose rank 1 lost its source: its rank 0 received its state, but the group's vote failed and
    # nothing was written; both ranks healed later, at once, from the groups left (all or nothing)
    source_kill = next(k for k in report.kills if k["phase"] == "source")
    joiner = [e for e in report.events if e["replica"] == 2 and e["incarnation"] == _source_joiner_incarnation(report)]
    received = [e for e in joiner if e["ev"] == "recv" and e["rank"] == 0]
    healed = [e for e in joiner if e["ev"] == "heal"]
    assert len(received) >= 2 and sorted(e["rank"] for e in healed) == [0, 1], report.text
    assert len({e["step"] for e in healed}) == 1 and min(e["t"] for e in healed) > source_kill["t"], report.text
    assert report.finals[(0, 0)]["step"] > max(k["step"] for k in report.kills)
    # the loss goes on as without failures: each committed step is the unsharded step on the contributors' batches
    per_step = contributions(report)
    assert min(len(groups) for groups in per_step.values()) == 1 and max(len(g) for g in per_step.values()) == 3
    worst = _against_reference(report, recipe)
    assert max(worst.values()) < TOL, worst
    _every_step_or_healed(report, 0)  # replica 0 (never killed): every step, or healed past the one it missed


@pytest.mark.timeout(300)
def test_torchrun_restarts_a_killed_group_and_it_heals(tmp_path: Path) -> None:
    # (a slower step: the survivor trains alone while torchrun starts new processes, which import torch)
    recipe = Recipe(hold=True, step_sleep=0.1, record=True, launchers=("fork", "torchrun"))  # AdamW
    report = _run(recipe, tmp_path, 260, plan=[Kill(1, 0, "backward")])
    assert not report.errors, report.text
    assert not compare_replicas(report, recipe), report.text
    assert [(k["replica"], k["incarnation"], k["phase"]) for k in report.kills] == [(1, 0, "backward")], report.text
    assert [(r["replica"], r["incarnation"]) for r in report.restarts] == [(1, 1)], report.text
    up = {e["pid"] for e in report.events if e["ev"] == "up" and e["replica"] == 1}
    assert len(up) == 4, report.text  # torchrun started 2 ranks, then 2 new processes
    _every_restart_healed(report, recipe)
    (row,) = summarize(report, recipe.groups)
    assert row["to_next_commit_s"] is not None and row["quorum_after"] == 1
    worst = _against_reference(report, recipe)
    assert max(worst.values()) < TOL, worst
    # AdamW's step count is the number of committed steps, on the survivor and the healed alike: the state
    # was made without a step, and a heal copies the peer's count
    final = report.finals[(0, 0)]["step"]
    for key, state in report.finals.items():
        counts = state["optim"][2::3]  # exp_avg, exp_avg_sq, step per parameter (sorted keys)
        assert {float(t) for t in counts} == {float(final)}, key


@pytest.mark.timeout(300)
def test_a_2d_mesh_inside_each_replica_group(tmp_path: Path) -> None:
    recipe = Recipe(ranks=4, mesh=(2, 2), hold=True, step_sleep=0.02, record=True, optimizer="sgd", lr=0.05)
    report = _run(recipe, tmp_path, 260, plan=[Kill(0, 3, "allreduce")])
    assert not report.errors, report.text
    assert not compare_replicas(report, recipe), report.text
    assert [(k["replica"], k["rank"], k["phase"]) for k in report.kills] == [(0, 3, "allreduce")], report.text
    _every_restart_healed(report, recipe)
    (row,) = summarize(report, recipe.groups)
    assert row["to_next_commit_s"] is not None and row["quorum_after"] == 1
    # HSDP inside the group: the ranks of a mesh column hold the same shards, here and in the healed group
    for replica in range(2):
        for rank in range(2):
            a, b = report.finals[(replica, rank)], report.finals[(replica, rank + 2)]
            assert all(torch.equal(x, y) for x, y in zip(a["params"] + a["optim"], b["params"] + b["optim"]))
    worst = _against_reference(report, recipe)
    assert max(worst.values()) < TOL, worst


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

