"""checkpoint.load: verify first, then read only the rows each rank needs.

Phases (each runs inside ``comm.phase``, so bad input raises the same error on every rank):
1. index: rank 0 restores an interrupted commit if needed and reads index.json; all ranks validate it.
2. match: the model's (and optimizer's) keys, dtypes and shapes against the index; plan the reads.
3. verify: files' sizes and safetensors headers for the files this rank reads, plus the xxh3 digest of
   the files assigned to this rank (each file is hashed by exactly one rank).
4. read: ``safe_open`` + ``get_slice`` (memory-mapped) of the needed rows, copied into the tensors.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from . import commit as commit_dir
from . import format as fmt
from . import safetensors_io as sio
from .codec import ST_TO_TORCH, decode
from .comm import Comm
from .errors import CheckpointError, format_diff, structure_diff
from .rows import overlaps
from .state_dict import load_optimizer_state
from .validate import parse_index
from .views import from_local_like, held_like, model_views, optimizer_params, state_is_sharded
from .writer import wait_pending


@dataclass
class _Read:
    file: str
    key: str
    src: tuple[int, int]  # rows of the stored chunk tensor
    dst: torch.Tensor  # where they go (a view of the target)
    scalar: bool


def read_index(path: str, restore: bool = True) -> str:
    """The text of ``path``/index.json, with clear errors for paths that are not checkpoints."""
    if restore and not os.path.exists(path):
        commit_dir.recover(path, cleanup=False)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint directory; fix: check the path (checkpoints exist only "
                              "after save() returned / handle.wait() committed them)")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory; fix: pass the directory that "
                              f"holds {fmt.INDEX_FILE}")
    index_path = os.path.join(path, fmt.INDEX_FILE)
    if not os.path.isfile(index_path):
        listing = sorted(os.listdir(path))
        hint = ""
        if "model.safetensors" in listing or "model.safetensors.index.json" in listing:
            hint = " It looks like a Hugging Face model directory: read it with safetensors.torch.load_file and " \
                   "set_model_state_dict(model, sd, full=True)."
        elif ".metadata" in listing:
            hint = " It looks like a torch.distributed.checkpoint directory: use torch.distributed.checkpoint.load."
        raise CheckpointError(f"{path} is not a fully_shard checkpoint: it has no {fmt.INDEX_FILE} (found "
                              f"{listing[:10]}{' ...' if len(listing) > 10 else ''}). An interrupted save never "
                              f"leaves an index.{hint} fix: pass a committed checkpoint directory")
    size = os.path.getsize(index_path)
    if size > fmt.MAX_INDEX_BYTES:
        raise CheckpointError(f"{index_path}: {size} bytes, more than the {fmt.MAX_INDEX_BYTES} allowed; fix: the "
                              "index is damaged")
    with open(index_path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def _sig(dtype: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    return dtype, tuple(shape)


class _Loader:
    def __init__(self, comm: Comm, path: str, index: fmt.Index) -> None:
        self.comm, self.path, self.index = comm, path, index
        self.reads: list[_Read] = []
        self.optim_locals: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, bool, tuple[int, ...]]] = {}

    def add(self, entry: fmt.TensorEntry, held: tuple[int, int], dst: torch.Tensor) -> None:
        scalar = not entry.shape
        for chunk, s, e in overlaps(entry.chunks, *held):
            view = dst if scalar else dst[s - held[0]: e - held[0]]
            self.reads.append(_Read(chunk.file, chunk.key, (s - chunk.start, e - chunk.start), view, scalar))

    def plan_model(self, model: nn.Module, strict: bool) -> None:
        views, aliases = model_views(model)
        index = self.index
        found = {n: _sig(e.dtype, e.shape) for n, e in index.model.items()}
        found.update({a: found[t] for a, t in index.aliases.items()})
        expected = {v.name: _sig(v.dtype, v.shape) for v in views}
        expected.update({a: expected[t] for a, t in aliases.items()})
        missing, unexpected, mismatched = structure_diff(expected, found)
        if not strict:
            missing, unexpected = [], []
        if missing or unexpected or mismatched:
            raise CheckpointError(format_diff(
                f"checkpoint {self.path} does not match the model:", missing, unexpected, mismatched,
                "load the checkpoint into the model it was saved from (same architecture and dtypes); "
                "strict=False skips missing/unexpected keys but never dtype/shape differences"))
        names_by_view: dict[str, list[str]] = defaultdict(list)
        for a, t in aliases.items():
            names_by_view[t].append(a)
        for v in views:
            source = next((n for n in [v.name, *names_by_view[v.name]] if n in found), None)
            if source is None:
                continue
            stored = index.aliases.get(source, source)
            self.add(index.model[stored], v.held, v.local)

    def plan_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, strict: bool) -> None:
        saved = self.index.optimizer
        if saved is None:
            if strict:
                raise CheckpointError(f"checkpoint {self.path} has no optimizer state, but an optimizer was passed; "
                                      "fix: pass optimizer=None, or strict=False to keep the optimizer as it is")
            return
        params = {fqn: p for g in optimizer_params(model, optimizer) for fqn, p in g}
        for fqn, names in saved.state.items():
            p = params.get(fqn)
            if p is None:
                continue
            existing = optimizer.state.get(p, {})
            for name, value in names.items():
                if not isinstance(value, fmt.TensorEntry):
                    continue
                dtype = ST_TO_TORCH[value.dtype]
                sharded = state_is_sharded(p, name, value.shape, (fqn, name) in saved.sharded, existing.get(name))
                if sharded and isinstance(p, DTensor) and value.shape:
                    held = held_like(p, value.shape)
                    device = p.to_local().device
                else:
                    held, device = (0, value.rows), torch.device("cpu")
                local_shape = value.shape if not value.shape else (held[1] - held[0], *value.shape[1:])
                local = torch.empty(local_shape, dtype=dtype, device=device)
                self.optim_locals[(fqn, name)] = (local, p, sharded and isinstance(p, DTensor), value.shape)
                self.add(value, held, local)

    def used_files(self, namespaces: set[str]) -> set[str]:
        return {c.file for ns, _, e in self.index.all_tensors() if ns in namespaces for c in e.chunks}

    def check_files(self, reads: set[str], digests: set[str]) -> None:
        """Size + header (+ chunk dtype/shape) of ``reads | digests``; xxh3 digest of ``digests``."""
        chunks_by_file: dict[str, list[tuple[str, fmt.TensorEntry, fmt.Chunk]]] = defaultdict(list)
        for _ns, name, entry in self.index.all_tensors():
            for c in entry.chunks:
                chunks_by_file[c.file].append((name, entry, c))
        for name in sorted(reads | digests):
            rec = self.index.files[name]
            full = os.path.join(self.path, name)
            where = f"{full}"
            header = sio.read_header(full, rec.size, where)
            for tname, entry, c in chunks_by_file[name]:
                t = header.tensors.get(c.key)
                want = {"dtype": entry.dtype, "shape": list(entry.chunk_shape(c))}
                if t is None or t["dtype"] != want["dtype"] or t["shape"] != want["shape"]:
                    found = None if t is None else {"dtype": t["dtype"], "shape": t["shape"]}
                    raise CheckpointError(f"{where}: tensor {c.key!r} (rows {c.start}:{c.end} of {tname!r}) should be "
                                          f"{want}, found {found}; fix: the file does not belong to this index "
                                          "(mixed checkpoints?) or is damaged")
            if name in digests:
                digest = sio.digest_file(full)
                if digest != rec.digest:
                    raise CheckpointError(f"{where}: content digest {digest} differs from {rec.digest} recorded in "
                                          f"{fmt.INDEX_FILE} (xxh3_128): the file was modified or corrupted after "
                                          "the save; fix: restore it or load an earlier checkpoint "
                                          "(verify=False skips this check, not recommended)")

    def run_reads(self) -> None:
        by_file: dict[str, list[_Read]] = defaultdict(list)
        for r in self.reads:
            by_file[r.file].append(r)
        with torch.no_grad():
            for name, reads in sorted(by_file.items()):
                full = os.path.join(self.path, name)
                try:
                    with safe_open(full, framework="pt", device="cpu") as f:
                        for r in reads:
                            if r.scalar:
                                r.dst.copy_(f.get_tensor(r.key))
                            else:
                                r.dst.copy_(f.get_slice(r.key)[r.src[0]: r.src[1]])
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"{full}: reading failed ({type(e).__name__}: {e})") from e

    def blob(self, name: str) -> torch.Tensor:
        entry = self.index.blobs.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path}/{fmt.INDEX_FILE}: refers to tensor {name!r}, which is not under "
                                  "'blobs'; fix: the index is damaged")
        out = torch.empty(entry.shape, dtype=ST_TO_TORCH[entry.dtype])
        saved, self.reads = self.reads, []
        self.add(entry, (0, entry.rows), out)
        self.run_reads()
        self.reads = saved
        return out

    def optimizer_state_dict(self) -> dict[str, Any]:
        saved = self.index.optimizer
        assert saved is not None
        state: dict[str, dict[str, Any]] = {}
        for fqn, names in saved.state.items():
            for name, value in names.items():
                if isinstance(value, fmt.Value):
                    state.setdefault(fqn, {})[name] = decode(value.value, self.blob)
                elif (fqn, name) in self.optim_locals:
                    local, p, sharded, shape = self.optim_locals[(fqn, name)]
                    state.setdefault(fqn, {})[name] = from_local_like(p, local, shape) if sharded else local  # type: ignore[arg-type]
        groups = [{**decode({k: v for k, v in g.items() if k != "params"}, self.blob), "params": g["params"]}
                  for g in saved.param_groups]
        return {"state": state, "param_groups": groups}

    def extra(self) -> Any:
        index = self.index
        if index.extra_per_rank is None:
            return decode(index.extra, self.blob)
        if index.world_size == self.comm.world:
            return decode(index.extra_per_rank[self.comm.rank], self.blob)
        import warnings

        warnings.warn(f"checkpoint {self.path}: `extra` differed between the {index.world_size} saving ranks, and "
                      f"it is loaded on {self.comm.world} ranks: every rank gets rank 0's extra state",
                      stacklevel=3)
        return decode(index.extra, self.blob)


def load(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         strict: bool = True, verify: bool = True) -> Any:
    """Load a checkpoint saved at any world size/mesh into ``model`` (+ ``optimizer``); returns ``extra``.

    Collective when a process group is initialized; also works in a plain single process and into an
    unsharded module. Nothing is copied into the model before the index, the structure, every file's
    size/header and (``verify=True``) content digest have been checked on all ranks.
    """
    wait_pending()
    comm = Comm()
    path = os.path.abspath(os.fspath(path))
    what = f"checkpoint.load({path!r})"
    text: str | None = None
    with comm.phase(f"{what}: reading the index"):
        if comm.rank == 0:
            text = read_index(path)
    text = comm.broadcast_json(text)
    assert text is not None
    with comm.phase(f"{what}: matching the model"):
        loader = _Loader(comm, path, parse_index(text, os.path.join(path, fmt.INDEX_FILE)))
        loader.plan_model(model, strict)
        if optimizer is not None:
            loader.plan_optimizer(model, optimizer, strict)
    with comm.phase(f"{what}: verifying files"):
        used = loader.used_files({"model", "extra"} | ({"optim"} if optimizer is not None else set()))
        mine = {n for n in used if loader.index.files[n].rank % comm.world == comm.rank} if verify else set()
        loader.check_files({r.file for r in loader.reads}, mine)
    with comm.phase(f"{what}: reading (the model may be partially loaded)"):
        loader.run_reads()
    with comm.phase(f"{what}: loading optimizer state and extra"):
        if optimizer is not None and loader.index.optimizer is not None:
            load_optimizer_state(model, optimizer, loader.optimizer_state_dict(), strict,
                                 loader.index.optimizer.sharded, copy=False)
        result = loader.extra()
    return result
