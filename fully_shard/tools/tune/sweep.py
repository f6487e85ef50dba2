"""The parent side of the sweep: launch the ranks, relaunch after a crash, turn records into results."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import threading
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .config import RECORDS, LaunchSpec, SweepSpec, TuneConfig, TuneResult
from .worker import worker

_ENV = ("MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS", "PYTHONPATH")


def run_sweep(spec: SweepSpec, configs: list[TuneConfig], world_size: int, work_dir: Path,
              progress: bool = True) -> list[TuneResult]:
    """Launch ``world_size`` ranks (relaunching after a crash) until every configuration has a result."""
    work_dir.mkdir(parents=True, exist_ok=True)
    for old in work_dir.glob("records.rank*.jsonl"):
        old.unlink()
    results: dict[int, TuneResult] = {}
    pending = list(configs)
    attempt = 0
    with _progress(configs, results, work_dir, progress), _launch_env(spec):
        # fork on CPU: the ranks start with torch already imported (seconds per launch); CUDA must not be
        # forked once initialized, so accelerator runs spawn fresh interpreters.
        start_method = "spawn" if spec.get("device") != "cpu" and torch.cuda.is_available() else "fork"
        while pending:
            attempt += 1
            launch_spec = LaunchSpec(**spec, configs=[asdict(c) for c in pending], attempt=attempt,
                                     work_dir=str(work_dir))
            failure = _launch(launch_spec, world_size, work_dir, start_method)
            pending = _collect(pending, results, work_dir, world_size, failure)
            for old in work_dir.glob("records.rank*.jsonl"):  # the next attempt starts clean
                old.rename(old.with_suffix(f".attempt{attempt}"))
    return [results[c.id] for c in configs]


def _launch(spec: LaunchSpec, world_size: int, work_dir: Path, start_method: str) -> Exception | None:
    """One launch of the ranks; returns the launcher's error when a rank died."""
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"tune-{uuid.uuid4()}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
        start_method=start_method, logs_specs=DefaultLogsSpecs(log_dir=str(work_dir / "logs"),
                                                               redirects=Std.ALL))
    try:
        with _quiet_launcher():
            elastic_launch(launch, worker)(spec)
    except Exception as e:  # a rank died: record and relaunch the rest
        return e
    return None


def _collect(pending: list[TuneConfig], results: dict[int, TuneResult], work_dir: Path, world_size: int,
             failure: Exception | None) -> list[TuneConfig]:
    """Record a result for every configuration the launch reached; returns those still pending."""
    by_rank = [_read_records(work_dir / RECORDS.format(rank=r)) for r in range(world_size)]
    progressed = False
    for cfg in pending:
        ends = [rec for recs in by_rank for rec in recs if rec.get("id") == cfg.id and rec.get("event") == "end"]
        starts = [rec for recs in by_rank for rec in recs if rec.get("id") == cfg.id and rec.get("event") == "start"]
        if not ends and not starts:
            continue
        if len(ends) == world_size and all("error" not in r for r in ends):
            results[cfg.id] = _result_from(cfg, ends)
        else:
            results[cfg.id] = TuneResult(cfg, error=_error_of(ends, world_size, failure))
        progressed = True
    pending = [c for c in pending if c.id not in results]
    if pending and not progressed:  # no configuration even started: the launch itself fails
        msg = _short_failure(failure) if failure else "the ranks exited without running a configuration"
        for cfg in pending:
            results[cfg.id] = TuneResult(cfg, error=f"launch failed: {msg}")
        return []
    return pending


def _read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    return out


def _result_from(cfg: TuneConfig, ends: list[dict[str, Any]]) -> TuneResult:
    r0 = min(ends, key=lambda r: r["rank"])
    times = r0["step_times_s"]
    peaks = r0["peak_bytes_per_rank"]
    return TuneResult(cfg, units=r0["units"], step_s=statistics.median(times), step_times_s=times,
                      peak_bytes=max(peaks), peak_bytes_per_rank=peaks, comm_share=r0["comm_share"],
                      comm_busy_share=r0["comm_busy_share"], bytes_over_model=r0["bytes_over_model"])


def _error_of(ends: list[dict[str, Any]], world: int, failure: Exception | None) -> str:
    errors = sorted((r for r in ends if "error" in r), key=lambda r: r["t"])
    answered = {r["rank"] for r in ends}
    missing = [r for r in range(world) if r not in answered]
    if missing:  # a rank died (crash, OOM kill) or hung: that is the cause; peers only lost it
        codes = getattr(failure, "failures", None) or {}
        how = ", ".join(f"rank {r}" + (f" exit code {codes[r].exitcode}" if r in codes else "") for r in missing)
        msg = f"died or hung without a result: {how}"
        if errors:
            msg += f"; then rank {errors[0]['rank']}: {_one_line(errors[0]['error'])}"
        return msg
    first = errors[0]  # the first error is the cause; later ones are usually peers losing their connection
    return f"rank {first['rank']}: {_one_line(first['error'])}"


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def _short_failure(e: Exception) -> str:
    failures = getattr(e, "failures", None)
    if failures:
        parts = []
        for rank, f in sorted(failures.items()):
            message = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message or "")
            message = message.strip().splitlines()[-1] if message.strip() else ""
            parts.append(f"rank {rank}: exit code {f.exitcode}" + (f" ({message})" if message else ""))
        return ", ".join(parts)
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


@contextlib.contextmanager
def _launch_env(spec: SweepSpec) -> Iterator[None]:
    """The ranks' environment for the sweep, restored after it."""
    old_env = {k: os.environ.get(k) for k in _ENV}
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed memory returns to the OS: RSS ~ live
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.get("threads", 1)))
    os.environ["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [old_env["PYTHONPATH"]])])
    try:
        yield
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """The launcher logs every failed rank at length; the sweep reports failures itself."""
    names = ("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _Bar(Protocol):
    n: int

    def refresh(self) -> object: ...

    def close(self) -> object: ...


class _NoBar:
    n = 0

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def _bar(total: int, enabled: bool) -> _Bar:
    if not enabled:
        return _NoBar()
    try:  # tqdm is optional (the ``tools`` extra): without it, no bar
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    bar: _Bar = tqdm(total=total, desc="tune", unit="config", dynamic_ncols=True)
    return bar


@contextlib.contextmanager
def _progress(configs: list[TuneConfig], results: dict[int, TuneResult], work_dir: Path,
              enabled: bool) -> Iterator[None]:
    """A progress bar fed from rank 0's records while the sweep runs."""
    bar = _bar(len(configs), enabled)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.25):
            done = {r["id"] for r in _read_records(work_dir / RECORDS.format(rank=0)) if r.get("event") == "end"}
            n = min(len(configs), len(done | set(results)))
            if n != bar.n:
                bar.n = n
                bar.refresh()

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        bar.n = len(results)
        bar.refresh()
        bar.close()
