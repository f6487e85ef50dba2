"""The profiler's outputs: the per-unit text table, the JSON record of a step, the Chrome trace."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .measurements import Collective, StepStats, UnitStats

_SUMS = ("count", "bytes", "time_s", "exposed_s")


# --- text table --------------------------------------------------------------------------------------
def format_table(rows: list[dict[str, Any]], s: dict[str, Any], reduce_dtypes: str) -> str:
    """A per-unit table (``Profiler.unit_table`` rows) over the step summary lines, ready to print."""
    head = (f"fully_shard profile: rank {s['rank']}/{s['world_size']} on {s['device']}, {s['steps']} "
            f"step(s); per-step means; time = issue->done, exp = exposed (the caller waited)")
    cols = ["unit", "gathered", "AG fwd n", "bytes", "ms", "exp", "AG bwd n", "bytes", "ms", "exp",
            "RS+AR n", "bytes", "ms", "exp", f"{s['memory_kind']}@gather"]
    body = [_table_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in [cols, *body]) for i in range(len(cols))]
    lines = [head, _join(cols, widths)]
    lines.append("-" * len(lines[-1]))
    lines += [_join(cells, widths) for cells in body]
    lines.append("-" * len(lines[1]))
    lines += summary_lines(s, reduce_dtypes)
    return "\n".join(lines)


def _table_cells(r: dict[str, Any]) -> list[str]:
    fwd, bwd, exp_ag = r["all_gather_forward"], r["all_gather_backward"], r["all_gather_explicit"]
    red = {k: r["reduce_scatter"][k] + r["all_reduce"][k] for k in _SUMS}
    fwd = {k: fwd[k] + exp_ag[k] for k in _SUMS}
    cells = [r["unit"], fmt_bytes(r["gathered_bytes"])]
    for d in (fwd, bwd, red):
        cells += [_fmt_count(d["count"]), fmt_bytes(d["bytes"]), f"{d['time_s'] * 1e3:.2f}",
                  f"{d['exposed_s'] * 1e3:.2f}"]
    cells.append(fmt_bytes(r["memory_at_unshard"]) if r["memory_at_unshard"] else "-")
    return cells


def _join(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def summary_lines(s: dict[str, Any], reduce_dtypes: str) -> list[str]:
    """The step summary under the table: time, bytes against the model, peak memory."""
    step_ms = s["step_s"] * 1e3
    peak = fmt_bytes(s["peak_memory"]) + (" (process lifetime)" if s["peak_is_lifetime"] else "")
    return [
        f"step {step_ms:.1f} ms (median) | exposed comm {s['exposed_comm_s'] * 1e3:.1f} ms "
        f"({s['comm_share']:.0%} of the step) | a collective in flight {s['comm_busy_s'] * 1e3:.1f} ms "
        f"({s['comm_busy_share']:.0%})",
        f"bytes/step {fmt_bytes(s['bytes_per_step'])} (all-gather {fmt_bytes(s['all_gather_bytes'])} + "
        f"reduce-scatter {fmt_bytes(s['reduce_scatter_bytes'])}"
        + (f"; all-reduce {fmt_bytes(s['all_reduce_bytes'])}" if s["all_reduce_bytes"] else "")
        + f") = {s['bytes_over_model']:.2f}x the model ({fmt_bytes(s['model_bytes'])}); "
        f"expected {s['expected_bytes_over_model']:.2f}x (2x, +1x for units resharded after forward)"
        + (f"; the gradients are reduced in {reduce_dtypes}" if reduce_dtypes else ""),
        f"peak memory ({s['memory_kind']}) {peak}",
    ] + ([f"optimizer step: {s['optimizer_collectives']:g} collectives, {fmt_bytes(s['optimizer_bytes'])} sent per "
          "step (not counted in bytes/step)"] if s.get("optimizer_collectives") else [])


def _fmt_count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"


def fmt_bytes(n: float) -> str:
    """``1.5 MiB``: bytes in the largest binary unit below 1024 (GiB at most)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# --- JSON --------------------------------------------------------------------------------------------
def step_dict(st: StepStats, t0: float) -> dict[str, Any]:
    """One step for ``Profiler.to_dict``; times relative to the profiler's start ``t0``."""
    return {
        "index": st.index,
        "step_s": st.step_s,
        "exposed_comm_s": st.exposed_s,
        "comm_busy_s": st.busy_s,
        "peak_memory": st.peak_memory,
        "units": {name or "<root>": _unit_dict(u) for name, u in st.units.items()},
        "collectives": [{**asdict(c), "t_issue": c.t_issue - t0, "t_done": c.t_done - t0,
                         "t_wait": (c.t_wait - t0) if c.t_wait else None, "time_s": c.time_s}
                        for c in st.collectives],
    }


def _unit_dict(u: UnitStats) -> dict[str, Any]:
    d = asdict(u)
    d.pop("unit")
    return d


# --- Chrome trace ------------------------------------------------------------------------------------
class _ChromeTrace:
    """Slices on the host track (steps, exposed waits) and on one lane per overlapping collective."""

    def __init__(self, rank: int, t0: float) -> None:
        self.pid, self.t0 = rank, t0
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}},
            {"ph": "M", "pid": rank, "tid": 0, "name": "thread_name", "args": {"name": "host / compute"}},
        ]
        self.lanes: dict[str, list[float]] = {}
        self.tids: dict[tuple[str, int], int] = {}

    def us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 3)

    def add_step(self, st: StepStats) -> None:
        self.events.append({"ph": "X", "pid": self.pid, "tid": 0, "name": f"step {st.index}", "ts": self.us(st.t_start),
                            "dur": round(st.step_s * 1e6, 3), "args": {"peak_memory": st.peak_memory}})
        for c in sorted(st.collectives, key=lambda c: c.t_issue):
            self.add_collective(c)

    def _tid(self, c: Collective) -> int:
        """The lane of ``c``: the first of its kind free at its issue (a new one when none is)."""
        ends = self.lanes.setdefault(c.kind, [])
        lane = next((i for i, end in enumerate(ends) if end <= c.t_issue), len(ends))
        if lane == len(ends):
            ends.append(c.t_done)
        else:
            ends[lane] = c.t_done
        key = (c.kind, lane)
        if key not in self.tids:
            self.tids[key] = len(self.tids) + 1
            self.events.append({"ph": "M", "pid": self.pid, "tid": self.tids[key], "name": "thread_name",
                                "args": {"name": f"{c.kind} #{lane}"}})
        return self.tids[key]

    def add_collective(self, c: Collective) -> None:
        unit = c.unit or "<root>"
        short = {"forward": "fwd", "backward": "bwd"}.get(c.phase, c.phase)
        tid = self._tid(c)
        args = {"unit": unit, "bytes": c.nbytes, "group_size": c.group_size, "prefetch": c.prefetch,
                "exposed_ms": c.exposed_s * 1e3}
        self.events.append({"ph": "X", "pid": self.pid, "tid": tid, "name": f"{c.kind} {unit} {short}",
                            "ts": self.us(c.t_issue), "dur": round(c.time_s * 1e6, 3), "args": args})
        if c.exposed_s > 0 and c.t_wait:
            self.events.append({"ph": "X", "pid": self.pid, "tid": 0, "name": f"wait {c.kind} {unit}",
                                "ts": self.us(c.t_wait), "dur": round(c.exposed_s * 1e6, 3), "args": args})


def chrome_trace(steps: list[StepStats], rank: int, t0: float) -> dict[str, Any]:
    """The Chrome/Perfetto trace of ``steps`` (``chrome://tracing`` or ui.perfetto.dev), as a dict."""
    trace = _ChromeTrace(rank, t0)
    for st in steps:
        trace.add_step(st)
    # Chrome wants the slices of one track properly nested: sort by start, longest first.
    events = sorted(trace.events, key=lambda e: (e["ph"] != "M", e.get("ts", 0.0), -e.get("dur", 0.0)))
    return {"traceEvents": events, "displayTimeUnit": "ms"}
