"""The tuner's verdict: the fastest configuration within the memory budget, a table, a plot."""

from __future__ import annotations

import math
from pathlib import Path

from .config import TuneResult


def recommend(results: list[TuneResult], budget_bytes: int | None) -> tuple[TuneResult | None, str]:
    """The fastest configuration within the budget, with the reason."""
    ok = [r for r in results if r.ok]
    for r in results:
        r.fits = None if not r.ok else (budget_bytes is None or (r.peak_bytes or 0) <= budget_bytes)
    if not ok:
        return None, "no configuration ran successfully; see the errors above"
    fitting = sorted((r for r in ok if r.fits), key=lambda r: r.step_s or math.inf)
    budget = f"{budget_bytes / 2**20:.0f} MiB" if budget_bytes is not None else None
    if not fitting:
        smallest = min(ok, key=lambda r: r.peak_bytes or 0)
        return None, (f"no configuration fits the {budget} budget; the smallest peak is "
                      f"{_mib(smallest.peak_bytes)} ({smallest.config.label}). Fix: a smaller batch, more "
                      "ranks, bf16 (--bf16) or activation checkpointing")
    best = fitting[0]
    where = f"the {len(fitting)} of {len(ok)} configurations within {budget}" if budget else \
        f"all {len(ok)} configurations (no memory budget given)"
    reason = (f"fastest of {where}: {_ms(best.step_s)} per step at {_mib(best.peak_bytes)} peak per rank, "
              f"{_pct(best.comm_share)} of the step waiting for communication")
    nxt = fitting[1] if len(fitting) > 1 else None
    if nxt is not None:
        reason += f"; the runner-up ({nxt.config.label}) is {(nxt.step_s or 0) / (best.step_s or 1) - 1:.1%} slower"
    cheaper = [r for r in ok if (r.peak_bytes or 0) < (best.peak_bytes or 0)]
    lean = min(cheaper, key=lambda r: r.peak_bytes or 0) if cheaper else None
    if lean is not None and lean is not nxt:
        reason += (f"; the leanest ({lean.config.label}) needs {_mib(lean.peak_bytes)} but takes "
                   f"{(lean.step_s or 0) / (best.step_s or 1) - 1:+.1%} time")
    fastest = min(ok, key=lambda r: r.step_s or math.inf)
    if fastest is not best:
        reason += (f"; the fastest overall ({fastest.config.label}, {_ms(fastest.step_s)}) needs "
                   f"{_mib(fastest.peak_bytes)}, over the budget")
    return best, reason


def format_table(results: list[TuneResult], budget_bytes: int | None, best: TuneResult | None) -> str:
    head = ["blocks/unit", "units", "reshard_after_fwd", "peak MiB/rank", "step ms", "comm wait", "comm busy",
            "bytes/model", "fits" if budget_bytes is not None else "", ""]
    rows = []
    for r in results:
        c = r.config
        mark = "<- recommended" if best is not None and r is best else ""
        if not r.ok:
            rows.append([str(c.blocks_per_unit), "-", str(c.reshard_after_forward), "-", "-", "-", "-", "-",
                         "", f"FAILED: {(r.error or '')[:90]}"])
            continue
        fits = ("yes" if r.fits else "no") if budget_bytes is not None else ""
        rows.append([str(c.blocks_per_unit), str(r.units), str(c.reshard_after_forward),
                     f"{(r.peak_bytes or 0) / 2**20:.1f}",
                     f"{(r.step_s or 0) * 1e3:.1f}", _pct(r.comm_share), _pct(r.comm_busy_share),
                     f"{r.bytes_over_model or 0:.2f}x", fits, mark])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)] + [0]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *rows]]
    lines.insert(1, "-" * max(len(line) for line in lines[:1]))
    return "\n".join(lines)


def plot(results: list[TuneResult], budget_bytes: int | None, best: TuneResult | None, path: Path,
         title: str) -> None:
    """Memory vs step time per configuration, the budget line and the recommendation, as a PNG."""
    import matplotlib  # optional (the ``tools`` extra), and only this function needs it

    matplotlib.use("Agg")  # before pyplot is imported: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for raf, marker, color in ((True, "o", "tab:blue"), (False, "s", "tab:orange")):
        pts = [r for r in results if r.ok and r.config.reshard_after_forward is raf]
        if not pts:
            continue
        ax.plot([(r.peak_bytes or 0) / 2**20 for r in pts], [(r.step_s or 0) * 1e3 for r in pts], marker=marker,
                linestyle="-", color=color, label=f"reshard_after_forward={raf}")
        for r in pts:
            ax.annotate(f"k={r.config.blocks_per_unit}", ((r.peak_bytes or 0) / 2**20, (r.step_s or 0) * 1e3),
                        textcoords="offset points", xytext=(5, 5), fontsize=8)
    if budget_bytes is not None:
        ax.axvline(budget_bytes / 2**20, color="gray", linestyle="--", label=f"budget {budget_bytes / 2**20:.0f} MiB")
    if best is not None:
        ax.scatter([(best.peak_bytes or 0) / 2**20], [(best.step_s or 0) * 1e3], s=250, facecolors="none",
                   edgecolors="red", linewidths=2, label=f"recommended: {best.config.label}", zorder=5)
    failed = [r.config.label for r in results if not r.ok]
    if failed:
        ax.text(0.01, 0.01, "failed: " + ", ".join(failed), transform=ax.transAxes, fontsize=8, color="red")
    ax.set_xlabel("peak memory per rank (MiB)")
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mib(n: int | None) -> str:
    return f"{(n or 0) / 2**20:.1f} MiB"


def _ms(s: float | None) -> str:
    return f"{(s or 0) * 1e3:.1f} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"

