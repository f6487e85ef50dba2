"""One rank of the sweep (the elastic launcher's entrypoint): build, shard, time and profile each config.

Each configuration runs in its own process group; afterwards the ranks agree through the rendezvous
store (not a collective: a failed rank may have left its peers inside one). A rank that cannot agree
exits, and the parent (``sweep.py``) relaunches the configurations still pending.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.elastic.multiprocessing.errors import record

from ...core.policy import MixedPrecisionPolicy
from ..memory import current_memory
from ..profile import Profiler, profile
from ..timing import synchronize, timed_step
from .config import RECORDS, LaunchSpec, TuneConfig
from .factories import call_batch, default_loss, find_blocks, load_object, shard_by_granularity, to_device


@dataclass(frozen=True)
class _Rank:
    """What every configuration of one launch shares on this rank."""

    spec: LaunchSpec
    rank: int
    world: int
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    store: dist.Store
    model_fn: Callable[[], Any]
    batch_fn: Callable[..., Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    mp: MixedPrecisionPolicy | None

    @property
    def use_cuda(self) -> bool:
        return self.device.type == "cuda"

    def write(self, event: dict[str, Any]) -> None:
        """Append one event to this rank's records (the parent reads them after the launch)."""
        with open(Path(self.spec["work_dir"]) / RECORDS.format(rank=self.rank), "a") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()

    def agree(self, tag: str, status: str) -> None:
        """Wait until every rank is done with ``tag``; if one is gone or stuck, leave: the parent relaunches."""
        key = f"fully_shard.tune/{self.spec['attempt']}/{tag}"
        self.store.set(f"{key}/{self.rank}", status)
        try:
            self.store.wait([f"{key}/{r}" for r in range(self.world)],
                            datetime.timedelta(seconds=float(self.spec["agree_timeout_s"])))
        except Exception:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(17)

    def new_group(self) -> dist.ProcessGroup:
        return dist.new_group(backend=self.backend, timeout=self.timeout)


def worker(spec: LaunchSpec) -> int:
    """The launcher's entrypoint: an exception outside a configuration reaches the parent."""
    return int(record(run_worker)(spec) or 0)


def run_worker(spec: LaunchSpec) -> int:
    """One rank of the sweep: runs every pending configuration, then leaves the process group."""
    rank = _start_rank(spec)
    configs = [TuneConfig(**raw) for raw in spec["configs"]]
    if configs and not rank.use_cuda:
        _warm_up(rank, configs[0])
    for cfg in configs:
        _run_config(rank, cfg)
    rank.write({"id": -1, "event": "barrier", "t": time.time()})
    dist.barrier()
    rank.write({"id": -1, "event": "destroy", "t": time.time()})
    dist.destroy_process_group()
    rank.write({"id": -1, "event": "exit", "t": time.time()})
    return 0


def _start_rank(spec: LaunchSpec) -> _Rank:
    for p in spec.get("sys_path", []):
        if p not in sys.path:
            sys.path.insert(0, p)
    use_cuda = torch.cuda.is_available() and spec.get("device") != "cpu"
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(int(spec.get("threads", 1)))
        with contextlib.suppress(OSError, AttributeError):  # forked ranks: what MALLOC_MMAP_THRESHOLD_=65536
            ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # does at startup (M_MMAP_THRESHOLD): RSS ~ live
    timeout = datetime.timedelta(seconds=float(spec["timeout_s"]))
    # the env:// rendezvous init_process_group would do, kept: its store is where the ranks agree
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    loss = spec.get("loss")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if spec.get("bf16") else None
    return _Rank(spec, rank, world, device, backend, timeout, store, model_fn=load_object(spec["model"], "model"),
                 batch_fn=load_object(spec["batch"], "batch"),
                 loss_fn=load_object(loss, "loss") if loss else default_loss, mp=mp)


def _warm_up(rank: _Rank, cfg: TuneConfig) -> None:
    """One unmeasured step first: one-time allocations (thread pools, comm buffers) are not memory."""
    rank.write({"id": cfg.id, "event": "start", "t": time.time()})
    group = rank.new_group()
    with contextlib.suppress(Exception):  # a crash here is charged to the first configuration
        _measure(rank, cfg, group, 0, warmup=1, steps=0)
    rank.agree("warmup", "done")


def _run_config(rank: _Rank, cfg: TuneConfig) -> None:
    rank.write({"id": cfg.id, "event": "start", "t": time.time()})
    group = rank.new_group()
    _release_memory(rank.use_cuda)
    baseline = 0 if rank.use_cuda else current_memory(rank.device)
    result: dict[str, Any] = {"id": cfg.id, "event": "end", "rank": rank.rank}
    try:
        result.update(_measure(rank, cfg, group, baseline, warmup=int(rank.spec["warmup"]),
                               steps=int(rank.spec["steps"])))
    except BaseException as e:  # a bad configuration must not end the sweep
        kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
        result["error"] = f"{kind}: {e}".strip()[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
    result["t"] = time.time()
    rank.write(result)
    rank.agree(str(cfg.id), "error" if "error" in result else "ok")
    if "error" not in result:  # on error it is abandoned: its sequence numbers may disagree
        dist.destroy_process_group(group)
    del group
    gc.collect()


def _release_memory(use_cuda: bool) -> None:
    """Free what the previous configuration left: Python garbage, the CUDA cache, glibc's free heap."""
    gc.collect()
    if use_cuda:
        torch.cuda.empty_cache()
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _measure(rank: _Rank, cfg: TuneConfig, group: dist.ProcessGroup, baseline: int, *, warmup: int,
             steps: int) -> dict[str, Any]:
    """Build and shard ``cfg``, run ``warmup`` steps, then time and profile ``steps`` (none: ``{}``)."""
    model, units = _build(rank, cfg, group)
    step = _train_step(rank, model)
    for _ in range(warmup):
        step()
    synchronize(rank.device)
    if steps == 0:
        return {}
    times: list[float] = []
    with profile(model) as prof:
        for _ in range(steps):
            times.append(timed_step(step, rank.device, group))
            prof.step()
    return {"units": units, "step_times_s": times, **_across_ranks(prof, baseline, group, rank.device)}


def _build(rank: _Rank, cfg: TuneConfig, group: dist.ProcessGroup) -> tuple[nn.Module, int]:
    """The model from the factory, ``cfg.blocks_per_unit`` blocks per unit; returns it and its unit count."""
    mesh = DeviceMesh.from_group(group, rank.device.type)
    torch.manual_seed(0)
    model = rank.model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {rank.spec['model']} returned {type(model).__name__}; expected an nn.Module")
    blocks = find_blocks(model, rank.spec.get("blocks"))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if rank.mp is not None:
        kwargs["mp_policy"] = rank.mp
    units = shard_by_granularity(model, blocks, cfg.blocks_per_unit,
                                 reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    block_units = -(-len(blocks) // cfg.blocks_per_unit)
    if units != block_units + 1:
        raise RuntimeError(f"expected {block_units} block units + the root for "
                           f"{cfg.label}, found {units} units (are other modules of the block class outside "
                           "the blocks? Fix: pass --blocks <ModuleList name>)")
    return model, units


def _train_step(rank: _Rank, model: nn.Module) -> Callable[[], None]:
    """One AdamW step on the factory's batch (``(inputs, targets)`` or ``inputs``)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = to_device(call_batch(rank.batch_fn, rank.rank), rank.device)
    inputs, targets = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)

    def step() -> None:
        loss = rank.loss_fn(model(*args), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _across_ranks(prof: Profiler, baseline: int, group: dist.ProcessGroup, device: torch.device) -> dict[str, Any]:
    """Every rank's peak above ``baseline``, and the communication shares averaged over the ranks."""
    # the profiler starts a new peak window every step: the peak of the run is the largest step's
    peak = max(0, max(st.peak_memory for st in prof.steps) - baseline)
    summary = prof.summary()
    world = dist.get_world_size(group)
    peaks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([peak], dtype=torch.int64, device=device), group=group)
    share = torch.tensor([summary["comm_share"], summary["comm_busy_share"]], dtype=torch.float64, device=device)
    dist.all_reduce(share, group=group)
    return {"peak_bytes_per_rank": [int(p.item()) for p in peaks], "comm_share": float(share[0]) / world,
            "comm_busy_share": float(share[1]) / world, "bytes_over_model": summary["bytes_over_model"]}
