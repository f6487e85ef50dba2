"""checkpoint.save: every rank writes its own blocks once; rank 0 writes the index last and commits atomically.

Phases (each runs inside ``control.phase``, so a failure on one rank raises on all and never hangs):
1. preparing: views of model/optimizer tensors, the box each rank writes, extra state encoding;
   rank 0 recovers any interrupted commit of ``path`` and creates the temporary sibling directory.
2. staging: each rank's boxes (and extra tensors) gathered for writing; with ``async_save`` copied to
   host memory so training can go on.
3. writing: each rank writes ``{model,optim,extra}-rankNNNNN.safetensors`` (fsynced, digested); with
   ``async_save`` a background thread does this and ``SaveHandle.wait`` runs the rest.
4. commit: ranks report their chunks and files; rank 0 assembles and validates the index, writes it,
   fsyncs and renames the directory onto ``path``; retention.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import xxhash

from . import commit as commit_dir
from . import format as fmt
from . import rows as row_math
from . import safetensors_io as sio
from .boxes import Box, full_box
from .codec import Encoded, Encoder, st_dtype
from .control import Control
from .errors import CheckpointError, Signature
from .records import ChunkRecord, OptimSkeleton, RankReport, Skeleton, assemble_index
from .validate import parse_index
from .views import View, describe, group_hyper, mesh_roles, model_views, optimizer_params, split_writes

_PENDING: list[SaveHandle] = []


def wait_pending() -> None:
    """Finish every outstanding async save, in order (collective)."""
    while _PENDING:
        _PENDING[0].wait()


@dataclass(frozen=True)
class _Item:
    """One logical tensor to save: its view, and the FQN (and optimizer state name) it belongs to."""

    namespace: str
    view: View
    fqn: str
    state: str | None


@dataclass
class _WritePlan:
    """What this rank writes, and (on rank 0) the global description the index is built from."""

    skeleton: Skeleton
    staged: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # namespace -> key -> rows
    meta: dict[str, dict[str, sio.TensorMeta]] = field(default_factory=dict)  # namespace -> key -> metadata
    chunks: list[ChunkRecord] = field(default_factory=list)
    extra: Encoded = None
    extra_digest: str = ""

    def add(self, namespace: str, name: str, data: torch.Tensor, box: Box, dtype: str,
            shape: tuple[int, ...], fqn: str, state: str | None) -> None:
        self.staged.setdefault(namespace, {})[name] = data
        self.meta.setdefault(namespace, {})[name] = sio.TensorMeta(fqn, state, shape, box.offsets)
        self.chunks.append(ChunkRecord(namespace, name, box, dtype, shape))


def _signature(view: View) -> Signature:
    return view.dtype, view.shape


def _describe(model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Encoded) -> tuple[
        list[_Item], _WritePlan, Encoder]:
    views, aliases = model_views(model)
    items = [_Item("model", v, v.name, None) for v in views]
    shared = Encoder("shared/")  # rank 0's optimizer hyperparameters and non-tensor values
    optim_skeleton = None
    if optimizer is not None:
        groups: list[dict[str, Encoded]] = []
        state: dict[str, dict[str, Signature | fmt.Value]] = {}
        sharded: set[tuple[str, str]] = set()
        for i, (group, entries) in enumerate(zip(optimizer.param_groups, optimizer_params(model, optimizer))):
            hyper = shared.encode(group_hyper(group), f"optimizer.param_groups[{i}]")
            groups.append({**hyper, "params": [fqn for fqn, _ in entries]})
            for fqn, p in entries:
                for name, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        view = describe(fmt.optim_name(fqn, name), value)
                        items.append(_Item("optim", view, fqn, name))
                        state.setdefault(fqn, {})[name] = _signature(view)
                        if view.sharded:
                            sharded.add((fqn, name))
                    else:
                        where = f"optimizer.state[{fqn!r}][{name!r}]"
                        state.setdefault(fqn, {})[name] = fmt.Value(shared.encode(value, where))
        optim_skeleton = OptimSkeleton(groups, state, frozenset(sharded))
    plan = _WritePlan(Skeleton({v.name: _signature(v) for v in views}, aliases, optim_skeleton))
    mine = Encoder("extra/")
    plan.extra = mine.encode(extra, "extra")
    h = xxhash.xxh3_128(json.dumps(plan.extra, sort_keys=True).encode())
    for name, t in mine.tensors.items():
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(sio.tensor_bytes(t.detach().cpu().contiguous()))
    plan.extra_digest = h.hexdigest()
    return items, plan, shared


def _stage(control: Control, items: list[_Item], plan: _WritePlan, shared: Encoder, extra: Encoded, uniform_extra: bool,
           copy: bool) -> None:
    whole = {f"{it.namespace}:{it.view.name}": it.view.local.numel() * it.view.local.element_size()
             for it in items if it.view.whole}
    owner = row_math.assign_whole(whole, control.world)
    for it in items:
        view = it.view
        box = view.write
        if view.whole and owner[f"{it.namespace}:{view.name}"] != control.rank:
            box = None
        if box is None:
            continue
        plan.add(it.namespace, view.name, _host(view.block(box), copy), box, view.dtype, view.shape, it.fqn,
                 it.state)
    blobs: dict[str, torch.Tensor] = {}
    if control.rank == 0:
        blobs.update(shared.tensors)
    if control.rank == 0 or not uniform_extra:
        # Extra state identical on every rank is stored once (rank 0); otherwise each rank stores its own.
        extra_enc = Encoder("extra/" if uniform_extra else f"extra/r{control.rank}/")
        plan.extra = extra_enc.encode(extra, "extra")
        blobs.update(extra_enc.tensors)
    for name, t in blobs.items():
        shape = tuple(t.shape)
        if t.numel():
            plan.add("extra", name, _host(t, True), full_box(shape), st_dtype(t.dtype, name), shape, name, None)


def _host(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """The rows as a contiguous CPU tensor; a private copy when ``copy`` (async saves, training goes on)."""
    if tensor.device.type != "cpu":
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
        out.copy_(tensor, non_blocking=True)
        return out
    if copy or not tensor.is_contiguous():
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    return tensor.detach()


def _write(directory: str, plan: _WritePlan, rank: int, world: int) -> dict[str, sio.WrittenFile]:
    written = {}
    for ns, tensors in plan.staged.items():
        name = fmt.data_file_name(ns, rank)
        meta = sio.file_metadata(ns, rank, world, plan.meta[ns])
        written[name] = sio.write_file(os.path.join(directory, name), tensors, meta)
    return written


@dataclass(frozen=True)
class _Target:
    """Where a save goes: ``path``, its temporary sibling and nonce, and the retention setting."""

    path: str
    tmp: str
    nonce: str
    keep_last: int | None

    @property
    def what(self) -> str:
        return f"checkpoint.save({self.path!r})"


class SaveHandle:
    """An async save in flight: files are written in the background; ``wait()`` (collective) commits."""

    def __init__(self, control: Control, target: _Target, plan: _WritePlan, extra_per_rank: bool) -> None:
        self.path = target.path
        self._control, self._target, self._plan, self._extra_per_rank = control, target, plan, extra_per_rank
        self._written: dict[str, sio.WrittenFile] = {}
        self._error: BaseException | None = None
        self._committed = False
        self._thread = threading.Thread(target=self._run, name="fully_shard-checkpoint-writer", daemon=True)

    def _run(self) -> None:
        try:
            self._written = _write(self._target.tmp, self._plan, self._control.rank, self._control.world)
        except BaseException as e:
            self._error = e

    def _result(self) -> dict[str, sio.WrittenFile]:
        if self._error is not None:
            raise self._error
        return self._written

    def done(self) -> bool:
        """True once this rank's files are written (the commit still needs ``wait()``)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until this rank's files are written, then commit the checkpoint (collective, idempotent)."""
        if self._committed:
            return
        self._thread.join()
        self._committed = True
        if self in _PENDING:
            _PENDING.remove(self)
        _commit(self._control, self._target, self._plan, self._result, self._extra_per_rank)


def save(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: Encoded = None, async_save: bool = False, keep_last: int | None = None,
         timeout: datetime.timedelta | float | None = None) -> SaveHandle | None:
    """Save model (+ optimizer + extra) to the checkpoint directory ``path``. Collective.

    Returns None, or with ``async_save=True`` a SaveHandle as soon as the state is staged in host memory;
    the checkpoint exists once ``handle.wait()`` returns on every rank (the next save/load waits for it).
    ``keep_last=N`` then deletes the oldest checkpoints of ``path``'s series (same name but for the step,
    the last digit run) so that N remain. ``timeout`` (seconds or a timedelta, default 5 minutes) bounds
    how long a rank waits for the others at each phase; the error names the phase and the missing ranks.
    Identical state gives identical files (and digests).
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    wait_pending()
    control = Control(timeout)
    path = os.path.abspath(os.fspath(path))
    what = f"checkpoint.save({path!r})"
    facts: dict[str, Encoded] = {}
    with control.phase(f"{what}: describing", facts=facts):
        items, plan, shared = _describe(model, optimizer, extra)
        facts.update(_structure_facts(plan.skeleton))
    nonce = ""
    with control.phase(f"{what}: preparing the directory",
                    on_error=lambda: _remove_on_rank0(control, nonce and commit_dir.tmp_dir(path, nonce))):
        if control.rank == 0:
            nonce = _prepare_directory(path)
    nonce = control.broadcast_json(nonce, what=what)
    target = _Target(path, commit_dir.tmp_dir(path, nonce), nonce, keep_last)
    views = [it.view for it in items]
    gathered = control.all_gather_json({"extra": plan.extra_digest, "meshes": mesh_roles(views)}, what=what)
    uniform = len({g["extra"] for g in gathered}) == 1
    with control.phase(f"{what}: staging", on_error=lambda: _remove_on_rank0(control, target.tmp)):
        if not os.path.isdir(target.tmp):
            raise CheckpointError(f"rank {control.rank} cannot see the directory {target.tmp} that rank 0 created; "
                                  "fix: save to a path on a filesystem shared by all ranks")
        split_writes(views, [g["meshes"] for g in gathered], control.rank)
        _stage(control, items, plan, shared, extra, uniform, copy=async_save)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if async_save:
        handle = SaveHandle(control, target, plan, extra_per_rank=not uniform)
        _PENDING.append(handle)
        handle._thread.start()
        return handle
    _commit(control, target, plan, lambda: _write(target.tmp, plan, control.rank, control.world),
            extra_per_rank=not uniform)
    return None


def _structure_facts(skeleton: Skeleton) -> dict[str, Encoded]:
    """What every rank must agree on before anything is written: an extra buffer on one rank, or an
    optimizer passed on one rank only, would otherwise be dropped or half written."""
    optim = None if skeleton.optimizer is None else {
        fqn: {n: "value" if isinstance(v, fmt.Value) else [v[0], list(v[1])] for n, v in names.items()}
        for fqn, names in skeleton.optimizer.state.items()}
    return {"model structure": {n: [d, list(s)] for n, (d, s) in skeleton.model.items()},
            "tied weights": skeleton.aliases,
            "optimizer passed": skeleton.optimizer is not None,
            "optimizer state": optim,
            "optimizer param groups": None if skeleton.optimizer is None else
            [g["params"] for g in skeleton.optimizer.param_groups]}


def _prepare_directory(path: str) -> str:
    """Rank 0: finish/roll back an interrupted commit, check ``path`` may be replaced, create the tmp dir.

    Returns the nonce that names the temporary directory.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    commit_dir.recover(path)
    commit_dir.check_target(path)
    nonce = commit_dir.new_nonce()
    os.mkdir(commit_dir.tmp_dir(path, nonce))
    return nonce


def _remove_on_rank0(control: Control, tmp: str) -> None:
    """After a failed phase rank 0 removes the temporary directory (nothing was committed)."""
    if control.rank == 0 and tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def _commit(control: Control, target: _Target, plan: _WritePlan, write: Callable[[], dict[str, sio.WrittenFile]],
            extra_per_rank: bool) -> None:
    """Phases 3-4: write (or collect the background writer's result), report, index, rename, retain."""
    with control.phase(f"{target.what}: writing", on_error=lambda: _remove_on_rank0(control, target.tmp)):
        written = write()
    report = RankReport(written, tuple(plan.chunks), plan.extra)
    reports = [RankReport.from_json(r) for r in control.all_gather_json(report.to_json(), what=target.what)]
    with control.phase(f"{target.what}: commit", on_error=lambda: _remove_on_rank0(control, target.tmp)):
        if control.rank == 0:
            index = assemble_index(control.world, plan.skeleton, reports, extra_per_rank)
            text = index.to_json()
            parse_index(text, f"{target.tmp}/{fmt.INDEX_FILE}")  # validate before it becomes a checkpoint
            with open(os.path.join(target.tmp, fmt.INDEX_FILE), "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            commit_dir.commit(target.tmp, target.path, target.nonce)
            if target.keep_last is not None:
                commit_dir.retain(target.path, target.keep_last)
