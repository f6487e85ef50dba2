"""Wrap-granularity tuner: sweep blocks-per-unit x reshard_after_forward, measure, recommend.

    python -m fully_shard.tune --model examples.train_gpt:build_model --batch examples.train_gpt:build_batch \\
        --world-size 2 --memory-budget-mb 300 --out runs/tune

It launches ``--world-size`` ranks itself with torch's elastic launcher and, at the fixed batch the
batch factory returns, tries ``k`` = 1, 2, 4, ... and all consecutive blocks per fully_shard unit,
each with ``reshard_after_forward`` True and False. For each configuration it measures the peak memory
per rank (CUDA allocator peak on GPU; peak RSS above the idle process on CPU), the step time (slowest
rank, median) and the share of the step spent waiting for communication (``fully_shard.profile``).
It prints a table, marks the configurations that fit the budget, recommends the fastest one that fits
with the reason, and writes ``tune.json`` and ``tune.png`` (memory vs step time) into ``--out``.

Factories: ``--model pkg.mod:fn`` returns the (unsharded) model; ``--batch pkg.mod:fn`` returns
``(inputs, targets)`` or ``inputs`` and may take the rank as its one argument. The loss is
``--loss pkg.mod:fn(output, targets)`` or, by default, cross-entropy for integer targets, mean squared
error for float targets, and ``output.float().pow(2).mean()`` without targets. The blocks are the
children of the ``nn.ModuleList`` named by ``--blocks`` (default: the largest ModuleList/Sequential of
same-class modules); the units are made by ``wrap.auto_wrap`` with a ``GranularityPolicy``.

A configuration that fails (an exception, an out-of-memory error, a rank that dies or hangs) is
recorded with its error and the sweep goes on: each configuration runs in its own process group, the
ranks agree through the rendezvous store on whether it finished, and if a rank is gone or stuck the
remaining configurations are relaunched in fresh processes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import importlib
import inspect
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

_RECORDS = "records.rank{rank}.jsonl"


@dataclass(frozen=True)
class TuneConfig:
    id: int
    blocks_per_unit: int
    reshard_after_forward: bool

    @property
    def label(self) -> str:
        return f"k={self.blocks_per_unit} {'reshard' if self.reshard_after_forward else 'keep'}"


@dataclass
class TuneResult:
    config: TuneConfig
    units: int = 0
    step_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None  # max over ranks
    peak_bytes_per_rank: list[int] = field(default_factory=list)
    comm_share: float | None = None  # exposed communication / step time, mean over ranks
    comm_busy_share: float | None = None
    bytes_over_model: float | None = None
    error: str | None = None
    fits: bool | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.step_s is not None


# --- factories ---------------------------------------------------------------------------------------
def load_object(spec: str, what: str) -> Any:
    """``"pkg.module:attr"`` -> the object (the current directory is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--{what} expects 'module:function', found {spec!r}. Fix: e.g. "
                         f"--{what} examples.train_gpt:build_{what}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--{what} {spec}: expected an importable module:function, found {type(e).__name__}: "
                         f"{e}. Fix: run from the directory the module is importable from (the current "
                         f"directory is on the path), or install the package.") from e
    return obj


def find_blocks(model: nn.Module, attr: str | None = None) -> list[nn.Module]:
    """The repeated blocks the tuner groups, in forward order: the children of ``model.<attr>`` or, by
    default, of the largest ModuleList/Sequential of same-class modules (``wrap.GranularityPolicy``)."""
    from .wrap import GranularityPolicy

    if attr:
        found = model.get_submodule(attr)
        if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) == 0:
            raise ValueError(f"--blocks {attr!r}: expected a non-empty nn.ModuleList, found {type(found).__name__}. "
                             "Fix: name the ModuleList holding the transformer blocks (e.g. 'layers').")
        return list(found)
    return [m for _, m in GranularityPolicy(1).blocks(model)]


def granularities(n_blocks: int) -> list[int]:
    """1, 2, 4, ... below ``n_blocks``, then ``n_blocks`` (the whole stack as one unit)."""
    ks, k = [], 1
    while k < n_blocks:
        ks.append(k)
        k *= 2
    return [*ks, n_blocks]


def sweep_configs(n_blocks: int, ks: Sequence[int] | None = None,
                  reshard: Sequence[bool] = (True, False)) -> list[TuneConfig]:
    ks = list(ks) if ks else granularities(n_blocks)
    return [TuneConfig(i, k, raf) for i, (k, raf) in enumerate((k, raf) for k in ks for raf in reshard)]


def shard_by_granularity(model: nn.Module, blocks: Sequence[nn.Module], k: int, *, reshard_after_forward: bool,
                         **kwargs: Any) -> int:
    """``k`` consecutive blocks per unit (``wrap.auto_wrap`` with a ``GranularityPolicy`` over the blocks'
    class), the rest of the model the root unit. Returns the number of units."""
    from .wrap import GranularityPolicy, auto_wrap

    classes = frozenset({type(b) for b in blocks})
    plan = auto_wrap(model, GranularityPolicy(k, block_classes=classes), reshard_after_forward=reshard_after_forward,
                     **kwargs)
    return len(plan.units)


def default_loss(output: Any, targets: Any) -> torch.Tensor:
    if isinstance(output, (tuple, list)):
        output = output[0]
    if targets is None:
        return output.float().pow(2).mean()
    if not targets.is_floating_point():
        return torch.nn.functional.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1))
    return torch.nn.functional.mse_loss(output.float(), targets.float())


def _call_batch(fn: Callable[..., Any], rank: int) -> Any:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    return fn(rank) if params else fn()


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


# --- worker side -------------------------------------------------------------------------------------
def _release_memory(use_cuda: bool) -> None:
    """Free what the previous configuration left: Python garbage, the CUDA cache, glibc's free heap."""
    gc.collect()
    if use_cuda:
        torch.cuda.empty_cache()
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _worker(spec: dict[str, Any]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    return int(record(_run_worker)(spec) or 0)  # an exception outside a configuration reaches the parent


def _run_worker(spec: dict[str, Any]) -> int:
    """One rank of the sweep (the elastic launcher's entrypoint): runs every pending configuration."""
    import torch.distributed as dist

    from .tools.memory import current_memory
    from .tools.profile import profile

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
    dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    store = dist.distributed_c10d._get_default_store()
    out = Path(spec["work_dir"])
    records = out / _RECORDS.format(rank=rank)
    model_fn = load_object(spec["model"], "model")
    batch_fn = load_object(spec["batch"], "batch")
    loss_fn = load_object(spec["loss"], "loss") if spec.get("loss") else default_loss
    mp = None
    if spec.get("bf16"):
        from .policy import MixedPrecisionPolicy

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def write(record: dict[str, Any]) -> None:
        with open(records, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def agree(tag: str, status: str) -> None:
        """Wait (through the store, not a collective: a failed rank may have left peers inside one)
        until every rank is done with ``tag``; if one is gone or stuck, leave: the parent relaunches."""
        key = f"fully_shard.tune/{spec['attempt']}/{tag}"
        store.set(f"{key}/{rank}", status)
        try:
            store.wait([f"{key}/{r}" for r in range(world)],
                       datetime.timedelta(seconds=float(spec["agree_timeout_s"])))
        except Exception:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(17)

    configs = [TuneConfig(**raw) for raw in spec["configs"]]
    if configs and not use_cuda:  # one unmeasured step first: one-time allocations (thread pools,
        write({"id": configs[0].id, "event": "start", "t": time.time()})  # comm buffers) are not memory
        pg = dist.new_group(backend=backend, timeout=timeout)
        with contextlib.suppress(Exception):  # a crash here is charged to configs[0]
            _measure(configs[0], dict(spec, warmup=1, steps=0), pg, device, model_fn, batch_fn, loss_fn, mp,
                     0, profile)
        agree("warmup", "done")
    for cfg in configs:
        write({"id": cfg.id, "event": "start", "t": time.time()})
        pg = dist.new_group(backend=backend, timeout=timeout)
        _release_memory(use_cuda)
        baseline = 0 if use_cuda else current_memory(device)
        result: dict[str, Any] = {"id": cfg.id, "event": "end", "rank": rank}
        try:
            result.update(_measure(cfg, spec, pg, device, model_fn, batch_fn, loss_fn, mp, baseline,
                                   profile))
        except BaseException as e:  # a bad configuration must not end the sweep
            kind = "out of memory" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
            result["error"] = f"{kind}: {e}".strip()[:2000]
            result["traceback"] = traceback.format_exc()[-4000:]
        result["t"] = time.time()
        write(result)
        agree(str(cfg.id), "error" if "error" in result else "ok")
        if "error" not in result:  # on error it is abandoned: its sequence numbers may disagree
            dist.destroy_process_group(pg)
        del pg
        gc.collect()
    write({"id": -1, "event": "barrier", "t": time.time()})
    dist.barrier()
    write({"id": -1, "event": "destroy", "t": time.time()})
    dist.destroy_process_group()
    write({"id": -1, "event": "exit", "t": time.time()})
    return 0


def _measure(cfg: TuneConfig, spec: dict[str, Any], pg: Any, device: torch.device, model_fn: Callable[[], Any],
             batch_fn: Callable[..., Any], loss_fn: Callable[..., Any], mp: Any, baseline: int,
             profile: Any) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    mesh = DeviceMesh.from_group(pg, device.type)
    torch.manual_seed(0)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {spec['model']} returned {type(model).__name__}; expected an nn.Module")
    blocks = find_blocks(model, spec.get("blocks"))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    units = shard_by_granularity(model, blocks, cfg.blocks_per_unit,
                                 reshard_after_forward=cfg.reshard_after_forward, **kwargs)
    if units != -(-len(blocks) // cfg.blocks_per_unit) + 1:
        raise RuntimeError(f"expected {-(-len(blocks) // cfg.blocks_per_unit)} block units + the root for "
                           f"{cfg.label}, found {units} units (are other modules of the block class outside "
                           "the blocks? Fix: pass --blocks <ModuleList name>)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = _to_device(_call_batch(batch_fn, rank), device)
    inputs, targets = batch if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)

    def step() -> None:
        loss = loss_fn(model(*args), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(int(spec["warmup"])):
        step()
    sync()
    times: list[float] = []
    if int(spec["steps"]) == 0:
        return {}
    with profile(model) as prof:
        for _ in range(int(spec["steps"])):
            sync()
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            step()
            sync()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=pg)
            times.append(float(elapsed.item()))
            prof.step()
    # the profiler starts a new peak window every step: the peak of the run is the largest step's
    peak = max(0, max(st.peak_memory for st in prof.steps) - baseline)
    summary = prof.summary()
    world = dist.get_world_size(pg)
    peaks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(peaks, torch.tensor([peak], dtype=torch.int64, device=device), group=pg)
    share = torch.tensor([summary["comm_share"], summary["comm_busy_share"]], dtype=torch.float64, device=device)
    dist.all_reduce(share, group=pg)
    return {"units": units, "step_times_s": times, "peak_bytes_per_rank": [int(p.item()) for p in peaks],
            "comm_share": float(share[0]) / world, "comm_busy_share": float(share[1]) / world,
            "bytes_over_model": summary["bytes_over_model"]}


# --- parent side -------------------------------------------------------------------------------------
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


def run_sweep(spec: dict[str, Any], configs: list[TuneConfig], world_size: int, work_dir: Path,
              progress: bool = True) -> list[TuneResult]:
    """Launch ``world_size`` ranks (relaunching after a crash) until every configuration has a result."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    work_dir.mkdir(parents=True, exist_ok=True)
    for old in work_dir.glob("records.rank*.jsonl"):
        old.unlink()
    results: dict[int, TuneResult] = {}
    pending = list(configs)
    attempt = 0
    bar = _progress(len(configs), progress)
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.25):
            done = {r["id"] for r in _read_records(work_dir / _RECORDS.format(rank=0)) if r.get("event") == "end"}
            n = min(len(configs), len(done | set(results)))
            if n != bar.n:
                bar.n = n
                bar.refresh()

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    old_env = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS", "PYTHONPATH")}
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed memory returns to the OS: RSS ~ live
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.get("threads", 1)))
    os.environ["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [old_env["PYTHONPATH"]])])
    # fork on CPU: the ranks start with torch already imported (seconds per launch); CUDA must not be
    # forked once initialized, so accelerator runs spawn fresh interpreters.
    start_method = "spawn" if spec.get("device") != "cpu" and torch.cuda.is_available() else "fork"
    try:
        while pending:
            attempt += 1
            launch_spec = dict(spec, configs=[asdict(c) for c in pending], attempt=attempt,
                               work_dir=str(work_dir))
            launch = LaunchConfig(
                min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"tune-{uuid.uuid4()}",
                rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                start_method=start_method, logs_specs=DefaultLogsSpecs(log_dir=str(work_dir / "logs"),
                                                                       redirects=Std.ALL))
            failure = None
            worker = importlib.import_module("fully_shard.tune")._worker  # picklable even under -m
            try:
                with _quiet_launcher():
                    elastic_launch(launch, worker)(launch_spec)
            except Exception as e:  # a rank died: record and relaunch the rest
                failure = e
            by_rank = [_read_records(work_dir / _RECORDS.format(rank=r)) for r in range(world_size)]
            progressed = False
            for cfg in pending:
                ends = [rec for recs in by_rank for rec in recs if rec.get("id") == cfg.id and rec.get("event") == "end"]
                starts = [rec for recs in by_rank for rec in recs if rec.get("id") == cfg.id and rec.get("event") == "start"]
                if not ends and not starts:
                    continue
                if len(ends) == world_size and all("error" not in r for r in ends):
                    results[cfg.id] = _result_from(cfg, ends)
                elif ends or starts:
                    results[cfg.id] = TuneResult(cfg, error=_error_of(ends, starts, world_size, failure))
                progressed = True
            pending = [c for c in pending if c.id not in results]
            if pending and not progressed:  # no configuration even started: the launch itself fails
                msg = _short_failure(failure) if failure else "the ranks exited without running a configuration"
                for cfg in pending:
                    results[cfg.id] = TuneResult(cfg, error=f"launch failed: {msg}")
                pending = []
            for old in work_dir.glob("records.rank*.jsonl"):  # the next attempt starts clean
                old.rename(old.with_suffix(f".attempt{attempt}"))
    finally:
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stop.set()
        watcher.join()
        bar.n = len(results)
        bar.refresh()
        bar.close()
    return [results[c.id] for c in configs]


def _result_from(cfg: TuneConfig, ends: list[dict[str, Any]]) -> TuneResult:
    r0 = min(ends, key=lambda r: r["rank"])
    times = r0["step_times_s"]
    peaks = r0["peak_bytes_per_rank"]
    return TuneResult(cfg, units=r0["units"], step_s=statistics.median(times), step_times_s=times,
                      peak_bytes=max(peaks), peak_bytes_per_rank=peaks, comm_share=r0["comm_share"],
                      comm_busy_share=r0["comm_busy_share"], bytes_over_model=r0["bytes_over_model"])


def _error_of(ends: list[dict[str, Any]], starts: list[dict[str, Any]], world: int, failure: Exception | None) -> str:
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


class _NoBar:
    n = 0

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="tune", unit="config", dynamic_ncols=True)


# --- report ------------------------------------------------------------------------------------------
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
        rows.append([str(c.blocks_per_unit), str(r.units), str(c.reshard_after_forward), f"{(r.peak_bytes or 0) / 2**20:.1f}",
                     f"{(r.step_s or 0) * 1e3:.1f}", _pct(r.comm_share), _pct(r.comm_busy_share),
                     f"{r.bytes_over_model or 0:.2f}x", fits, mark])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head) - 1)] + [0]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *rows]]
    lines.insert(1, "-" * max(len(line) for line in lines[:1]))
    return "\n".join(lines)


def plot(results: list[TuneResult], budget_bytes: int | None, best: TuneResult | None, path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
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


# --- CLI ---------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fully_shard.tune", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="module:function returning the unsharded model")
    ap.add_argument("--batch", required=True, help="module:function returning (inputs, targets) or inputs")
    ap.add_argument("--loss", default=None, help="module:function(output, targets) -> loss (optional)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--memory-budget-mb", type=float, default=None, help="peak memory per rank allowed (MiB)")
    ap.add_argument("--out", type=Path, default=Path("runs/tune"))
    ap.add_argument("--blocks", default=None, help="name of the ModuleList of blocks (default: the largest)")
    ap.add_argument("--granularities", default=None, help="comma-separated blocks per unit (default 1,2,4,..,all)")
    ap.add_argument("--reshard", default="true,false", help="reshard_after_forward values to try")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bf16 all-gather/compute, fp32 reductions")
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may take before a rank fails")
    ap.add_argument("--agree-timeout", type=float, default=30.0,
                    help="seconds ranks wait for each other after a configuration before relaunching")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        load_object(args.batch, "batch")
        if args.loss:
            load_object(args.loss, "loss")
        with torch.device("meta"):  # only to count the blocks: no memory, any size
            model = load_object(args.model, "model")()
        n_blocks = len(find_blocks(model, args.blocks))
    except ValueError as e:
        raise SystemExit(f"fully_shard.tune: {e}") from None
    n_params = sum(p.numel() for p in model.parameters())
    del model
    ks = None
    if args.granularities:
        ks = [n_blocks if s.strip() == "all" else int(s) for s in args.granularities.split(",") if s.strip()]
        bad = [k for k in ks if not 1 <= k <= n_blocks]
        if bad:
            raise SystemExit(f"--granularities {args.granularities}: expected values in 1..{n_blocks} or 'all', "
                             f"found {bad}")
    reshard = [s.strip().lower() in ("1", "true", "yes") for s in args.reshard.split(",") if s.strip()]
    configs = sweep_configs(n_blocks, ks, reshard)
    spec = {"model": args.model, "batch": args.batch, "loss": args.loss, "blocks": args.blocks,
            "steps": args.steps, "warmup": args.warmup, "bf16": args.bf16, "device": args.device,
            "threads": args.threads, "timeout_s": args.timeout, "agree_timeout_s": args.agree_timeout,
            "sys_path": [os.getcwd()]}
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and args.device == "auto" else "cpu"
    print(f"tuning {args.model}: {n_params / 1e6:.2f}M params, {n_blocks} blocks, {len(configs)} configurations, "
          f"{args.world_size} ranks on {device}", flush=True)
    t0 = time.perf_counter()
    results = run_sweep(spec, configs, args.world_size, args.out / "work", progress=not args.no_progress)
    budget = int(args.memory_budget_mb * 2**20) if args.memory_budget_mb is not None else None
    best, reason = recommend(results, budget)
    table = format_table(results, budget, best)
    mem_kind = "CUDA allocator peak" if device == "cuda" else "peak RSS above the idle process"
    print(f"\n{table}\n\npeak memory = {mem_kind}, max over ranks; step = median of {args.steps} steps, "
          f"slowest rank; comm wait = exposed communication / step")
    if best is not None:
        print(f"recommended: {best.config.blocks_per_unit} block(s) per unit, reshard_after_forward="
              f"{best.config.reshard_after_forward} -- {reason}")
    else:
        print(f"no recommendation: {reason}")
    title = (f"{args.model}: {n_params / 1e6:.1f}M params, {n_blocks} blocks, {args.world_size} ranks on {device}"
             + (f", budget {args.memory_budget_mb:.0f} MiB" if budget is not None else ""))
    plot(results, budget, best, args.out / "tune.png", title)
    report = {
        "model": args.model, "batch": args.batch, "world_size": args.world_size, "device": device,
        "params": n_params, "blocks": n_blocks, "memory_budget_bytes": budget, "memory_kind": mem_kind,
        "recommended": asdict(best.config) if best is not None else None, "reason": reason,
        "elapsed_s": time.perf_counter() - t0,
        "results": [asdict(r) for r in results],
    }
    (args.out / "tune.json").write_text(json.dumps(report, indent=1))
    (args.out / "tune.txt").write_text(table + "\n\n" + (f"recommended: {best.config.label} -- " if best else "")
                                        + reason + "\n")
    print(f"wrote {args.out / 'tune.json'}, {args.out / 'tune.png'}")
    return report


if __name__ == "__main__":
    main()
