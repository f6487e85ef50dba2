"""What the GPU check's parts share: sizes, the device, sharding a GPT with either library, result files."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20
VARIANTS = ("fsdp", "hsdp", "reshard_2", "cpu_offload")  # part 1's world-8 variants


@dataclass(frozen=True)
class Sizes:
    mem_cfg: GPTConfig
    mem_batch: int
    csan_cfg: GPTConfig  # the sanitizer's Python-level bookkeeping per op makes big steps slow
    step_cfg: GPTConfig
    step_batch: int
    step_warmup: int
    step_steps: int
    delay_cfg: GPTConfig  # the delay check: small, every step delayed per collective
    host_cfg: GPTConfig  # the launch-bound model: host time, not GPU time, is the step
    host_batch: int
    offload_cfg: GPTConfig


def sizes(args: argparse.Namespace) -> Sizes:
    if args.cpu_dry_run:
        tiny = GPTConfig(vocab=256, dim=64, blocks=2, heads=4, seq=32)
        return Sizes(tiny, 2, tiny, tiny, 2, 1, 1 if args.quick else 3, tiny, tiny, 2, tiny)
    small = GPTConfig(vocab=4096, dim=256, blocks=4, heads=4, seq=256)
    host = GPTConfig(vocab=1024, dim=128, blocks=12, heads=4, seq=64)
    if args.quick:
        return Sizes(small, 2, small, GPTConfig(vocab=8192, dim=512, blocks=4, heads=8, seq=512), 4, 2, 4,
                     small, host, 2, small)
    return Sizes(GPTConfig(vocab=32000, dim=1024, blocks=8, heads=16, seq=1024), 4,
                 GPTConfig(vocab=8192, dim=512, blocks=4, heads=8, seq=512),
                 GPTConfig(vocab=32000, dim=2048, blocks=18, heads=16, seq=2048), args.batch, 3, 10,
                 GPTConfig(vocab=8192, dim=512, blocks=4, heads=8, seq=256), host, 2,
                 GPTConfig(vocab=32000, dim=1024, blocks=8, heads=16, seq=1024))


def device_of(args: argparse.Namespace) -> torch.device:
    if args.cpu_dry_run:
        return torch.device("cpu")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]


def mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f}"


def shard(model: GPT, lib: str, mesh: Any, reshard: bool | int | None, offload: bool, cuda: bool, *,
          mp: bool = True) -> GPT:
    """``model``'s blocks and root as units of this library (``lib="ours"``) or torch's ``fully_shard``,
    bf16 parameters with fp32 reductions unless ``mp`` is False."""
    if lib == "ours":
        from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # type: ignore[no-redef]
    kw: dict[str, Any] = {"mesh": mesh}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if reshard is not None:  # None: each library's default (blocks reshard, the root keeps its parameters)
        kw["reshard_after_forward"] = reshard
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy() if cuda else CPUOffloadPolicy(pin_memory=False)
    for blk in model.blocks:
        fully_shard(blk, **kw)  # type: ignore[operator]
    fully_shard(model, **kw)  # type: ignore[operator]
    return model


def mesh_for(variant: str, device_type: str, world: int) -> Any:
    """The mesh of a variant: HSDP on (2, world / 2) (``(1, 1)`` at world 1), else 1-D."""
    from torch.distributed.device_mesh import init_device_mesh

    if variant == "hsdp":
        replicate = 2 if world > 1 else 1
        return init_device_mesh(device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,))
