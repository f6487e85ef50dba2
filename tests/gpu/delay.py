"""Part delay of the GPU check: every collective delayed on its stream; bitwise equal to a run without concurrency.

Before each collective the library issues, ``torch.cuda._sleep`` runs on the collective's stream (the
stream current when the collective is called: the library issues it inside ``with stream``). Work that
is not ordered after the collective (a missing wait, an event recorded too early, a buffer freed or
reused while the collective still reads it, a ``resize_`` free) then runs while the collective has not
run yet, and the results change. The reference is the same run under ``CUDA_LAUNCH_BLOCKING=1``, where
every kernel ends before the next is launched; parameters after 3 steps must be bitwise equal. This is
the method of torch's own FSDP2 overlap tests (test_fully_shard_overlap.py patches
``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` with a sleep first). It sees what the
stream stand-in cannot (NCCL's own kernels, the real allocator) and what the CUDA sanitizer forgets (a
block's history across a free). Two identical runs in one process must be bitwise equal too, or the
comparison would mean nothing.

Two worlds, each a child per mode (concurrent, then ``CUDA_LAUNCH_BLOCKING=1``):

* ``nccl``: world 1 on NCCL with ``collectives.issue_at_world_one(True)``, so the library's all-gathers
  and reduce-scatters are NCCL kernels on its side streams (one rank skips them by default, as torch's
  FSDP does): FSDP, HSDP on a (1, 1) mesh (its all-reduce too), CPU offload, and an expert-parallel unit
  (expert weights as ``ep`` DTensors, the token dispatch's collectives; one group per unit at world 1).
* ``fake``: world 8 on torch's fake process group, each collective replaced by a kernel on its stream
  that reads its input and writes its output as if every rank held this rank's data (the fake backend
  writes nothing on some torch versions: its outputs would be uninitialized memory): FSDP, HSDP (2, 4),
  ``reshard_after_forward=2``, CPU offload and the expert-parallel unit on (efsdp 4, ep 2), a dense and
  an expert group per unit.

The library is put on ``torch.distributed``'s functions (``collectives.direct_calls(False)``) so that the
patched functions see every collective. On the CPU dry run nothing sleeps and ``CUDA_LAUNCH_BLOCKING`` means
nothing: the same code runs (gloo at world 1) and the comparisons must hold trivially.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fully_shard.comm import collectives
from models.gpt import GPT, loss_fn, synthetic_batch
from tests.gpu.common import device_of, error_text, log, mesh_for, shard, sizes, write_json
from tests.gpu.report import Report

WORLDS = {"nccl": ("fsdp", "hsdp", "cpu_offload", "experts"),
          "fake": ("fsdp", "hsdp", "reshard_2", "cpu_offload", "experts")}
STEPS = 3
PATCHED = ("all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor",
           "reduce_scatter_single", "all_reduce")


def cycles_per_ms() -> float:
    """``torch.cuda._sleep``'s cycles per millisecond on this GPU (as torch's ``get_cycles_per_ms``)."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


class Delays:
    """While entered: ``torch.distributed``'s collectives sleep ``cycles`` on the current stream first (on the
    GPU), and count per kind; with ``simulate`` they do not call the backend but run as kernels of identical
    ranks (the fake world)."""

    def __init__(self, cycles: int, simulate: bool) -> None:
        self.cycles = cycles
        self.simulate = simulate
        self.counts: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    def _sleep(self) -> None:
        if self.cycles:
            torch.cuda._sleep(self.cycles)

    def __enter__(self) -> Delays:
        for name in PATCHED:
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind = "all_gather" if "gather" in name else "reduce_scatter" if "scatter" in name else "all_reduce"
        simulated = getattr(self, f"_{kind}") if self.simulate else None

        def collective(*args: Any, **kwargs: Any) -> Any:
            self.counts[kind] += 1
            self._sleep()
            if simulated is None:
                return original(*args, **kwargs)
            simulated(*args, **kwargs)
            return None  # (asynchronous callers treat None as done: CommContext.issued)

        return collective

    # identical ranks: every rank holds this rank's data
    @staticmethod
    def _all_gather(output: Any, input: torch.Tensor, group: Any = None, async_op: bool = False) -> None:
        world = dist.get_world_size(group)
        if isinstance(output, list):  # dist.all_gather(tensor_list, tensor)
            for out in output:
                out.copy_(input)
            return
        source = input.reshape(1, -1).clone()  # (in place: the input is a segment of the output)
        output.view(world, -1).copy_(source.expand(world, -1))

    @staticmethod
    def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                        async_op: bool = False) -> None:
        world = dist.get_world_size(group)
        output.copy_(input.view(world, -1)[dist.get_rank(group)].view_as(output))
        if op == dist.ReduceOp.SUM:
            output.mul_(world)

    @staticmethod
    def _all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                    async_op: bool = False) -> None:
        tensor.mul_(dist.get_world_size(group) if op == dist.ReduceOp.SUM else 1)


@contextlib.contextmanager
def library_on_torch_functions(world: int) -> Iterator[None]:
    """The library calls ``torch.distributed``'s functions (which ``Delays`` patches) and, at world 1,
    issues its collectives."""
    direct = collectives.direct_calls(False)
    at_one = collectives.issue_at_world_one(world == 1)
    try:
        yield
    finally:
        collectives.direct_calls(direct)
        collectives.issue_at_world_one(at_one)


def build(variant: str, world: int, device: torch.device, args: argparse.Namespace
          ) -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor]]:
    """The model of ``variant``, sharded, and its loss for step ``i``."""
    cuda = device.type == "cuda"
    if variant == "experts":
        return build_experts(world, device)
    cfg = sizes(args).delay_cfg
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    shard(model, "ours", mesh_for(variant, device.type, world), 2 if variant == "reshard_2" else True,
          variant == "cpu_offload", cuda)

    def loss(m: nn.Module, i: int) -> torch.Tensor:
        x, y = synthetic_batch(cfg, 2, i, 0, device=device)
        return loss_fn(m(x), y)

    return model, loss


def build_experts(world: int, device: torch.device) -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor]]:
    """tests/parallel's MoE model, expert-parallel; its token dispatch issues collectives too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fully_shard import fully_shard
    from fully_shard.core.placement import ShardPlacement
    from tests.parallel.moe_common import MoEModel, batch, expert_parallel, is_expert

    torch.manual_seed(0)
    model = MoEModel().to(device)
    if world == 1:  # one 1-rank group serves both meshes: the experts are `ep` DTensors of the dp mesh's root (as TP)
        root = init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "ep"))
        expert_parallel(model, root["ep"])
        for layer in model.layers:
            fully_shard(layer, mesh=root["dp"])
        fully_shard(model, mesh=root["dp"])
    else:  # dense on dp, experts on (efsdp, ep): two groups per unit
        sparse = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
        dense = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        expert_parallel(model, sparse["ep"])
        edp = sparse["efsdp"]
        for layer in model.layers:
            fully_shard(layer, mesh=dense,
                        shard_placement_fn=lambda p: ShardPlacement(Shard(0), mesh=edp) if is_expert(p) else None)
        fully_shard(model, mesh=dense)

    def loss(m: nn.Module, i: int) -> torch.Tensor:
        x, y = batch(i, world)
        rows = x.shape[0] // world
        return (m(x[:rows].to(device)) - y[:rows].to(device)).pow(2).mean()

    return model, loss


def train(variant: str, world: int, device: torch.device, args: argparse.Namespace, delays: Delays
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``STEPS`` AdamW steps with every collective delayed; the losses and this rank's parameters. No host
    sync inside the steps (a ``loss.item()`` would order the next step after this one)."""
    with delays:
        model, loss_of = build(variant, world, device, args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for i in range(STEPS):
            loss = loss_of(model, i)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        values = [float(v) for v in losses]
        params = {n: _local(p).detach().cpu().clone() for n, p in model.named_parameters()}
    del model, opt
    return values, params


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    """None when bitwise equal; else the first parameter that differs and by how much."""
    if a.keys() != b.keys():
        return f"different parameters: {sorted(a.keys() ^ b.keys())[:4]}"
    for name, t in a.items():
        if not torch.equal(t, b[name]):
            diff = (t.float() - b[name].float()).abs().max().item() if t.shape == b[name].shape else float("nan")
            return f"{name} differs (max |diff| {diff:.3e})"
    return None


def run(args: argparse.Namespace, out: str, kind: str) -> None:
    """Child of part delay for world ``kind`` (``nccl``/``fake``) in this process's mode (``CUDA_LAUNCH_BLOCKING``):
    every variant twice into ``out`` (JSON) and its first run's parameters into ``out + ".pt"``."""
    t0 = time.perf_counter()
    device = device_of(args)
    cuda = device.type == "cuda"
    torch.use_deterministic_algorithms(True, warn_only=True)  # (CUBLAS_WORKSPACE_CONFIG: set by the runner)
    if kind == "nccl":
        if cuda:
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        world = 1
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        world = 8
    sleep = cuda and hasattr(torch.cuda, "_sleep")
    cycles = int(cycles_per_ms() * args.delay_ms) if sleep else 0
    res: dict[str, Any] = {"kind": kind, "world": world, "blocking": os.environ.get("CUDA_LAUNCH_BLOCKING") == "1",
                           "delay_ms": args.delay_ms if sleep else 0.0, "delay_cycles": cycles, "steps": STEPS,
                           "variants": {}}
    saved: dict[str, dict[str, torch.Tensor]] = {}
    attention = contextlib.nullcontext()
    if cuda:  # the math kernel: deterministic (flash attention's backward is not)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)  # type: ignore[assignment]
    with library_on_torch_functions(world), attention:
        for variant in WORLDS[kind]:
            log(f"{kind}/{variant}", t0)
            try:
                delays = Delays(cycles, simulate=kind == "fake")
                losses, params = train(variant, world, device, args, delays)
                again, params_again = train(variant, world, device, args, Delays(cycles, simulate=kind == "fake"))
                saved[variant] = params
                rec: dict[str, Any] = {"losses": losses, "delayed": dict(delays.counts),
                                       "repeat": first_difference(params, params_again) or (
                                           None if losses == again else f"losses {losses} vs {again}")}
            except Exception as e:
                rec = {"error": error_text(e), "traceback": traceback.format_exc()[-3000:]}
                print(rec["traceback"], flush=True)
            res["variants"][variant] = rec
            write_json(out, res)
    torch.save(saved, out + ".pt")
    res["elapsed_s"] = time.perf_counter() - t0
    write_json(out, res)
    dist.destroy_process_group()


def report(rep: Report, runs: dict[str, dict[str, Any] | None], params: dict[str, Path], cuda: bool,
           cut: bool = False) -> None:
    """``runs``/``params``: per child (``nccl``, ``nccl-blocking``, ``fake``, ``fake-blocking``) its JSON and
    its ``.pt`` file."""
    rep.say("\n== Part delay: every collective delayed on its stream, vs CUDA_LAUNCH_BLOCKING=1 (bitwise) ==")
    part = "delay"
    for kind, variants in WORLDS.items():
        concurrent, blocking = runs.get(kind), runs.get(f"{kind}-blocking")
        if concurrent is None or blocking is None:
            rep.missing(part, f"{kind}: both runs", "not run (see the part's completion check)", cut=cut)
            continue
        what = ("world 1 on NCCL, collectives issued at world 1" if concurrent["world"] == 1 else
                "world 8 on the fake process group, collectives simulated on their streams")
        if not cuda:
            what = what.replace("NCCL", "gloo (CPU dry run)")
        rep.say(f"{kind}: {what}; {concurrent['delay_ms']} ms ({concurrent['delay_cycles']} cycles) before each "
                f"collective, {concurrent['steps']} steps")
        a = _load(params.get(kind))
        b = _load(params.get(f"{kind}-blocking"))
        for variant in variants:
            ra, rb = concurrent["variants"].get(variant), blocking["variants"].get(variant)
            if ra is None or rb is None:
                rep.missing(part, f"{kind}/{variant}: runs", "not run", cut=cut)
                continue
            if "error" in ra or "error" in rb:
                rep.check(part, f"{kind}/{variant}: runs", False, ra.get("error") or rb.get("error"))
                continue
            rep.say(f"  {variant:<12} losses {[round(v, 5) for v in ra['losses']]}  collectives delayed per run "
                    f"{ra['delayed']}")
            delayed = ra["delayed"]
            rep.check(part, f"{kind}/{variant}: the delays reached all-gathers and reduce-scatters",
                      delayed.get("all_gather", 0) > 0 and delayed.get("reduce_scatter", 0) > 0, str(delayed))
            rep.check(part, f"{kind}/{variant}: two identical runs bitwise equal", ra["repeat"] is None,
                      ra["repeat"] or "parameters and losses")
            diff = first_difference(a[variant], b[variant]) if variant in a and variant in b else "parameters missing"
            if diff is None and ra["losses"] != rb["losses"]:
                diff = f"losses {ra['losses']} vs {rb['losses']}"
            rep.check(part, f"{kind}/{variant}: delayed run bitwise equal to CUDA_LAUNCH_BLOCKING=1's", diff is None,
                      diff or f"{len(a[variant])} parameters after {concurrent['steps']} steps"
                      + ("" if cuda else " (CPU dry run: no concurrency, trivially)"))


def _load(path: Path | None) -> dict[str, dict[str, torch.Tensor]]:
    if path is None or not path.exists():
        return {}
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]
