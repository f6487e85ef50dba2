"""Multi-rank test harness: W gloo ranks started once per world size and reused across tests.

A test written as ``@distributed(world_size=2)`` runs its body on every rank of a persistent pool of
spawned processes (one gloo process group per pool). Each call has a hard timeout: a rank that hangs
or dies gets the whole pool killed and restarted, and the test fails with every rank's traceback
instead of blocking CI. Rank functions must be module-level so the workers can import them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = float(os.environ.get("FS_TEST_TIMEOUT", "120"))
_RANK_FN_ATTR = "__rank_fn__"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, sys_path: list[str], conn: Any, backend: str) -> None:
    sys.path[:] = sys_path
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        modname, qualname, args, kwargs = msg
        try:
            obj: Any = importlib.import_module(modname)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            fn = getattr(obj, _RANK_FN_ATTR, obj)
            torch.manual_seed(0)
            result = fn(*args, **kwargs)
            conn.send(("ok", (result, _group_count())))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()


def _group_count() -> int:
    """How many process groups this rank has made by name (torch's counter: every rank must make them alike)."""
    from torch.distributed import distributed_c10d

    return int(distributed_c10d._world.group_count)


class RankPool:
    """``world`` spawned processes that each joined one gloo process group."""

    def __init__(self, world: int, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world = world
        self.key = (world, backend)
        self.conns = []
        self.procs = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, port, list(sys.path), child, backend), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for rank, conn in enumerate(self.conns):
            if not conn.poll(120):
                self.kill()
                raise RuntimeError(f"rank {rank} of a {world}-rank pool did not start within 120 s")
            conn.recv()

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        raw = getattr(fn, "__wrapped__", fn)
        msg = (raw.__module__, raw.__qualname__, args, kwargs)
        for conn in self.conns:
            conn.send(msg)
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * self.world
        groups: list[int | None] = [None] * self.world
        errors: dict[int, str] = {}
        pending = set(range(self.world))
        while pending:
            now = time.monotonic()
            if now > deadline:
                break
            for rank in sorted(pending):
                conn = self.conns[rank]
                if conn.poll(0.01):
                    status, value = conn.recv()
                    pending.discard(rank)
                    if status == "ok":
                        results[rank], groups[rank] = value
                    else:
                        errors[rank] = value
                elif not self.procs[rank].is_alive():
                    pending.discard(rank)
                    errors[rank] = f"rank {rank} died (exit code {self.procs[rank].exitcode})"
            if errors and pending:
                # A failed rank usually leaves its peers blocked in a collective: give them a short
                # grace period, then fail the test rather than wait for the full timeout.
                deadline = min(deadline, time.monotonic() + 5.0)
        if pending or errors:
            self.kill()
            _POOLS.pop(self.key, None)
            lines = [f"{fn.__qualname__} failed on {self.world} ranks:"]
            for rank in sorted(pending):
                lines.append(f"--- rank {rank}: no answer within the timeout ({timeout:.0f} s): hang?")
            for rank, tb in sorted(errors.items()):
                lines.append(f"--- rank {rank}:\n{tb}")
            raise AssertionError("\n".join(lines))
        if len(set(groups)) > 1:  # the pool is reused: its next world-wide new_group would hang, so fail here
            self.kill()
            _POOLS.pop(self.key, None)
            raise AssertionError(
                f"{fn.__qualname__} left its {self.world} ranks with different numbers of process groups made "
                f"(per rank: {groups}): some ranks made a group (a DeviceMesh, new_group) the others did not. "
                "Every rank of the world must make each group alike; make the mesh on every rank.")
        return results

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(5)
        self.kill()


_POOLS: dict[tuple[int, str], RankPool] = {}


def _pool(world: int, backend: str) -> RankPool:
    if (world, backend) not in _POOLS:
        _POOLS[(world, backend)] = RankPool(world, backend)
    return _POOLS[(world, backend)]


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S,
              backend: str = "gloo", **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` pool; return per-rank results."""
    return _pool(world_size, backend).call(fn, args, kwargs, timeout)


def distributed(world_size: int, timeout: float = DEFAULT_TIMEOUT_S,
                backend: str = "gloo") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a module-level test: its body runs on ``world_size`` ranks (gloo, or nccl for GPU
    tests) with a hard timeout. A helper (not named test*) returns the per-rank results; a test returns None."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        is_test = fn.__name__.startswith("test")

        @functools.wraps(fn)
        def test(*args: Any, **kwargs: Any) -> list[Any] | None:
            results = run_ranks(fn, world_size, *args, timeout=timeout, backend=backend, **kwargs)
            return None if is_test else results  # pytest wants None from a test; a helper gives the results

        setattr(test, _RANK_FN_ATTR, fn)
        return test

    return deco
