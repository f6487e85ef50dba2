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
library pays one list truthiness check per event (~60 ns; a few dozen per step).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import trace
from .state import get_state

_COLLECTIVES = (trace.EventKind.ALL_GATHER, trace.EventKind.REDUCE_SCATTER, trace.EventKind.ALL_REDUCE)


# --- memory ------------------------------------------------------------------------------------------
def _read_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_memory(device: torch.device | None = None) -> int:
    """Bytes in use now: CUDA allocator's allocated bytes on GPU, resident set size on CPU."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def reset_peak_memory(device: torch.device | None = None) -> bool:
    """Start a new peak window. On CPU this resets the kernel's VmHWM (``/proc/self/clear_refs``);
    returns False where that is not possible (the peak is then the process's lifetime peak)."""
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(device: torch.device | None = None) -> int:
    """Peak bytes since ``reset_peak_memory``: CUDA allocator peak on GPU, peak RSS on CPU."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _read_status_kb("VmHWM:")
    if hwm is not None:
        return hwm * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# --- records -----------------------------------------------------------------------------------------
@dataclass
class Collective:
    """One collective of one step, times in seconds on the host's ``perf_counter`` clock."""

    kind: str  # all_gather | reduce_scatter | all_reduce
    unit: str  # the unit's module FQN ("" for the root)
    phase: str  # forward | backward | explicit
    nbytes: int
    group_size: int
    prefetch: bool
    t_issue: float
    t_done: float
    exposed_s: float
    t_wait: float  # when the consumer began waiting (0: not waited inside the step)

    @property
    def time_s(self) -> float:
        return max(0.0, self.t_done - self.t_issue)


@dataclass
class CommStats:
    count: int = 0
    bytes: int = 0
    time_s: float = 0.0
    exposed_s: float = 0.0

    def add(self, c: Collective) -> None:
        self.count += 1
        self.bytes += c.nbytes
        self.time_s += c.time_s
        self.exposed_s += c.exposed_s

    @property
    def overlapped_s(self) -> float:
        return max(0.0, self.time_s - self.exposed_s)

    def merged(self, other: CommStats) -> CommStats:
        return CommStats(self.count + other.count, self.bytes + other.bytes, self.time_s + other.time_s,
                         self.exposed_s + other.exposed_s)


@dataclass
class UnitStats:
    """One unit in one step."""

    unit: str
    gathered_bytes: int = 0
    all_gather_forward: CommStats = field(default_factory=CommStats)
    all_gather_backward: CommStats = field(default_factory=CommStats)
    all_gather_explicit: CommStats = field(default_factory=CommStats)
    reduce_scatter: CommStats = field(default_factory=CommStats)
    all_reduce: CommStats = field(default_factory=CommStats)
    memory_at_unshard: int = 0  # max memory sampled when this unit's params became usable

    @property
    def comm(self) -> CommStats:
        total = CommStats()
        for s in (self.all_gather_forward, self.all_gather_backward, self.all_gather_explicit,
                  self.reduce_scatter, self.all_reduce):
            total = total.merged(s)
        return total


@dataclass
class StepStats:
    index: int
    t_start: float
    t_end: float
    units: dict[str, UnitStats]
    collectives: list[Collective]
    peak_memory: int
    memory_start: int
    mem_kind: str
    peak_is_lifetime: bool

    @property
    def step_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed_s for c in self.collectives)

    @property
    def busy_s(self) -> float:
        """Time with at least one collective in flight (union of issue->done intervals)."""
        spans = sorted((max(c.t_issue, self.t_start), min(c.t_done, self.t_end)) for c in self.collectives)
        total, end = 0.0, float("-inf")
        for s, e in spans:
            if e <= s:
                continue
            if s > end:
                total += e - s
                end = e
            elif e > end:
                total += e - end
                end = e
        return total

    def bytes_of(self, kind: str) -> int:
        return sum(c.nbytes for c in self.collectives if c.kind == kind)


# --- the profiler ------------------------------------------------------------------------------------
class Profiler:
    """Collects per-unit, per-step communication and memory statistics; see the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.steps: list[StepStats] = []
        self._events: list[trace.Event] = []
        self._mem_samples: dict[str, int] = {}
        self._ctx: Any = None
        self._t0 = 0.0
        self._step_start = 0.0
        self._mem_start = 0
        self._peak_is_lifetime = False
        self._anchor: Any = None  # accelerator: timing event at the step start
        self.device = self._find_device()
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not list(self._states()):
            raise ValueError(f"profile() expects a model with fully_shard units, found none in "
                             f"{type(model).__name__}. Fix: call fully_shard on its blocks and on the model "
                             "first, then profile it.")

    # --- units -------------------------------------------------------------------------------
    def _states(self) -> Iterator[Any]:
        seen: set[int] = set()
        for module in self.model.modules():
            state = get_state(module)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                yield state

    def _find_device(self) -> torch.device:
        for state in self._states():
            return torch.device(state.device)
        return torch.device("cpu")

    def units(self) -> list[dict[str, Any]]:
        """Every unit with parameters: name, gathered bytes (param dtype, padding included), model
        bytes (unpadded) and whether it reshards after forward (so it is gathered again in backward)."""
        out = []
        for state in self._states():
            group = state.group
            if group is None:
                continue
            raf = state.effective_reshard_after_forward
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
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def _on_event(self, event: trace.Event) -> None:
        if event.kind in _COLLECTIVES:
            self._events.append(event)
        elif event.kind is trace.EventKind.UNSHARD:
            mem = current_memory(self.device)
            if mem > self._mem_samples.get(event.fqn, 0):
                self._mem_samples[event.fqn] = mem

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _begin_step(self) -> None:
        self._sync()
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
        self._sync()
        t_end = time.perf_counter()
        collectives = [self._resolve(e, t_end) for e in self._events]
        units = {u["unit"]: UnitStats(u["unit"], gathered_bytes=u["gathered_bytes"]) for u in self.units()}
        for c in collectives:
            unit = units.setdefault(c.unit, UnitStats(c.unit))
            if c.kind == "all_gather":
                target = {"forward": unit.all_gather_forward, "backward": unit.all_gather_backward}.get(
                    c.phase, unit.all_gather_explicit)
            elif c.kind == "reduce_scatter":
                target = unit.reduce_scatter
            else:
                target = unit.all_reduce
            target.add(c)
        for fqn, mem in self._mem_samples.items():
            if fqn in units:
                units[fqn].memory_at_unshard = mem
        mem_kind = "cuda allocated" if self.device.type == "cuda" else "RSS"
        stats = StepStats(len(self.steps), self._step_start, t_end, units, collectives,
                          peak_memory(self.device), self._mem_start, mem_kind, self._peak_is_lifetime)
        self.steps.append(stats)
        self._events = []
        return stats

    def _resolve(self, e: trace.Event, t_end: float) -> Collective:
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
        ag = sum(s.bytes_of("all_gather") for s in steps) / n
        rs = sum(s.bytes_of("reduce_scatter") for s in steps) / n
        ar = sum(s.bytes_of("all_reduce") for s in steps) / n
        model_bytes = self.model_bytes()
        return {
            "steps": n,
            "rank": self.rank,
            "world_size": self.world,
            "device": str(self.device),
            "step_s": step_s,
            "exposed_comm_s": exposed,
            "comm_busy_s": busy,
            "comm_share": exposed / step_s if step_s else 0.0,
            "comm_busy_share": busy / step_s if step_s else 0.0,
            "all_gather_bytes": ag,
            "reduce_scatter_bytes": rs,
            "all_reduce_bytes": ar,
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
            for key in ("all_gather_forward", "all_gather_backward", "all_gather_explicit", "reduce_scatter",
                        "all_reduce"):
                total = CommStats()
                for u in per:
                    total = total.merged(getattr(u, key))
                row[key] = {"count": total.count / n, "bytes": total.bytes / n, "time_s": total.time_s / n,
                            "exposed_s": total.exposed_s / n, "overlapped_s": total.overlapped_s / n}
            rows.append(row)
        return rows

    def table(self, skip_first: int = 0) -> str:
        """A per-unit table (per-step means) and the step summary, ready to print."""
        rows = self.unit_table(skip_first)
        s = self.summary(skip_first)
        head = (f"fully_shard profile: rank {s['rank']}/{s['world_size']} on {s['device']}, {s['steps']} "
                f"step(s); per-step means; time = issue->done, exp = exposed (the caller waited)")
        cols = ["unit", "gathered", "AG fwd n", "bytes", "ms", "exp", "AG bwd n", "bytes", "ms", "exp",
                "RS+AR n", "bytes", "ms", "exp", f"{s['memory_kind']}@gather"]
        body = []
        for r in rows:
            fwd, bwd, exp_ag = r["all_gather_forward"], r["all_gather_backward"], r["all_gather_explicit"]
            red = {k: r["reduce_scatter"][k] + r["all_reduce"][k] for k in ("count", "bytes", "time_s",
                                                                                 "exposed_s")}
            fwd = {k: fwd[k] + exp_ag[k] for k in ("count", "bytes", "time_s", "exposed_s")}
            cells = [r["unit"], _fmt_bytes(r["gathered_bytes"])]
            for d in (fwd, bwd, red):
                cells += [_fmt_count(d["count"]), _fmt_bytes(d["bytes"]), f"{d['time_s'] * 1e3:.2f}",
                          f"{d['exposed_s'] * 1e3:.2f}"]
            cells.append(_fmt_bytes(r["memory_at_unshard"]) if r["memory_at_unshard"] else "-")
            body.append(cells)
        widths = [max(len(c[i]) for c in [cols, *body]) for i in range(len(cols))]
        lines = [head, "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths)))]
        lines.append("-" * len(lines[-1]))
        for cells in body:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths))))
        lines.append("-" * len(lines[1]))
        lines += self._summary_lines(s)
        return "\n".join(lines)

    def _summary_lines(self, s: dict[str, Any]) -> list[str]:
        step_ms = s["step_s"] * 1e3
        peak = _fmt_bytes(s["peak_memory"]) + (" (process lifetime)" if s["peak_is_lifetime"] else "")
        return [
            f"step {step_ms:.1f} ms (median) | exposed comm {s['exposed_comm_s'] * 1e3:.1f} ms "
            f"({s['comm_share']:.0%} of the step) | a collective in flight {s['comm_busy_s'] * 1e3:.1f} ms "
            f"({s['comm_busy_share']:.0%})",
            f"bytes/step {_fmt_bytes(s['bytes_per_step'])} (all-gather {_fmt_bytes(s['all_gather_bytes'])} + "
            f"reduce-scatter {_fmt_bytes(s['reduce_scatter_bytes'])}"
            + (f"; all-reduce {_fmt_bytes(s['all_reduce_bytes'])}" if s["all_reduce_bytes"] else "")
            + f") = {s['bytes_over_model']:.2f}x the model ({_fmt_bytes(s['model_bytes'])}); "
            f"expected {s['expected_bytes_over_model']:.2f}x (2x, +1x for units resharded after forward)"
            + (f"; the gradients are reduced in {_reduce_dtypes(self)}" if _reduce_dtypes(self) else ""),
            f"peak memory ({s['memory_kind']}) {peak}",
        ]

    def summary_text(self, skip_first: int = 0) -> str:
        """The step summary lines of ``table()`` alone."""
        return "\n".join(self._summary_lines(self.summary(skip_first)))

    def to_dict(self, skip_first: int = 0) -> dict[str, Any]:
        return {
            "summary": self.summary(skip_first),
            "units": self.units(),
            "unit_table": self.unit_table(skip_first),
            "steps": [{
                "index": st.index,
                "step_s": st.step_s,
                "exposed_comm_s": st.exposed_s,
                "comm_busy_s": st.busy_s,
                "peak_memory": st.peak_memory,
                "units": {name or "<root>": _unit_dict(u) for name, u in st.units.items()},
                "collectives": [{**asdict(c), "t_issue": c.t_issue - self._t0, "t_done": c.t_done - self._t0,
                                 "t_wait": (c.t_wait - self._t0) if c.t_wait else None, "time_s": c.time_s}
                                for c in st.collectives],
            } for st in self.steps],
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
        pid = self.rank
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"rank {self.rank}"}},
            {"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "host / compute"}},
        ]

        def us(t: float) -> float:
            return round((t - self._t0) * 1e6, 3)

        lanes: dict[str, list[float]] = {}
        tids: dict[tuple[str, int], int] = {}
        for st in self.steps:
            events.append({"ph": "X", "pid": pid, "tid": 0, "name": f"step {st.index}", "ts": us(st.t_start),
                           "dur": round(st.step_s * 1e6, 3), "args": {"peak_memory": st.peak_memory}})
            for c in sorted(st.collectives, key=lambda c: c.t_issue):
                unit = c.unit or "<root>"
                short = {"forward": "fwd", "backward": "bwd"}.get(c.phase, c.phase)
                ends = lanes.setdefault(c.kind, [])
                lane = next((i for i, end in enumerate(ends) if end <= c.t_issue), len(ends))
                if lane == len(ends):
                    ends.append(c.t_done)
                else:
                    ends[lane] = c.t_done
                key = (c.kind, lane)
                if key not in tids:
                    tids[key] = len(tids) + 1
                    events.append({"ph": "M", "pid": pid, "tid": tids[key], "name": "thread_name",
                                   "args": {"name": f"{c.kind} #{lane}"}})
                args = {"unit": unit, "bytes": c.nbytes, "group_size": c.group_size, "prefetch": c.prefetch,
                        "exposed_ms": c.exposed_s * 1e3}
                events.append({"ph": "X", "pid": pid, "tid": tids[key], "name": f"{c.kind} {unit} {short}",
                               "ts": us(c.t_issue), "dur": round(c.time_s * 1e6, 3), "args": args})
                if c.exposed_s > 0 and c.t_wait:
                    events.append({"ph": "X", "pid": pid, "tid": 0, "name": f"wait {c.kind} {unit}",
                                   "ts": us(c.t_wait), "dur": round(c.exposed_s * 1e6, 3), "args": args})
        # Chrome wants the slices of one track properly nested: sort by start, longest first.
        events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0), -e.get("dur", 0.0)))
        Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def profile(model: nn.Module) -> Profiler:
    """Profile the fully_shard units of ``model``: ``with profile(model) as prof: ...``."""
    return Profiler(model)


def _reduce_dtypes(prof: Profiler) -> str:
    """The reduce dtypes that differ from the all-gather dtype ("" when none do)."""
    names = sorted({str(s.group.reduce_dtype).replace("torch.", "") for s in prof._states()
                    if s.group is not None and s.group.reduce_dtype != s.group.param_dtype})
    return ", ".join(names)


def _unit_dict(u: UnitStats) -> dict[str, Any]:
    d = asdict(u)
    d.pop("unit")
    return d


def _fmt_count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def _fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
