"""Shared benchmark plumbing: models/gpt.py's GPT and its variants, timing, tables (launching: tests/distributed)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from fully_shard import MixedPrecisionPolicy, fully_shard  # noqa: E402
from fully_shard.tools.timing import synchronize, timed_step  # noqa: E402, F401
from fully_shard.tools.watch import KINDS, CollectiveWatch  # noqa: E402
from models.gpt import GPT, GPTConfig, loss_fn, synthetic_batch  # noqa: E402, F401
from tests.distributed.launch import init, launch_if_needed, rank0_print  # noqa: E402, F401

VARIANTS = ("ours", "torch", "ddp")  # this library, torch's fully_shard, DistributedDataParallel


def add_model_args(ap: argparse.ArgumentParser, *, dim: int, blocks: int, heads: int, seq: int, vocab: int) -> None:
    """``--dim --blocks --heads --seq --vocab`` with these defaults (``model_config`` reads them back)."""
    for name, default in (("dim", dim), ("blocks", blocks), ("heads", heads), ("seq", seq), ("vocab", vocab)):
        ap.add_argument(f"--{name}", type=int, default=default)


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, dim=args.dim, blocks=args.blocks, heads=args.heads, seq=args.seq)


def wrap_variant(model: nn.Module, name: str, *, bf16: bool = False, device: torch.device | None = None) -> nn.Module:
    """``model`` (a GPT, in place) under one variant: ``ours``/``torch`` shard every block, then the model
    (bf16 params and fp32 reductions with ``bf16``); ``ddp`` wraps it whole (on ``device``'s GPU)."""
    if name == "ours":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for blk in model.blocks:  # type: ignore[union-attr]  # the GPT's ModuleList
            fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    if name == "torch":
        tmp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else TorchMP()
        for blk in model.blocks:  # type: ignore[union-attr]
            torch_fully_shard(blk, mp_policy=tmp)
        torch_fully_shard(model, mp_policy=tmp)
        return model
    if name == "ddp":
        return DDP(model, device_ids=[device.index] if device is not None and device.type == "cuda" else None)
    raise SystemExit(f"unknown variant {name!r}: expected one of {', '.join(VARIANTS)}")


def train_step(name: str, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
               bf16: bool, device: torch.device) -> torch.Tensor:
    """Forward, backward, optimizer step; DDP in bf16 runs under autocast. Returns the (detached) loss."""
    if name == "ddp" and bf16:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
    else:
        loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def header(columns: str, note: str = "") -> str:
    """A table's column line (plus ``note``) over a rule as long as the columns."""
    return f"{columns}{note}\n{'-' * len(columns)}"




def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


# --- bytes per collective, at the dispatcher (traffic.py --hsdp, scaling.py) ---------------------------
class AxisBytes(CollectiveWatch):
    """``with AxisBytes() as c: ...``: ``c.records`` holds (kind, process group name, buffer bytes) of every
    c10d collective issued in the block, seen at the dispatcher: the gathered bytes of an all-gather, the
    input of a reduce-scatter, the tensor of an all-reduce (the profiler's convention). On gloo the library
    issues a 1-D reduce-scatter as an in-place all-reduce and says so in its trace (``issued_as``); those are
    counted as the reduce-scatters they stand for."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[list[Any]] = []

    def on_in_place_reduce_scatter(self) -> None:
        last = next(r for r in reversed(self.records) if r[0] == "all_reduce")  # issued just before
        last[0] = "reduce_scatter"

    def on_collective(self, op: str, args: tuple) -> None:
        groups = [dist.ProcessGroup.unbox(a).group_name for a in args if isinstance(a, torch.ScriptObject)
                  and "ProcessGroup" in str(a._type())]
        tensors = args[0] if op == "allreduce_" else [args[1] if op == "_reduce_scatter_base_" else args[0]]
        nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        self.records.append([KINDS.get(op, op), groups[0] if groups else "?", nbytes])
