"""Per-unit communication and memory profiler: ``with profile(model) as prof: ...; prof.step()``.

It observes the runtime events of ``trace.py`` (every all-gather, reduce-scatter and all-reduce a
unit issues, and how long the caller waited for it) and turns them into, per fully_shard unit and
per step: all-gather count/bytes/time in forward and in backward, reduce-scatter (+ HSDP all-reduce)
count/bytes/time, the exposed part of that time (the CPU or the compute stream waited) versus the
overlapped part, the unit's gathered bytes and the memory when it was gathered; and per step: step
time, time with a collective in flight, exposed communication, bytes moved vs the model size, and
the process's peak memory (CUDA allocator peak on GPU; peak RSS on CPU)::

    with profile(model) as prof:
        for batch in loader:
            train_step(batch)
            prof.step()          # closes one step (like torch.profiler); optional for one step
    print(prof.table())
    prof.export_chrome_trace("trace.json")   # chrome://tracing or ui.perfetto.dev

Times: on CPU a collective's time runs from its issue to its completion (stamped by the c10d work's
future callback; for works without a future, such as gloo's reduce-scatter, to the end of its wait),
and its exposed time is the host time blocked in ``wait``. On accelerators both come from timing
events: on the collective's stream around it, and on the compute stream where it is waited (exposed
= how long the compute stream had to wait); ``step()`` synchronizes the device. Memory: each step is
its own peak window (the CUDA peak stats or the kernel's VmHWM are reset when a step begins), so
``max(s.peak_memory for s in prof.steps)`` is the peak of the run. With no profiler active the
library pays one list truthiness check per event (a few dozen per step).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import trace
from ..core.state import FSDPState, states_under
from . import export
from .measurements import Collective, CommStats, StepStats, UnitStats
from .memory import current_memory, peak_memory, reset_peak_memory
from .timing import synchronize

_COLLECTIVES = (trace.EventKind.ALL_GATHER, trace.EventKind.REDUCE_SCATTER, trace.EventKind.ALL_REDUCE,
                trace.EventKind.OPTIMIZER_COLLECTIVE)
_UNIT_COMMS = ("all_gather_forward", "all_gather_backward", "all_gather_explicit", "reduce_scatter", "all_reduce")


class Profiler:
    """Collects per-unit, per-step communication and memory statistics; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.steps: list[StepStats] = []
        self._events: list[trace.TraceEvent] = []
        self._mem_samples: dict[str, int] = {}
        self._ctx: contextlib.AbstractContextManager[None] | None = None
        self._t0 = 0.0
        self._step_start = 0.0
        self._mem_start = 0
        self._peak_is_lifetime = False
        self._anchor: torch.cuda.Event | None = None  # accelerator: timing event at the step start
        self.device = self._find_device()
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not list(self._states()):
            raise ValueError(f"profile() expects a model with fully_shard units, found none in "
                             f"{type(model).__name__}. Fix: call fully_shard on its blocks and on the model "
                             "first, then profile it.")

    # --- units -------------------------------------------------------------------------------
    def _states(self) -> Iterator[FSDPState]:
        return (state for _, state in states_under(self.model))

    def _find_device(self) -> torch.device:
        for state in self._states():
            return torch.device(state.device)
        return torch.device("cpu")

    def units(self) -> list[dict[str, Any]]:
        """Every unit with parameters: name, gathered bytes (param dtype, padding included), model
        bytes (unpadded) and whether it reshards after forward (so it is gathered again in backward)."""
        out = []
        for state in self._states():
            raf = state.effective_reshard_after_forward
            for group in state.groups:  # one row per group: a unit with per-parameter meshes has several
                out.append({
                    "unit": group.fqn,
                    "gathered_bytes": group.unsharded_nbytes,
                    "param_bytes": sum(p.layout.numel for p in group.params) * group.param_dtype.itemsize,
                    "grad_bytes": sum(p.layout.numel for p in group.grad_params) * group.reduce_dtype.itemsize,
                    "params": len(group.params),
                    "reshard_after_forward": raf if isinstance(raf, bool) else int(raf),
                })
        return out

    def model_bytes(self) -> int:
        """The model's parameter bytes at the all-gather dtype, without padding."""
        return sum(u["param_bytes"] for u in self.units())

    def _reduce_dtypes(self) -> str:
        """The reduce dtypes that differ from the all-gather dtype ("" when none do)."""
        names = sorted({str(g.reduce_dtype).replace("torch.", "") for s in self._states() for g in s.groups
                        if g.reduce_dtype != g.param_dtype})
        return ", ".join(names)

    # --- recording ---------------------------------------------------------------------------
    def __enter__(self) -> Profiler:
        self._t0 = time.perf_counter()
        self._ctx = trace.observe(self._on_event)
        self._ctx.__enter__()
        self._begin_step()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if any(e.kind in _COLLECTIVES for e in self._events) or not self.steps:
                self._end_step()
        finally:
            if self._ctx is not None:
                self._ctx.__exit__(None, None, None)
            self._ctx = None

    def _on_event(self, event: trace.TraceEvent) -> None:
        if event.kind in _COLLECTIVES:
            self._events.append(event)
        elif event.kind is trace.EventKind.UNSHARD:
            mem = current_memory(self.device)
            if mem > self._mem_samples.get(event.fqn, 0):
                self._mem_samples[event.fqn] = mem

    def _begin_step(self) -> None:
        synchronize(self.device)
        self._events = []
        self._mem_samples = {}
        self._peak_is_lifetime = not reset_peak_memory(self.device)
        self._mem_start = current_memory(self.device)
        self._step_start = time.perf_counter()
        if self.device.type == "cuda":
            self._anchor = torch.cuda.current_stream(self.device).record_event(
                torch.cuda.Event(enable_timing=True))

    def step(self) -> StepStats:
        """Close the current step (synchronizing the device) and start the next; returns its stats."""
        stats = self._end_step()
        self._begin_step()
        return stats

    def _end_step(self) -> StepStats:
        synchronize(self.device)
        t_end = time.perf_counter()
        collectives = [self._resolve(e, t_end) for e in self._events]
        units = {u["unit"]: UnitStats(u["unit"], gathered_bytes=u["gathered_bytes"]) for u in self.units()}
        for c in collectives:
            if c.kind != trace.EventKind.OPTIMIZER_COLLECTIVE.value:  # the optimizer's: in the summary only
                _stats_of(units.setdefault(c.unit, UnitStats(c.unit)), c).add(c)
        for fqn, mem in self._mem_samples.items():
            if fqn in units:
                units[fqn].memory_at_unshard = mem
        mem_kind = "cuda allocated" if self.device.type == "cuda" else "RSS"
        stats = StepStats(len(self.steps), self._step_start, t_end, units, collectives,
                          peak_memory(self.device), self._mem_start, mem_kind, self._peak_is_lifetime)
        self.steps.append(stats)
        self._events = []
        return stats

    def _resolve(self, e: trace.TraceEvent, t_end: float) -> Collective:
        timing = e.timing
        t_issue, t_done, exposed, t_wait = e.t_start, 0.0, e.exposed_s, 0.0
        if timing is not None and timing.end is not None and self._anchor is not None:
            ms = self._anchor.elapsed_time  # accelerator: place GPU times on the host clock
            t_issue = self._step_start + ms(timing.start) / 1e3
            t_done = self._step_start + ms(timing.end) / 1e3
            if timing.reached is not None:
                t_wait = self._step_start + ms(timing.reached) / 1e3
                exposed = max(0.0, t_done - t_wait)
        elif timing is not None:
            t_issue, exposed, t_wait = timing.t_issue, timing.exposed_s, timing.t_wait
            t_done = timing.t_done
            if t_wait and (not t_done or t_done > t_wait):  # finished during the wait: usable at its end
                t_done = max(t_done, t_wait + exposed)
        if not t_done:
            t_done = e.t_end or t_end
        exposed = min(exposed, max(0.0, t_done - t_issue))
        return Collective(e.kind.value, e.fqn, e.phase.value, e.nbytes, e.group_size, e.prefetch,
                          t_issue, t_done, exposed, t_wait)

    # --- reporting ---------------------------------------------------------------------------
    def _measured(self, skip_first: int) -> list[StepStats]:
        steps = self.steps[skip_first:] if len(self.steps) > skip_first else self.steps
        if not steps:
            raise RuntimeError("profile(): no step recorded. Fix: run at least one training step inside "
                               "`with profile(model) as prof:` (call prof.step() after each).")
        return steps

    def expected_bytes_ratio(self) -> float:
        """All-gather + reduce-scatter bytes per step over the model bytes if every unit ran forward and
        backward once: 1x gathered in forward, again in backward for units resharded after forward, 1x
        reduce-scattered (at the reduce dtype: 2x the bytes of bf16 params reduced in fp32), no padding."""
        units = self.units()
        total = sum(u["param_bytes"] for u in units) or 1
        regather = sum(u["param_bytes"] for u in units if u["reshard_after_forward"] is not False)
        reduced = sum(u["grad_bytes"] for u in units)
        return (total + regather + reduced) / total
    def summary(self, skip_first: int = 0) -> dict[str, Any]:
        """Step summary over the recorded steps (median step time; means for the rest)."""
        steps = self._measured(skip_first)
        n = len(steps)
        step_s = statistics.median(s.step_s for s in steps)
        exposed = sum(s.exposed_s for s in steps) / n
        busy = sum(s.busy_s for s in steps) / n
        mean_step_s = sum(s.step_s for s in steps) / n  # shares: means over means (a mean over the
        # median step could pass 1 when one slow step holds most of the waiting)
        ag = sum(s.bytes_of("all_gather") for s in steps) / n
        rs = sum(s.bytes_of("reduce_scatter") for s in steps) / n
        ar = sum(s.bytes_of("all_reduce") for s in steps) / n
        optimizer = [c for s in steps for c in s.collectives if c.kind == trace.EventKind.OPTIMIZER_COLLECTIVE.value]
        model_bytes = self.model_bytes()
        return {
            "steps": n,
            "rank": self.rank,
            "world_size": self.world,
            "device": str(self.device),
            "step_s": step_s,
            "exposed_comm_s": exposed,
            "comm_busy_s": busy,
            "comm_share": exposed / mean_step_s if mean_step_s else 0.0,
            "comm_busy_share": busy / mean_step_s if mean_step_s else 0.0,
            "all_gather_bytes": ag,
            "reduce_scatter_bytes": rs,
            "all_reduce_bytes": ar,
            "optimizer_collectives": len(optimizer) / n,  # per step, sent by this rank (e.g. Muon's exchange)
            "optimizer_bytes": sum(c.nbytes for c in optimizer) / n,
            "bytes_per_step": ag + rs,
            "model_bytes": model_bytes,
            "bytes_over_model": (ag + rs) / model_bytes if model_bytes else 0.0,
            "expected_bytes_over_model": self.expected_bytes_ratio(),
            "peak_memory": max(s.peak_memory for s in steps),
            "memory_kind": steps[0].mem_kind,
            "peak_is_lifetime": any(s.peak_is_lifetime for s in steps),
        }

    def unit_table(self, skip_first: int = 0) -> list[dict[str, Any]]:
        """Per unit, per-step means over the recorded steps (counts, bytes, seconds)."""
        steps = self._measured(skip_first)
        n = len(steps)
        names = list(dict.fromkeys(name for s in steps for name in s.units))
        rows = []
        for name in names:
            per = [s.units[name] for s in steps if name in s.units]
            row: dict[str, Any] = {"unit": name or "<root>",
                                   "gathered_bytes": max(u.gathered_bytes for u in per),
                                   "memory_at_unshard": max(u.memory_at_unshard for u in per)}
            for key in _UNIT_COMMS:
                total = CommStats()
                for u in per:
                    total = total.merged(getattr(u, key))
                row[key] = {"count": total.count / n, "bytes": total.bytes / n, "time_s": total.time_s / n,
                            "exposed_s": total.exposed_s / n, "overlapped_s": total.overlapped_s / n}
            rows.append(row)
        return rows

    def table(self, skip_first: int = 0) -> str:
        """A per-unit table (per-step means) and the step summary, ready to print."""
        return export.format_table(self.unit_table(skip_first), self.summary(skip_first), self._reduce_dtypes())

    def to_dict(self, skip_first: int = 0) -> dict[str, Any]:
        return {
            "summary": self.summary(skip_first),
            "units": self.units(),
            "unit_table": self.unit_table(skip_first),
            "steps": [export.step_dict(st, self._t0) for st in self.steps],
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, skip_first: int = 0) -> str:
        """The whole record as JSON (written to ``path`` too when given)."""
        text = json.dumps(self.to_dict(skip_first), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome/Perfetto trace: steps and exposed waits on the host track, collectives on
        lanes labelled by kind, each slice named by unit (``all_gather blocks.3 fwd``)."""
        Path(path).write_text(json.dumps(export.chrome_trace(self.steps, self.rank, self._t0)))


def profile(model: nn.Module) -> Profiler:
    """Profile the fully_shard units of ``model``: ``with profile(model) as prof: ...``."""
    return Profiler(model)


def _stats_of(unit: UnitStats, c: Collective) -> CommStats:
    """The totals of ``unit`` that ``c`` adds to (its kind, and for all-gathers its phase)."""
    if c.kind == "all_gather":
        return {"forward": unit.all_gather_forward, "backward": unit.all_gather_backward}.get(
            c.phase, unit.all_gather_explicit)
    return unit.reduce_scatter if c.kind == "reduce_scatter" else unit.all_reduce
