"""checkpoint.load: open one generation, check everything, then copy; a failed load changes nothing.

Phases (each runs inside ``control.phase``, so bad input raises the same error on every rank):
1. opening: each rank opens the directory once and reads index.json (its digest checked first), matches
   the model and optimizer against it, plans its reads and opens every data file it needs through the
   directory's descriptor. The ranks agree on the index digest (one generation), the model structure,
   whether an optimizer was passed, and the flags.
2. verifying and decoding: headers, each file's own records against the index, digests of this rank's
   share; optimizer state and ``extra`` tensors read into fresh memory, ``extra`` and hyperparameters
   decoded, the optimizer's state dict built and checked, still without touching model or optimizer.
3. applying: each rank's blocks copied into its local shards (only an I/O error can fail here), then
   ``Optimizer.load_state_dict`` of the dict built in 2.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import format as fmt
from .boxes import Box, full_box, overlaps
from .codec import ST_TO_TORCH, Encoded, decode, tensor_refs
from .control import Control
from .errors import CheckpointError, Signature, check_structure
from .image import FileImage
from .snapshot import Snapshot, Vanished
from .state_dict import torch_optimizer_state
from .views import box_of, from_local_like, model_views, optimizer_params, state_is_sharded
from .writer import wait_pending

_OPEN_ATTEMPTS = 3  # a writer may delete the generation we opened before we opened its files


@dataclass
class Read:
    """One contiguous read: a box of a stored tensor into a destination view (also consolidate.py's)."""

    file: str
    key: str
    src: Box  # the part of the stored chunk tensor, relative to the chunk
    dst: torch.Tensor  # where it goes (a view of the target)
    take: Callable[[torch.Tensor], None] | None = None  # fresh ``dst`` of a whole chunk: may take a view instead


@dataclass
class _OptimLocal:
    """An optimizer state tensor read into fresh memory, before it is handed to the optimizer."""

    local: torch.Tensor
    param: torch.Tensor
    sharded: bool  # a DTensor laid out like ``param``
    shape: tuple[int, ...]

    def take(self, local: torch.Tensor) -> None:
        self.local = local

    def value(self) -> torch.Tensor:
        if self.sharded and isinstance(self.param, DTensor):
            return from_local_like(self.param, self.local, self.shape)
        return self.local


class Loader:
    """Plans and runs one generation's reads: model tensors in place, side state into fresh memory."""

    def __init__(self, control: Control, snapshot: Snapshot) -> None:
        self.control, self.snap, self.index = control, snapshot, snapshot.index
        self.model_reads: list[Read] = []
        self.side_reads: list[Read] = []  # optimizer state and blobs: fresh memory, read before the model
        self.optim_locals: dict[tuple[str, str], _OptimLocal] = {}
        self.blobs: dict[str, torch.Tensor] = {}
        self.structure: dict[str, Signature] = {}
        self.digests: set[str] = set()  # the files this rank hashes
        self.whole: set[str] = set()  # the files this rank reads whole into memory (image.py), hashed there
        self.images: dict[str, FileImage] = {}  # those of them this rank reads tensors from, until close()

    @property
    def where(self) -> str:
        return os.path.join(self.snap.path, fmt.INDEX_FILE)

    def add(self, reads: list[Read], entry: fmt.TensorEntry, held: Box, dst: torch.Tensor,
            take: Callable[[torch.Tensor], None] | None = None) -> None:
        """Plan reading box ``held`` of ``entry`` into ``dst``: only the stored parts that overlap it.

        ``take``: ``dst`` is fresh CPU memory that may be replaced by the stored chunk itself (a view of
        its file's image) when that chunk is exactly ``held``."""
        parts = overlaps(entry.chunks, held)
        whole = take is not None and len(parts) == 1 and parts[0][0].box == held and dst.device.type == "cpu"
        for chunk, part in parts:
            reads.append(Read(chunk.file, chunk.key, part.relative_to(chunk.box), dst[part.slices(held)],
                              take if whole else None))

    def plan_model(self, model: nn.Module, strict: bool) -> None:
        views, aliases = model_views(model)
        index = self.index
        found = {n: (e.dtype, e.shape) for n, e in index.model.items()}
        found.update({a: found[t] for a, t in index.aliases.items()})
        expected = {v.name: (v.dtype, v.shape) for v in views}
        expected.update({a: expected[t] for a, t in aliases.items()})
        self.structure = expected
        check_structure(expected, found, strict=strict,
                        title=f"checkpoint {self.snap.path} does not match the model:",
                        fix="load the checkpoint into the model it was saved from (same architecture and "
                            "dtypes); strict=False skips missing/unexpected keys but never dtype/shape differences")
        names_by_view: dict[str, list[str]] = defaultdict(list)
        for a, t in aliases.items():
            names_by_view[t].append(a)
        for v in views:
            source = next((n for n in [v.name, *names_by_view[v.name]] if n in found), None)
            if source is not None:
                self.add(self.model_reads, index.model[index.aliases.get(source, source)], v.held, v.local)

    def plan_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, strict: bool) -> None:
        saved = self.index.optimizer
        if saved is None:
            if strict:
                raise CheckpointError(f"checkpoint {self.snap.path} has no optimizer state, but an optimizer was "
                                      "passed; fix: pass optimizer=None, or strict=False to keep the optimizer "
                                      "as it is")
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
                sharded = state_is_sharded(p, name, value.shape, (fqn, name) in saved.sharded, existing.get(name))
                if sharded and isinstance(p, DTensor) and value.shape:
                    held, device = box_of(fmt.optim_name(fqn, name), p, value.shape), p.to_local().device
                else:
                    held, device = full_box(value.shape), torch.device("cpu")
                local = torch.empty(held.sizes, dtype=ST_TO_TORCH[value.dtype], device=device)
                optim_local = _OptimLocal(local, p, sharded and isinstance(p, DTensor), value.shape)
                self.optim_locals[(fqn, name)] = optim_local
                self.add(self.side_reads, value, held, local, take=optim_local.take)

    def encoded_trees(self, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, Encoded]]:
        """(where, tree) of every encoded value this rank decodes: its extra, hyperparameters, values."""
        trees: list[tuple[str, Encoded]] = [("extra", self.extra_tree())]
        saved = self.index.optimizer
        if optimizer is not None and saved is not None:
            trees += [(f"optimizer.param_groups[{i}]", {k: v for k, v in g.items() if k != "params"})
                      for i, g in enumerate(saved.param_groups)]
            trees += [(f"optimizer.state[{fqn!r}][{n!r}]", v.value) for fqn, names in saved.state.items()
                      for n, v in names.items() if isinstance(v, fmt.Value)]
        return trees

    def plan_blobs(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Every tensor the encoded trees refer to must be a blob; plan reading each into fresh memory."""
        for where, tree in self.encoded_trees(optimizer):
            for name in tensor_refs(tree):
                entry = self.index.blobs.get(name) if isinstance(name, str) else None
                if entry is None:
                    raise CheckpointError(f"{self.where}: {where} refers to tensor {name!r}, which is not under "
                                          "'blobs'; fix: the index is damaged")
                if name not in self.blobs:
                    self.blobs[name] = torch.empty(entry.shape, dtype=ST_TO_TORCH[entry.dtype])
                    self.add(self.side_reads, entry, full_box(entry.shape), self.blobs[name],
                             take=functools.partial(self.blobs.__setitem__, name))

    def extra_tree(self) -> Encoded:
        index = self.index
        if index.extra_per_rank is None:
            return index.extra
        if index.world_size == self.control.world:
            return index.extra_per_rank[self.control.rank]
        return index.extra

    def digest_share(self, namespaces: set[str]) -> set[str]:
        """The files this rank hashes: each used file by exactly one rank (its saving rank modulo W)."""
        used = {c.file for ns, _, e in self.index.all_tensors() if ns in namespaces for c in e.chunks}
        return {n for n in used if self.index.files[n].rank % self.control.world == self.control.rank}

    def check_files(self, reads: Sequence[Read] = ()) -> None:
        """Every opened file's header and records; the digests of this rank's share. The files in ``whole``
        are read into images (image.py) and hashed there; those that ``reads`` use are kept until close()."""
        stored = self.snap.stored_by_file()
        used = {r.file for r in reads}
        for name in sorted(self.snap.files):
            self.snap.check(name, stored[name])
            if name in self.whole:
                image = FileImage(self.snap.files[name], digest=name in self.digests)
                if image.digest is not None:
                    self.snap.verify_digest(name, image.digest)
                if name in used:
                    self.images[name] = image
                else:
                    image.release()
            elif name in self.digests:
                self.snap.verify_digest(name)

    def close(self) -> None:
        """Release the images' pages that no view uses, and close the files."""
        for image in self.images.values():
            image.release()
        self.images.clear()
        self.snap.close()

    def run(self, reads: list[Read]) -> None:
        by_file: dict[str, list[Read]] = defaultdict(list)
        for r in reads:
            by_file[r.file].append(r)
        with torch.no_grad():
            for name, file_reads in sorted(by_file.items()):
                f = self.snap.files[name]
                image = self.images.get(name)
                try:
                    for r in file_reads:
                        if image is None:
                            f.read_box(r.key, r.src, r.dst)
                        elif r.take is not None:
                            r.take(image.keep(r.key))
                        else:
                            r.dst.copy_(image.tensor(r.key)[r.src.slices()])
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"{f.where}: reading failed ({type(e).__name__}: {e})") from e

    def decode(self, where: str, tree: Encoded) -> Any:
        try:
            return decode(tree, self.blobs.__getitem__)
        except Exception as e:
            raise CheckpointError(f"{self.where}: {where}: cannot decode ({type(e).__name__}: {e}); fix: the index "
                                  "is damaged") from None

    def optimizer_state_dict(self) -> dict[str, Any]:
        saved = self.index.optimizer
        assert saved is not None
        state: dict[str, dict[str, Any]] = {}
        for fqn, names in saved.state.items():
            for name, value in names.items():
                if isinstance(value, fmt.Value):
                    state.setdefault(fqn, {})[name] = self.decode(f"optimizer.state[{fqn!r}][{name!r}]", value.value)
                elif (fqn, name) in self.optim_locals:
                    state.setdefault(fqn, {})[name] = self.optim_locals[(fqn, name)].value()
        groups = [{**self.decode(f"optimizer.param_groups[{i}]", {k: v for k, v in g.items() if k != "params"}),
                   "params": g["params"]} for i, g in enumerate(saved.param_groups)]
        return {"state": state, "param_groups": groups}

    def extra(self) -> Any:
        index = self.index
        if index.extra_per_rank is not None and index.world_size != self.control.world:
            warnings.warn(f"checkpoint {self.snap.path}: `extra` differed between the {index.world_size} saving "
                          f"ranks, and it is loaded on {self.control.world} ranks: every rank gets rank 0's extra "
                          "state",
                          stacklevel=4)
        return self.decode("extra", self.extra_tree())


def _open(control: Control, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool,
          verify: bool) -> Loader:
    """Phase 1 on this rank: one generation opened, matched and planned (retried if it vanished)."""
    for attempt in range(_OPEN_ATTEMPTS):
        snapshot = Snapshot(path)
        try:
            loader = Loader(control, snapshot)
            loader.plan_model(model, strict)
            if optimizer is not None:
                loader.plan_optimizer(model, optimizer, strict)
            loader.plan_blobs(optimizer)
            namespaces = {"model", "extra"} | ({"optim"} if optimizer is not None else set())
            share = loader.digest_share(namespaces)
            loader.digests = share if verify else set()
            used = {r.file for r in loader.model_reads + loader.side_reads}
            if sys.byteorder == "little":  # images hold the files' (little-endian) bytes as they are
                loader.whole = share & (used | loader.digests)
            snapshot.open(used | loader.digests)
            return loader
        except Vanished:
            snapshot.close()
            if attempt + 1 == _OPEN_ATTEMPTS:
                raise
        except BaseException:
            snapshot.close()
            raise
    raise AssertionError("unreachable")


def load(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         strict: bool = True, verify: bool = True, timeout: datetime.timedelta | float | None = None) -> Any:
    """Load a checkpoint saved at any world size/mesh into ``model`` (+ ``optimizer``); returns ``extra``.

    Collective when a process group is initialized; also works in a plain single process and into an
    unsharded module. Nothing is copied into the model or optimizer before the index, the structure,
    every file's header and records, ``extra`` and (``verify=True``) every content digest have been
    checked on all ranks. ``load`` never modifies the checkpoint directory. ``timeout`` (seconds or a
    timedelta, default 5 minutes) bounds how long a rank waits for the others at each phase.
    """
    wait_pending()
    control = Control(timeout)
    path = os.path.abspath(os.fspath(path))
    what = f"checkpoint.load({path!r})"
    facts: dict[str, Any] = {"optimizer passed": optimizer is not None, "strict, verify": [strict, verify]}
    loader: Loader | None = None
    try:
        with control.phase(f"{what}: opening", facts=facts):
            loader = _open(control, path, model, optimizer, strict, verify)
            facts["index digest (generation)"] = loader.index.digest
            facts["model structure"] = {k: [d, list(s)] for k, (d, s) in sorted(loader.structure.items())}
        prepared: dict[str, Any] | None = None
        with control.phase(f"{what}: verifying files, decoding optimizer state and extra"):
            loader.check_files(loader.model_reads + loader.side_reads)
            loader.run(loader.side_reads)
            if optimizer is not None and loader.index.optimizer is not None:
                prepared = torch_optimizer_state(model, optimizer, loader.optimizer_state_dict(), strict,
                                                 loader.index.optimizer.sharded, copy=False)
            result = loader.extra()
        with control.phase(f"{what}: reading the model and loading the optimizer state (after every check passed: "
                        "only an I/O error can fail here, and it can leave the model partially loaded)"):
            loader.run(loader.model_reads)
            if optimizer is not None and prepared is not None:
                optimizer.load_state_dict(prepared)
    finally:
        if loader is not None:
            loader.close()
    return result
