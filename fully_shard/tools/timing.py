"""Slowest-rank step time: every rank starts together, runs the step, and the max over ranks is kept."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(fn: Callable[[], object], device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """Seconds ``fn`` takes on the slowest rank of ``group``, from a barrier to the device's end of it."""
    synchronize(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed.item())
