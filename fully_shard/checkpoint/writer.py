"""checkpoint.save: every rank writes its own rows once; rank 0 writes the index last and commits atomically.

Phases (each ends in a collective agreement, so a failure on one rank raises on all and never hangs):
1. describe: views of model/optimizer tensors, rows each rank writes, extra state encoding;
   rank 0 recovers any interrupted commit of ``path`` and creates the temporary sibling directory.
2. stage + write: each rank writes ``{model,optim,extra}-rankNNNNN.safetensors`` (fsynced, digested);
   with ``async_save`` the rows are first copied to host memory and written by a background thread.
3. commit (``SaveHandle.wait`` for async saves): ranks report their chunks and files; rank 0 assembles
   and validates the index, writes it, fsyncs and renames the directory onto ``path``; retention.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import xxhash

from . import files
from . import format as fmt
from .codec import Encoder, st_dtype
from .comm import Comm
from .format import CheckpointError
from .state_dict import View, describe, group_hyper, model_views, optimizer_params

_PENDING: list[SaveHandle] = []


def wait_pending() -> None:
    """Finish every outstanding async save, in order (collective)."""
    while _PENDING:
        _PENDING[0].wait()


@dataclass
class _Plan:
    """What this rank writes, and (on rank 0) the global description the index is built from."""

    staged: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # namespace -> key -> rows
    meta: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # namespace -> key -> metadata
    chunks: list[dict[str, Any]] = field(default_factory=list)
    skeleton: dict[str, Any] = field(default_factory=dict)
    extra: Any = None
    extra_digest: str = ""

    def add(self, namespace: str, key: str, name: str, data: torch.Tensor, rows: tuple[int, int],
            dtype: str, shape: tuple[int, ...], fqn: str, state: str | None) -> None:
        self.staged.setdefault(namespace, {})[key] = data
        self.meta.setdefault(namespace, {})[key] = {"fqn": fqn, "state": state, "global_shape": list(shape),
                                                     "row_offset": rows[0]}
        self.chunks.append({"ns": namespace, "name": name, "key": key, "rows": list(rows), "dtype": dtype,
                            "shape": list(shape)})


def _describe(comm: Comm, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Any) -> tuple[
        list[tuple[str, View, str, str | None]], _Plan, Encoder]:
    views, aliases = model_views(model)
    items: list[tuple[str, View, str, str | None]] = [("model", v, v.name, None) for v in views]
    plan = _Plan()
    shared = Encoder("shared/")  # rank 0's optimizer hyperparameters and non-tensor values
    skeleton: dict[str, Any] = {"model": {v.name: [v.dtype, list(v.shape)] for v in views}, "aliases": aliases,
                                "optimizer": None}
    if optimizer is not None:
        groups: list[dict[str, Any]] = []
        state: dict[str, dict[str, Any]] = {}
        sharded: list[list[str]] = []
        for i, (group, entries) in enumerate(zip(optimizer.param_groups, optimizer_params(model, optimizer))):
            hyper = shared.encode(group_hyper(group), f"optimizer.param_groups[{i}]")
            groups.append({**hyper, "params": [fqn for fqn, _ in entries]})
            for fqn, p in entries:
                for name, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        view = describe(fmt.optim_name(fqn, name), value)
                        items.append(("optim", view, fqn, name))
                        state.setdefault(fqn, {})[name] = {"tensor": [view.dtype, list(view.shape)]}
                        if view.sharded:
                            sharded.append([fqn, name])
                    else:
                        where = f"optimizer.state[{fqn!r}][{name!r}]"
                        state.setdefault(fqn, {})[name] = {"value": shared.encode(value, where)}
        skeleton["optimizer"] = {"param_groups": groups, "state": state, "sharded": sharded}
    mine = Encoder("extra/")
    plan.extra = mine.encode(extra, "extra")
    h = xxhash.xxh3_128(json.dumps(plan.extra, sort_keys=True).encode())
    for name, t in mine.tensors.items():
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(files._tensor_bytes(t.detach().cpu().contiguous()))
    plan.extra_digest = h.hexdigest()
    plan.skeleton = skeleton
    return items, plan, shared


def _stage(comm: Comm, items: list[tuple[str, View, str, str | None]], plan: _Plan, shared: Encoder,
           extra: Any, uniform_extra: bool, copy: bool) -> None:
    whole = {f"{ns}:{v.name}": v.local.numel() * v.local.element_size() for ns, v, _, _ in items if v.write is None}
    owner = fmt.assign_whole(whole, comm.world)
    for ns, view, fqn, state in items:
        rows = view.write
        if rows is None:
            rows = (0, fmt.rows_of(view.shape)) if owner[f"{ns}:{view.name}"] == comm.rank else None
        if rows is None or rows[0] == rows[1]:
            continue
        plan.add(ns, view.name, view.name, _host(view.rows(*rows), copy), rows, view.dtype, view.shape, fqn, state)
    blobs: dict[str, torch.Tensor] = {}
    if comm.rank == 0:
        blobs.update(shared.tensors)
    if comm.rank == 0 or not uniform_extra:
        # Extra state identical on every rank is stored once (rank 0); otherwise each rank stores its own.
        extra_enc = Encoder("extra/" if uniform_extra else f"extra/r{comm.rank}/")
        plan.extra = extra_enc.encode(extra, "extra")
        blobs.update(extra_enc.tensors)
    for name, t in blobs.items():
        shape = tuple(t.shape)
        plan.add("extra", name, name, _host(t, True), (0, fmt.rows_of(shape)), st_dtype(t.dtype, name), shape,
                 name, None)


def _host(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """The rows as a contiguous CPU tensor; a private copy when ``copy`` (async saves, training goes on)."""
    if tensor.device.type != "cpu":
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
        out.copy_(tensor, non_blocking=True)
        return out
    if copy or not tensor.is_contiguous():
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    return tensor.detach()


def _write(directory: str, plan: _Plan, rank: int, world: int) -> dict[str, dict[str, Any]]:
    records = {}
    for ns, tensors in plan.staged.items():
        name = f"{ns}-rank{rank:05d}.safetensors"
        meta = files.file_metadata(ns, rank, world, plan.meta[ns])
        records[name] = files.write_file(os.path.join(directory, name), tensors, meta)
    return records


class SaveHandle:
    """An async save in flight: files are written in the background; ``wait()`` (collective) commits."""

    def __init__(self, comm: Comm, path: str, tmp: str, nonce: str, plan: _Plan, keep_last: int | None) -> None:
        self.path = path
        self._comm, self._tmp, self._nonce, self._plan, self._keep = comm, tmp, nonce, plan, keep_last
        self._records: dict[str, dict[str, Any]] = {}
        self._error: BaseException | None = None
        self._committed = False
        self._thread = threading.Thread(target=self._run, name="fully_shard-checkpoint-writer", daemon=True)

    def _run(self) -> None:
        try:
            self._records = _write(self._tmp, self._plan, self._comm.rank, self._comm.world)
        except BaseException as e:
            self._error = e

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
        _commit(self._comm, self.path, self._tmp, self._nonce, self._plan, self._records, self._error, self._keep)


def save(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: Any = None, async_save: bool = False, keep_last: int | None = None) -> SaveHandle | None:
    """Save model (+ optimizer + extra) to the checkpoint directory ``path``. Collective.

    Returns None, or with ``async_save=True`` a SaveHandle as soon as the state is staged in host memory;
    the checkpoint exists once ``handle.wait()`` returns on every rank (the next save/load waits for it).
    ``keep_last=N`` deletes older checkpoints of the same numbered series after the commit.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    wait_pending()
    comm = Comm()
    path = os.path.abspath(os.fspath(path))
    error: BaseException | None = None
    nonce = tmp = ""
    try:
        items, plan, shared = _describe(comm, model, optimizer, extra)
        if comm.rank == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            files.recover(path)
            files.check_target(path)
            nonce = files.new_nonce()
            tmp = files.tmp_dir(path, nonce)
            os.mkdir(tmp)
    except BaseException as e:
        error = e
    _agree_or_clean(comm, error, f"checkpoint.save({path!r}): preparing", tmp)
    shared_info = comm.broadcast_json({"nonce": nonce})
    nonce, tmp = shared_info["nonce"], files.tmp_dir(path, shared_info["nonce"])
    digests = comm.all_gather_json(plan.extra_digest)
    uniform = len(set(digests)) == 1
    try:
        if not os.path.isdir(tmp):
            raise CheckpointError(f"rank {comm.rank} cannot see the directory {tmp} that rank 0 created; fix: save "
                                  "to a path on a filesystem shared by all ranks")
        _stage(comm, items, plan, shared, extra, uniform, copy=async_save)
        if not uniform:
            plan.skeleton["extra_per_rank"] = True
    except BaseException as e:
        error = e
    _agree_or_clean(comm, error, f"checkpoint.save({path!r}): staging", tmp)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if async_save:
        handle = SaveHandle(comm, path, tmp, nonce, plan, keep_last)
        _PENDING.append(handle)
        handle._thread.start()
        return handle
    records: dict[str, dict[str, Any]] = {}
    try:
        records = _write(tmp, plan, comm.rank, comm.world)
    except BaseException as e:
        error = e
    _commit(comm, path, tmp, nonce, plan, records, error, keep_last)
    return None


def _agree_or_clean(comm: Comm, error: BaseException | None, phase: str, tmp: str) -> None:
    """Agree on failure; on failure rank 0 removes the temporary directory (nothing was committed)."""
    try:
        comm.agree(error, phase)
    except CheckpointError:
        if comm.rank == 0 and tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(comm: Comm, path: str, tmp: str, nonce: str, plan: _Plan, records: dict[str, dict[str, Any]],
            error: BaseException | None, keep_last: int | None) -> None:
    report = {"files": records, "chunks": plan.chunks, "extra": plan.extra,
              "error": None if error is None else f"{type(error).__name__}: {error}"}
    reports = comm.all_gather_json(report)
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if rep["error"]]
    if failed:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        ranks = ", ".join(str(r) for r, _ in failed)
        raise CheckpointError(f"checkpoint.save({path!r}): writing failed on rank(s) {ranks}; rank "
                              f"{failed[0][0]} reports: {failed[0][1]}; the previous checkpoint at the path "
                              "(if any) is unchanged") from error
    error = None
    if comm.rank == 0:
        try:
            index = _assemble(comm.world, plan, reports)
            text = index.to_json()
            fmt.Index.parse(text, f"{tmp}/{fmt.INDEX_FILE}")  # validate before it becomes a checkpoint
            index_path = os.path.join(tmp, fmt.INDEX_FILE)
            with open(index_path, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            files.commit(tmp, path, nonce)
            if keep_last is not None:
                files.retain(path, keep_last)
        except BaseException as e:
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
    comm.agree(error, f"checkpoint.save({path!r}): commit")


def _assemble(world: int, plan: _Plan, reports: list[dict[str, Any]]) -> fmt.Index:
    """Rank 0: build the index from its skeleton and every rank's chunks; mismatches name the rank."""
    sk = plan.skeleton
    sigs: dict[tuple[str, str], tuple[str, tuple[int, ...]]] = {
        ("model", n): (d, tuple(s)) for n, (d, s) in sk["model"].items()}
    chunks: dict[tuple[str, str], list[fmt.Chunk]] = {k: [] for k in sigs}
    if sk["optimizer"] is not None:
        for fqn, names in sk["optimizer"]["state"].items():
            for name, v in names.items():
                if "tensor" in v:
                    key = ("optim", fmt.optim_name(fqn, name))
                    sigs[key] = (v["tensor"][0], tuple(v["tensor"][1]))
                    chunks[key] = []
    files_out: dict[str, fmt.FileEntry] = {}
    for rank, rep in enumerate(reports):
        for name, rec in rep["files"].items():
            files_out[name] = fmt.FileEntry(rec["size"], rec["digest"], rank)
        for c in rep["chunks"]:
            key = (c["ns"], c["name"])
            sig = (c["dtype"], tuple(c["shape"]))
            if c["ns"] == "extra":
                sigs.setdefault(key, sig)
                chunks.setdefault(key, [])
            if key not in sigs:
                raise CheckpointError(f"rank {rank} saved {c['ns']} tensor {c['name']!r}, which rank 0 does not have; "
                                      "fix: every rank must save the same model/optimizer structure")
            if sigs[key] != sig:
                raise CheckpointError(f"{c['ns']} tensor {c['name']!r} is {sig} on rank {rank} but {sigs[key]} on "
                                      "rank 0; fix: every rank must hold the same global shapes and dtypes")
            chunks[key].append(fmt.Chunk(f"{c['ns']}-rank{rank:05d}.safetensors", c["key"], *c["rows"]))

    def entry(key: tuple[str, str]) -> fmt.TensorEntry:
        return fmt.TensorEntry(sigs[key][0], sigs[key][1], tuple(sorted(chunks[key], key=lambda c: c.start)))

    model = {n: entry(("model", n)) for n in sk["model"]}
    optimizer = None
    if sk["optimizer"] is not None:
        state: dict[str, dict[str, fmt.TensorEntry | fmt.Value]] = {}
        for fqn, names in sk["optimizer"]["state"].items():
            state[fqn] = {name: entry(("optim", fmt.optim_name(fqn, name))) if "tensor" in v else fmt.Value(v["value"])
                          for name, v in names.items()}
        optimizer = fmt.OptimEntry(sk["optimizer"]["param_groups"], state,
                                   {(f, n) for f, n in sk["optimizer"]["sharded"]})
    blobs = {n: entry(k) for k, n in ((k, k[1]) for k in chunks if k[0] == "extra")}
    created = {"unix_time": time.time(), "writer": "fully_shard.checkpoint", "torch": torch.__version__}
    return fmt.Index(world_size=world, files=files_out, model=model, aliases=sk["aliases"], optimizer=optimizer,
                     blobs=blobs, extra=reports[0]["extra"],
                     extra_per_rank=[r["extra"] for r in reports] if sk.get("extra_per_rank") else None,
                     created=created)
