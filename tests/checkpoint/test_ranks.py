"""Ranks that disagree fail fast, on every rank, with a message about the checkpoint.

Disagreements where every rank still calls the checkpoint (different paths, an extra buffer, an
optimizer on one rank only) run in the shared rank pool and must leave it usable. Ranks that never
arrive (idle, training, in a barrier, skipped the call) run in freshly forked 2-rank jobs with a short
``timeout``: the rank inside save/load must raise within a bound, naming the phase and the missing rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fully_shard import checkpoint
from fully_shard.checkpoint import CheckpointError
from tests.checkpoint import common as C
from tests.distributed.harness import distributed

TIMEOUT = 2.0
CTX = mp.get_context("fork")


def _fresh(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = C.shard(C.make_gpt(seed=seed, n_blocks=1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _error(fn: Any) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return ""


@distributed(world_size=2)
def _disagreements(tmp: str) -> dict[str, str]:
    rank = dist.get_rank()
    model, opt = _fresh()
    C.train(model, opt, 0, 1)
    good = os.path.join(tmp, "good")
    checkpoint.save(good, model, opt)
    out = {
        "save to different paths": _error(lambda: checkpoint.save(os.path.join(tmp, f"p{rank}"), model, opt)),
        "load from different paths": _error(lambda: checkpoint.load(good if rank == 0 else tmp, model, opt)),
        "optimizer passed to load on one rank only": _error(
            lambda: checkpoint.load(good, model, opt if rank == 0 else None)),
        "optimizer passed to save on one rank only": _error(
            lambda: checkpoint.save(os.path.join(tmp, "o"), model, opt if rank == 0 else None)),
    }
    before = C.full_state(model)
    if rank == 1:
        model.register_buffer("only_here", torch.ones(3))
    out["an extra buffer on one rank"] = _error(lambda: checkpoint.save(os.path.join(tmp, "b"), model, opt))
    if rank == 1:
        del model.only_here
    # Nothing was written, nothing changed, and the ranks still checkpoint together.
    assert sorted(n for n in os.listdir(tmp) if not n.startswith(".")) == ["good"], os.listdir(tmp)
    C.assert_same(C.full_state(model), before, "model after the failed calls")
    checkpoint.save(os.path.join(tmp, "after"), model, opt)
    checkpoint.load(os.path.join(tmp, "after"), model, opt)
    return out


EXPECTED = {
    "save to different paths": ["are in another checkpoint call", "fix"],
    "load from different paths": ["are in another checkpoint call", "fix"],
    "optimizer passed to load on one rank only": ["optimizer passed: rank(s) 1 differ", "fix"],
    "optimizer passed to save on one rank only": ["optimizer passed: rank(s) 1 differ", "fix"],
    "an extra buffer on one rank": ["model structure: rank(s) 1 differ", "only on rank 1: ['only_here']", "fix"],
}


def test_disagreeing_ranks_fail_on_every_rank(tmp_path: Path) -> None:
    per_rank = _disagreements(str(tmp_path))
    for name, fragments in EXPECTED.items():
        assert per_rank[0][name] == per_rank[1][name], f"{name}: ranks raised different errors"
        for fragment in fragments:
            assert fragment in per_rank[0][name], f"{name}: {fragment!r} not in:\n{per_rank[0][name]}"


# ---- ranks that never arrive: fresh forked 2-rank jobs.

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, tmp: str, scenario: str, conn: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    model = torch.nn.Linear(4, 3)
    first_call, caller, other = scenario.split(":")
    if first_call == "warm":  # the usual case: the job has checkpointed before
        checkpoint.save(os.path.join(tmp, "warm"), model)
    start = time.monotonic()
    message = ""
    if rank == int(caller):
        try:
            if other == "load":  # the other rank never loads
                checkpoint.load(os.path.join(tmp, "warm"), model, timeout=TIMEOUT)
            else:
                checkpoint.save(os.path.join(tmp, "x"), model, timeout=TIMEOUT)
        except CheckpointError as e:
            message = str(e)
        conn.send((message, time.monotonic() - start))
    elif other == "barrier":
        dist.barrier()  # the peer trains / waits in a collective: it stays there (not ours to end)
    else:
        time.sleep(4 * TIMEOUT + 2)  # idle, or skipped the call after an exception
    os._exit(0)


@pytest.mark.parametrize("scenario", [
    "warm:1:idle",  # rank 1 saves, rank 0 does not
    "warm:0:idle",  # rank 0 saves, rank 1 does not
    "warm:0:load",  # a load on rank 0 only
    "warm:0:barrier",  # rank 0 saves while rank 1 waits in a training collective
    "cold:1:idle",  # the job's first checkpoint call, on rank 1 only
])
def test_a_rank_that_never_arrives_is_named_within_the_timeout(tmp_path: Path, scenario: str) -> None:
    port = _free_port()
    caller = int(scenario.split(":")[1])
    pipes, procs = [], []
    for rank in range(2):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_rank, args=(rank, port, str(tmp_path), scenario, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        assert pipes[caller].poll(60), f"{scenario}: the calling rank hung"
        message, elapsed = pipes[caller].recv()
    finally:
        for proc in procs:
            proc.join(1 if proc.pid != procs[caller].pid else 10)
            if proc.is_alive():
                proc.kill()
            proc.join()
    print(f"\n{scenario}: failed after {elapsed:.1f} s: {message.splitlines()[0][:200]}")
    missing = 1 - caller
    assert message, f"{scenario}: no error"
    assert elapsed < 3 * TIMEOUT + 3, (scenario, elapsed)
    assert "checkpoint." in message and "fix" in message, message
    assert f"rank(s) {missing} did not arrive" in message or f"rank {missing} did not" in message \
        or "not every rank started a checkpoint call" in message, message
