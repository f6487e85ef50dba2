"""Scripts that run themselves on several ranks: re-launch under torchrun, join the process group, print once.

Shared by benchmarks/ and the parity checks run by hand in tests/manual/ (too many ranks for CI, or a
dependency CI does not install).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


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
    """Join the process group torchrun describes: NCCL on this rank's GPU when there is one, else gloo."""
    if torch.cuda.is_available() and backend != "gloo":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def rank0_print(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)
