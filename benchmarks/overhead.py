"""Host time per unit per step, split by phase: this library vs torch's fully_shard, in the same processes.

    python benchmarks/overhead.py                  # launches 2 gloo ranks itself
    python benchmarks/overhead.py --units 64 --steps 30

Compute is made negligible: a chain of ``--units`` tiny ``nn.Linear(width, width)`` modules (each its own
unit, the chain the root), batch 1, so what a step costs is almost only the FSDP runtime's host work. Four
configurations: fp32 or bf16 parameters (``param_dtype=bf16, reduce_dtype=fp32``) x
``reshard_after_forward`` True or False. Both libraries get the same model copy and AdamW; every step
runs each once, in alternating order, so machine noise hits them alike.

How a phase is timed (the same way for both libraries, no private name of either is wrapped): probes are
placed *around* each library's hooks with public torch APIs, after ``fully_shard`` has registered them:

- pre-forward: a forward pre-hook registered with ``prepend=True`` (runs before the FSDP pre-hook, which
  both libraries register with ``prepend=True`` at ``fully_shard`` time) and one appended (runs after it);
- post-forward: the same with forward hooks around the FSDP post-forward hook (both register it appended);
- pre-backward: both libraries register ``Tensor.register_hook`` on a unit's outputs inside their
  post-forward hook; tensor hooks run in registration order, so a tensor hook registered in the probe
  before (after) the FSDP post-forward hook runs before (after) the FSDP pre-backward hook;
- post-backward/reduce: both libraries route a unit's inputs through an autograd Function whose backward
  is the post-backward hook (reduce-scatter issue, reshard). A tensor hook on the routed inputs (registered
  after the FSDP pre-forward hook) fires just before that node runs; the phase ends at the next probe
  event (the previous unit's pre-backward probe, or the hook on the leaf input, which requires grad so
  that the first unit has this node too);
- end of backward: from the leaf input's gradient hook (the last node of the graph; registered after the
  forward, so it runs after every probe hook on the leaf) to the return of ``loss.backward()``: both
  libraries' end-of-backward callbacks (finish the reduces, assign ``.grad``);
- optimizer step: ``opt.step()`` plus ``opt.zero_grad()``. This library installs one global optimizer
  step pre-hook that also runs (and returns at once) for torch's optimizer: that cost counts for torch.

Each probe reads ``time.thread_time_ns()`` (CPU time of the calling thread): host work, without the time a
rank blocks waiting for a collective (the other rank's lag on this shared machine), which the wall clock
(``--clock wall``) would count. Printed per unit: total over the step / units (the root unit, without
parameters, is counted in the totals of both). Ratios are ours / torch's, medians over the measured steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from _common import (
    TorchMP,
    init,
    launch_if_needed,
    machine,
    median,
    rank0_print,
    torch_fully_shard,
)

from fully_shard import MixedPrecisionPolicy, fully_shard

PHASES = ("pre-forward", "post-forward", "pre-backward", "post-backward", "end of backward", "optimizer step")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to launch when not under torchrun")
    ap.add_argument("--units", type=int, default=64)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30, help="measured steps per library and configuration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--configs", default="fp32/raf,fp32/keep,bf16/raf,bf16/keep",
                    help="dtype/raf pairs: raf = reshard_after_forward=True, keep = False")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


class Probe:
    """Labelled timestamps of one step, from hooks placed around a library's hooks."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.events: list[tuple[str, int]] = []

    def mark(self, label: str) -> None:
        self.events.append((label, self.clock()))

    def phases(self) -> dict[str, float]:
        """Seconds per phase: a ``*<`` event opens a phase, the next event closes it."""
        out: dict[str, float] = defaultdict(float)
        for (label, t), (_, t_next) in zip(self.events, self.events[1:]):
            if label.endswith("<"):
                out[label[:-1]] += (t_next - t) / 1e9
        return dict(out)


def _hook_tensors(value: Any, hook: Callable[[torch.Tensor], None]) -> None:
    tensors = [value] if isinstance(value, torch.Tensor) else [
        t for t in (value if isinstance(value, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
    for t in tensors:
        if t.requires_grad:
            t.register_hook(lambda g, hook=hook: hook(g))  # type: ignore[misc]


def attach_probe(module: nn.Module, probe: Probe) -> None:
    """Probes around the FSDP hooks of ``module`` (see the module docstring)."""

    def pre_start(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        probe.mark("pre-forward<")

    def pre_end(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        probe.mark("pre-forward>")
        # the routed inputs: their gradient opens the post-backward node
        _hook_tensors(args, lambda g: probe.mark("post-backward<"))

    def post_start(_m: nn.Module, args: tuple, output: Any) -> None:
        probe.mark("post-forward<")
        _hook_tensors(output, lambda g: probe.mark("pre-backward<"))

    def post_end(_m: nn.Module, args: tuple, output: Any) -> None:
        probe.mark("post-forward>")
        _hook_tensors(output, lambda g: probe.mark("pre-backward>"))

    module.register_forward_pre_hook(pre_start, prepend=True, with_kwargs=True)
    module.register_forward_pre_hook(pre_end, with_kwargs=True)
    module.register_forward_hook(post_start, prepend=True)
    module.register_forward_hook(post_end)


def build(lib: str, base: nn.Sequential, bf16: bool, reshard: bool) -> nn.Sequential:
    model = copy.deepcopy(base)
    if lib == "ours":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for layer in model:
            fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    else:
        tmp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else TorchMP()
        for layer in model:
            torch_fully_shard(layer, mp_policy=tmp, reshard_after_forward=reshard)
        torch_fully_shard(model, mp_policy=tmp, reshard_after_forward=reshard)
    return model


def run_config(args: argparse.Namespace, bf16: bool, reshard: bool) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.units)])
    clock = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    libs: dict[str, tuple[nn.Module, torch.optim.Optimizer, Probe]] = {}
    for lib in ("ours", "torch"):
        model = build(lib, base, bf16, reshard)
        probe = Probe(clock)
        for module in [*model, model]:
            attach_probe(module, probe)
        libs[lib] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), probe)
    x = torch.randn(1, args.width)
    samples: dict[str, dict[str, list[float]]] = {lib: defaultdict(list) for lib in libs}
    for step in range(args.warmup + args.steps):
        order = ["ours", "torch"] if step % 2 == 0 else ["torch", "ours"]
        for lib in order:
            model, opt, probe = libs[lib]
            probe.events.clear()
            dist.barrier()
            leaf = x.clone().requires_grad_(True)
            t0 = clock()
            loss = model(leaf).float().sum()
            # registered after the forward: it runs after any hook the forward put on the leaf (torch's
            # root, which has no parameters, does not route its inputs, so its probe hooks the leaf itself)
            leaf.register_hook(lambda g, probe=probe: probe.mark("end of backward<"))
            loss.backward()
            probe.mark("optimizer step<")
            opt.step()
            opt.zero_grad(set_to_none=True)
            probe.mark("done")
            t1 = clock()
            if step >= args.warmup:
                phases = probe.phases()
                for name in PHASES:
                    samples[lib][name].append(phases.get(name, 0.0))
                samples[lib]["step"].append((t1 - t0) / 1e9)
    units = args.units
    out: dict[str, dict[str, float]] = {}
    for lib, per_phase in samples.items():
        mine = {name: median(values) / units * 1e6 for name, values in per_phase.items()}
        mine["phases total"] = median([sum(per_phase[n][i] for n in PHASES) for i in range(args.steps)]) / units * 1e6
        out[lib] = mine
    return out


def gather_max(result: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Every figure as the slowest rank's (both ranks run the same work)."""
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return {lib: {k: max(r[lib][k] for r in results) for k in result[lib]} for lib in result}


def table(name: str, res: dict[str, dict[str, float]]) -> str:
    rows = [f"{name}: us per unit per step (median), ours / torch",
            f"  {'phase':<16}{'torch':>9}{'ours':>9}{'ratio':>8}{'torch %':>9}"]
    torch_total = res["torch"]["phases total"]
    for key in (*PHASES, "phases total", "step"):
        t, o = res["torch"][key], res["ours"][key]
        share = f"{100 * t / torch_total:8.0f}%" if key in PHASES else ""
        rows.append(f"  {key:<16}{t:9.1f}{o:9.1f}{o / t if t else float('nan'):8.2f}{share}")
    return "\n".join(rows)


def main() -> None:
    args = parse_args()
    launch_if_needed(__file__, args.nproc)
    init("gloo")
    rank0_print(f"# overhead: {args.units} units of Linear({args.width}, {args.width}), batch 1, "
                f"{dist.get_world_size()} ranks, clock={args.clock}, {args.steps} steps; {machine()}")
    rank0_print(f"# load average at start: {Path('/proc/loadavg').read_text().split()[:3]}")
    report: dict[str, Any] = {"units": args.units, "width": args.width, "steps": args.steps, "clock": args.clock,
                              "world": dist.get_world_size(), "configs": {}}
    for config in args.configs.split(","):
        dtype, raf = config.split("/")
        res = gather_max(run_config(args, dtype == "bf16", raf == "raf"))
        name = f"{dtype}, reshard_after_forward={raf == 'raf'}"
        rank0_print(table(name, res))
        report["configs"][config] = res
    report["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    rank0_print(f"# load average at end: {report['loadavg_end']}")
    if args.json is not None and dist.get_rank() == 0:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
