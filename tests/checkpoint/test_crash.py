"""Crash safety: kill a rank at every I/O step of an overwriting save; the path must always load, whole.

Children are forked from the test process (torch already imported, so each costs milliseconds) and killed
with os._exit / SIGKILL: no cleanup code runs, exactly as in a real crash. After each crash the checkpoint
at ``path`` is loaded in this process (no process group) and must be one whole generation: the previous
one if the crash came before the commit point (renaming the old checkpoint aside), the new one after it.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fully_shard.checkpoint import safetensors_io as sio

CTX = mp.get_context("fork")
EVENTS = ("save_file", "fsync_path", "rename", "fsync", "mkdir", "rmtree")


def _arm(kill_at: int, torn: bool, log: list[str] | None = None) -> None:
    """Make the k-th I/O call of this process die first (``torn``: a save_file writes half a file, then dies)."""
    count = [0]
    originals: dict[str, Callable[..., Any]] = {
        "save_file": sio.save_file, "fsync_path": sio.fsync_path, "rename": os.rename, "fsync": os.fsync,
        "mkdir": os.mkdir, "rmtree": shutil.rmtree}

    def wrap(name: str) -> Callable[..., Any]:
        def hook(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            if log is not None:
                log.append(name)
            if count[0] == kill_at:
                if torn and name == "save_file":
                    originals[name](*args, **kwargs)
                    os.truncate(args[1], os.path.getsize(args[1]) // 2)
                os._exit(9)
            return originals[name](*args, **kwargs)
        return hook

    sio.save_file = wrap("save_file")  # type: ignore[assignment]
    sio.fsync_path = wrap("fsync_path")  # type: ignore[assignment]
    os.rename = wrap("rename")  # type: ignore[assignment]
    os.fsync = wrap("fsync")  # type: ignore[assignment]
    os.mkdir = wrap("mkdir")  # type: ignore[assignment]
    shutil.rmtree = wrap("rmtree")  # type: ignore[assignment]


def _fill(model: torch.nn.Module, gen: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).fill_(gen)


def _single_child(path: str, kill_at: int, torn: bool, conn: Any) -> None:
    torch.set_num_threads(1)
    from fully_shard import checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    log: list[str] = []
    _arm(kill_at, torn, log)
    _fill(model, 2.0)
    checkpoint.save(path, model, opt, extra={"gen": 2.0})
    conn.send(log)


def _load_gen(path: str, make: Callable[[], torch.nn.Module]) -> float:
    from fully_shard import checkpoint

    model = make()
    gen = checkpoint.load(path, model)["gen"]
    bad = [n for n, p in model.named_parameters() if not bool((p == gen).all())]
    assert not bad, f"checkpoint mixes generations: {bad} differ from {gen}"
    return float(gen)


def _small() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))


def _run_child(target: Callable[..., None], *args: Any) -> tuple[int | None, Any]:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(*args, child))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail("child hung")
    try:
        return proc.exitcode, parent.recv() if parent.poll() else None
    except EOFError:
        return proc.exitcode, None


def _warm_up() -> None:
    """Pay torch's lazy imports (optimizers import torch._dynamo) once here, not in every forked child."""
    model = _small()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()


def _reset(base: Path, path: str) -> None:
    """A clean slate: only generation 1 at ``path``, no debris from the previous crash."""
    for entry in os.listdir(base.parent):
        if entry != base.name:
            shutil.rmtree(base.parent / entry)
    shutil.copytree(base, path)


def test_kill_at_every_io_step_single_process(tmp_path: Path) -> None:
    from fully_shard import checkpoint

    _warm_up()
    base = tmp_path / "base"
    model = _small()
    _fill(model, 1.0)
    checkpoint.save(base, model, extra={"gen": 1.0})
    # Dry run: the sequence of I/O calls of an overwriting save.
    path = str(tmp_path / "ckpt")
    _reset(base, path)
    code, log = _run_child(_single_child, path, 10**9, False)
    assert code == 0 and log, (code, log)
    assert _load_gen(path, _small) == 2.0
    aside = next(i + 1 for i, name in enumerate(log) if name == "rename")  # the commit point
    outcomes = []
    for kill_at in range(1, len(log) + 1):
        for torn in (False, True) if log[kill_at - 1] == "save_file" else (False,):
            _reset(base, path)
            code, _ = _run_child(_single_child, path, kill_at, torn)
            assert code == 9, f"the child was not killed at I/O call {kill_at}"
            gen = _load_gen(path, _small)
            assert gen == (1.0 if kill_at <= aside else 2.0), (kill_at, log[kill_at - 1], gen)
            outcomes.append((log[kill_at - 1], torn, gen))
    assert {g for _, _, g in outcomes} == {1.0, 2.0}
    print(f"\n{len(outcomes)} crash points ({log}): {outcomes}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_child(rank: int, port: int, path: str, victim: int, kill_at: int, loop: bool, conn: Any) -> None:
    """One rank of a 2-rank job that overwrites ``path`` (generation 1) with generation 2, 3, ..."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from fully_shard import checkpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    model = _small()  # replicated plain tensors: the writer assignment spreads them over both ranks
    _fill(model, 1.0)
    checkpoint.save(path, model, extra={"gen": 1.0})
    dist.barrier()
    conn.send("ready")
    log: list[str] = []
    if rank == victim and kill_at:
        _arm(kill_at, torn=True, log=log)
    gen = 2.0
    while True:
        _fill(model, gen)
        checkpoint.save(path, model, extra={"gen": gen})
        if not loop:
            break
        gen += 1.0
    conn.send(log)
    dist.barrier()
    os._exit(0)


def _two_ranks(path: str, victim: int, kill_at: int = 0, sigkill_after: float | None = None) -> tuple[
        list[int | None], list[str]]:
    port = _free_port()
    pipes, procs = [], []
    for rank in range(2):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_rank_child,
                           args=(rank, port, path, victim, kill_at, sigkill_after is not None, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    for parent in pipes:
        assert parent.poll(120) and parent.recv() == "ready", "ranks did not start"
    if sigkill_after is not None:
        time.sleep(sigkill_after)
        os.kill(int(procs[victim].pid or 0), signal.SIGKILL)
    procs[victim].join(60)
    for proc in procs:  # the survivor is stuck in a collective with a dead peer: a crash takes the job down
        proc.join(0 if proc.exitcode is None and procs[victim].exitcode != 0 else 30)
        if proc.is_alive():
            proc.kill()
        proc.join()
    try:
        log = pipes[victim].recv() if pipes[victim].poll() else []
    except EOFError:  # the victim died before reporting
        log = []
    return [p.exitcode for p in procs], log


def test_kill_a_rank_mid_save_two_ranks(tmp_path: Path) -> None:
    _warm_up()
    # Dry run: rank 0's I/O calls in an overwriting save (to find the commit renames).
    codes, log = _two_ranks(str(tmp_path / "dry"), victim=0, kill_at=10**9)
    assert codes == [0, 0] and _load_gen(str(tmp_path / "dry"), _small) == 2.0, codes
    renames = [i + 1 for i, name in enumerate(log) if name == "rename"]
    assert len(renames) == 2, log
    # Rank 1 dies while writing its shard (a torn file): nothing is committed, generation 1 stays.
    path = str(tmp_path / "a")
    codes, _ = _two_ranks(path, victim=1, kill_at=1)
    assert codes[1] == 9, codes
    assert _load_gen(path, _small) == 1.0
    # Any debris (a .a.tmp-* directory, unless rank 0 saw its peer die and removed it first) is invisible to load.
    # Rank 0 dies between renaming the old checkpoint aside and renaming the new one in: load recovers.
    path = str(tmp_path / "b")
    codes, _ = _two_ranks(path, victim=0, kill_at=renames[1])
    assert codes[0] == 9, codes
    assert not os.path.exists(path)
    assert _load_gen(path, _small) == 2.0
    # Rank 0 dies just before the commit point: the complete new files are not a checkpoint.
    path = str(tmp_path / "c")
    codes, _ = _two_ranks(path, victim=0, kill_at=renames[0])
    assert codes[0] == 9, codes
    assert _load_gen(path, _small) == 1.0
    # SIGKILL of a random rank at a random moment of a loop of overwriting saves.
    rng = random.Random(int(os.environ.get("FS_CRASH_SEED", "0")))
    for trial in range(2):
        path = str(tmp_path / f"r{trial}")
        victim = rng.randrange(2)
        codes, _ = _two_ranks(path, victim=victim, sigkill_after=rng.uniform(0.1, 0.6))
        assert codes[victim] == -signal.SIGKILL, codes
        print(f"\nSIGKILL rank {victim}: loaded generation {_load_gen(path, _small)}")
