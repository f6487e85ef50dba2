"""Shared benchmark plumbing: self-launch under torchrun, the GPT model, timing and memory helpers."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from examples.train_gpt import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402, F401


def launch_if_needed(script: str, nproc: int, env: dict[str, str] | None = None) -> None:
    """Not under torchrun: re-run ``script`` with the same arguments on ``nproc`` local ranks and exit."""
    if "RANK" in os.environ:
        return
    from torch.distributed.run import main as torchrun

    os.environ.update(env or {})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    torchrun(["--standalone", f"--nproc_per_node={nproc}", script, *sys.argv[1:]])
    sys.exit(0)


def init(backend: str | None = None) -> torch.device:
    if torch.cuda.is_available() and backend != "gloo":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_max(fn: Callable[[], object], device: torch.device) -> float:
    """Run ``fn`` with all ranks starting together; the step time is the slowest rank's."""
    sync(device)
    dist.barrier()
    t = time.perf_counter()
    fn()
    sync(device)
    elapsed = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def rank0_print(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
