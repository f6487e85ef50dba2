"""checkpoint.load: open one generation, check everything, then copy (staged) or read straight in (in place).

Phases (each runs inside ``control.phase``, so bad input raises the same error on every rank):
1. opening: each rank opens the directory once and reads index.json (its digest checked first), matches
   the model and optimizer against it, plans its reads and opens every data file it needs through the
   directory's descriptor. The ranks agree on the index digest (one generation), the model structure,
   whether an optimizer was passed, and the flags.
2. verifying and decoding: headers, each file's own records against the index; optimizer state the
   optimizer does not hold yet and ``extra`` tensors read into fresh memory, ``extra`` and
   hyperparameters decoded, the optimizer's state dict built and checked, still without touching model or
   optimizer. ``LoadMode.STAGED`` also reads every file of this rank's digest share into memory here
   and checks its digest (image.py), so a failed load changes nothing.
3. writing: each rank's blocks of the model, and of the optimizer state it already holds, copied into
   those tensors: out of the images (staged: only an I/O error can fail here), or streamed from the
   files as they are read and hashed (``LoadMode.IN_PLACE``, stream.py: a bad digest is found after
   its bytes were written). A failure from here on raises ``PartialLoadError``, saying on each rank
   which tensors were written (ledger.py).
4. ``Optimizer.load_state_dict`` of the dict built in 2, once every rank's writes and digests passed.
"""

from __future__ import annotations

import datetime
import enum
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
from .direct import POOL
from .errors import CheckpointError, PartialLoadError, Signature, check_structure
from .image import FileImage
from .ledger import Ledger, Read
from .snapshot import Snapshot, Vanished
from .state_dict import torch_optimizer_state
from .stream import stream, streamable
from .views import box_of, from_local_like, model_views, optimizer_params, state_is_sharded
from .writer import wait_pending

_OPEN_ATTEMPTS = 3  # a writer may delete the generation we opened before we opened its files
_LISTED = 50  # names per list in a PartialLoadError's message (the error's attributes hold them all)

__all__ = ["LoadMode", "Loader", "Read", "load"]


class LoadMode(enum.Enum):
    """What ``checkpoint.load`` writes when, so what a failed load leaves behind (design/checkpoint-format.md
    section 7)."""

    STAGED = "staged"
    """The default. Every file of the rank's share is read into memory and its digest checked on every
    rank before anything is written: a failed load changes nothing. Costs memory for the rank's share
    during the load (kept between loads, reclaimable: direct.BufferPool)."""
    IN_PLACE = "in_place"
    """DCP's contract: the bytes are copied into the model's and optimizer's existing tensors as they
    are read, hashed on the way; the index, the structure, headers and sizes are still checked first.
    A bad digest or a file that ends early is found after bytes were written: the load raises
    ``PartialLoadError`` saying which tensors were overwritten. Needs no memory beyond a few blocks."""


@dataclass
class _OptimLocal:
    """An optimizer state tensor: read into fresh memory, or into the tensor the optimizer already holds."""

    local: torch.Tensor
    param: torch.Tensor
    sharded: bool  # a DTensor laid out like ``param``
    shape: tuple[int, ...]
    existing: torch.Tensor | None = None  # the optimizer's own tensor, whose ``local`` is written in place

    def take(self, local: torch.Tensor) -> None:
        self.local = local

    def value(self) -> torch.Tensor:
        if self.existing is not None:
            return self.existing
        if self.sharded and isinstance(self.param, DTensor):
            return from_local_like(self.param, self.local, self.shape)
        return self.local


def _reusable(current: Any, param: torch.Tensor, sharded: bool, dtype: torch.dtype, shape: tuple[int, ...],
              held: Box) -> torch.Tensor | None:
    """The local tensor of the optimizer's own ``current`` state when the saved state can be read into it (same
    dtype, global shape and layout), else None (the state is read into fresh memory)."""
    if not isinstance(current, torch.Tensor) or current.dtype != dtype or tuple(current.shape) != shape:
        return None
    if not sharded:
        return None if isinstance(current, DTensor) else current.detach()
    if not isinstance(current, DTensor) or not isinstance(param, DTensor) or current.device_mesh != param.device_mesh \
            or tuple(current.placements) != tuple(param.placements):
        return None
    local = current.to_local()
    return local if tuple(local.shape) == held.sizes else None


class Loader:
    """Plans and runs one generation's reads: into the model's and optimizer's tensors, side state into fresh memory."""

    def __init__(self, control: Control, snapshot: Snapshot, mode: LoadMode = LoadMode.STAGED) -> None:
        self.control, self.snap, self.index, self.mode = control, snapshot, snapshot.index, mode
        self.model_reads: list[Read] = []
        self.optim_reads: list[Read] = []  # into optimizer state the optimizer already holds (phase 3)
        self.side_reads: list[Read] = []  # optimizer state it does not hold yet, and blobs: fresh memory (phase 2)
        self.optim_locals: dict[tuple[str, str], _OptimLocal] = {}
        self.blobs: dict[str, torch.Tensor] = {}
        self.structure: dict[str, Signature] = {}
        self.digests: set[str] = set()  # the files this rank hashes
        self.whole: set[str] = set()  # the files this rank reads whole, hashed as they arrive (image or stream)
        self.images: dict[str, FileImage] = {}  # files read into memory that this rank copies from, until close()
        self.verified: set[str] = set()  # files whose digest passed on this rank
        self.ledger = Ledger()  # what the writes of phase 3 have written into the user's tensors
        self.verify = True  # digests are checked (by the rank whose share a file is)
        self.optimizer_loaded = False  # step 4 done on this rank

    @property
    def where(self) -> str:
        return os.path.join(self.snap.path, fmt.INDEX_FILE)

    def add(self, reads: list[Read], entry: fmt.TensorEntry, held: Box, dst: torch.Tensor,
            take: Callable[[torch.Tensor], None] | None = None, name: str = "") -> None:
        """Plan reading box ``held`` of ``entry`` into ``dst``: only the stored parts that overlap it.

        ``take``: ``dst`` is fresh CPU memory that may be replaced by the stored chunk itself (a view of
        its file's image) when that chunk is exactly ``held``. ``name``: the logical tensor (ledger)."""
        parts = overlaps(entry.chunks, held)
        whole = take is not None and len(parts) == 1 and parts[0][0].box == held and dst.device.type == "cpu"
        for chunk, part in parts:
            reads.append(Read(chunk.file, chunk.key, part.relative_to(chunk.box),
                              dst if part == held else dst[part.slices(held)], take if whole else None, name))

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
                self.add(self.model_reads, index.model[index.aliases.get(source, source)], v.held, v.local,
                         name=v.name)

    def plan_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer, strict: bool) -> None:
        saved = self.index.optimizer
        if saved is None:
            if strict:
                raise CheckpointError(f"checkpoint {self.snap.path} has no optimizer state, but an optimizer was "
                                      "passed; fix: pass optimizer=None, or strict=False to keep the optimizer "
                                      "as it is")
            return
        params = {fqn: p for g in optimizer_params(model, optimizer) for fqn, p in g}
        held_boxes: dict[tuple[int, tuple[int, ...]], Box] = {}  # (id(param), shape) -> this rank's box
        for fqn, names in saved.state.items():
            p = params.get(fqn)
            if p is None:
                continue
            existing = optimizer.state.get(p, {})
            for name, value in names.items():
                if not isinstance(value, fmt.TensorEntry):
                    continue
                sharded = state_is_sharded(p, name, value.shape, (fqn, name) in saved.sharded, existing.get(name))
                key = fmt.optim_name(fqn, name)
                if sharded and isinstance(p, DTensor) and value.shape:
                    held = held_boxes.get((id(p), value.shape))
                    if held is None:
                        held = held_boxes[(id(p), value.shape)] = box_of(key, p, value.shape)
                    device = p.device  # a DTensor's device is its local tensor's
                else:
                    held, device = full_box(value.shape), torch.device("cpu")
                dtype = ST_TO_TORCH[value.dtype]
                current = existing.get(name)
                if self.mode is LoadMode.STAGED and isinstance(current, torch.Tensor) and current.device.type == "cpu":
                    mine = None  # staged: a view of the file's image instead of a copy (image.py)
                else:
                    mine = _reusable(current, p, sharded and isinstance(p, DTensor), dtype, value.shape, held)
                if mine is not None:  # read into the optimizer's own tensor in phase 3, as the model
                    self.optim_locals[(fqn, name)] = _OptimLocal(mine, p, sharded, value.shape, existing[name])
                    self.add(self.optim_reads, value, held, mine, name=key)
                    continue
                local = torch.empty(held.sizes, dtype=dtype, device=device)
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
        """Every opened file's header and records; the digests of this rank's share except those streamed
        in phase 3. The files in ``whole`` are read whole, hashed as they arrive: into images (image.py)
        when ``reads`` copy from them now or (staged) later, kept until close(); through a ring of blocks
        when nothing is read from them (stream.py); an in-place load streams the rest in ``write``."""
        stored = self.snap.stored_by_file()
        used = {r.file for r in reads}
        fresh = {r.file for r in self.side_reads}  # read from now, into fresh memory
        for name in sorted(self.snap.files):
            self.snap.check(name, stored[name])
            if name in self.whole and (name in fresh or (name in used and self.mode is LoadMode.STAGED)):
                image = FileImage(self.snap.files[name], digest=name in self.digests)
                if image.digest is not None:
                    self._verify(name, image.digest)
                if name in used:
                    self.images[name] = image
                else:
                    image.release()
            elif name in self.whole and name not in used:
                self._verify(name, stream(self.snap.files[name], [], self.ledger, digest=name in self.digests))
            elif name in self.digests and name not in self.whole:
                self._verify(name, None)

    def _verify(self, name: str, digest: str | None) -> None:
        """``digest`` (None: hash the file now) against the index's; the file is then verified on this rank."""
        if name in self.digests:
            self.snap.verify_digest(name, digest)
            self.verified.add(name)

    def close(self) -> None:
        """Release the images' pages that no view uses, and close the files."""
        for image in self.images.values():
            image.release()
        self.images.clear()
        self.snap.close()

    def run(self, reads: list[Read]) -> None:
        """Reads into fresh memory or consolidate's buffers: from images, else ``pread``."""
        self._copy(reads, ledger=None)

    def write(self, reads: list[Read]) -> None:
        """Phase 3: reads into the user's tensors, each byte counted in the ledger. Files in ``whole`` without
        an image are streamed (stream.py), hashed as their blocks are copied and verified at their end."""
        self.ledger.expect(reads)
        streamed: dict[str, list[Read]] = defaultdict(list)
        rest = []
        for r in reads:
            f = self.snap.files[r.file]
            if r.file in self.whole and r.file not in self.images and streamable(f, r):
                streamed[r.file].append(r)
            else:
                rest.append(r)
        for name in sorted({r.file for r in reads if r.file in self.whole and r.file not in self.images}):
            f = self.snap.files[name]
            try:
                with torch.no_grad():
                    digest = stream(f, streamed[name], self.ledger, digest=name in self.digests)
            except CheckpointError:
                raise
            except Exception as e:
                raise CheckpointError(f"{f.where}: reading failed ({type(e).__name__}: {e})") from e
            self._verify(name, digest)
        self._copy(rest, ledger=self.ledger)

    def _copy(self, reads: list[Read], ledger: Ledger | None) -> None:
        by_file: dict[str, list[Read]] = defaultdict(list)
        for r in reads:
            by_file[r.file].append(r)
        with torch.no_grad():
            for name, file_reads in sorted(by_file.items()):
                f = self.snap.files[name]
                image = self.images.get(name)
                try:
                    for r in file_reads:
                        if ledger is not None:
                            ledger.begin(r)
                        if image is None:
                            f.read_box(r.key, r.src, r.dst)
                        elif r.take is not None:
                            r.take(image.keep(r.key))
                        else:
                            r.dst.copy_(image.tensor(r.key)[r.src.slices()])
                        if ledger is not None:
                            ledger.wrote(r, r.src.numel)
                except CheckpointError:
                    raise
                except Exception as e:
                    raise CheckpointError(f"{f.where}: reading failed ({type(e).__name__}: {e})") from e

    def load_optimizer(self, optimizer: torch.optim.Optimizer | None, prepared: dict[str, Any]) -> None:
        """Step 4: ``Optimizer.load_state_dict`` of the state dict checked in step 2."""
        assert optimizer is not None
        optimizer.load_state_dict(prepared)
        self.optimizer_loaded = True

    def partial(self, error: CheckpointError, *, optimizer: bool) -> PartialLoadError:
        """``error`` (the phase's common verdict) with what this rank's tensors now hold (the ledger)."""
        staged = self.mode is LoadMode.STAGED
        w = self.ledger.written(lambda f: self.verify and (staged or f in self.verified))
        changed = len(w.whole) + len(w.partly)
        lines = [str(error), f"  {self.mode}: on rank {self.control.rank} this load had written into {changed} of the "
                 f"{len(self.ledger.need)} model/optimizer tensors it loads"
                 + (":" if changed else "; nothing on this rank was changed")]
        if changed:
            for label, names in (("overwritten", w.whole),
                                 ("partly overwritten (some of their elements; the others as before)", w.partly),
                                 ("not written (as before the load)", w.untouched),
                                 ("of the written ones, holding bytes not verified on this rank (their file's digest "
                                  "failed, was not checked yet, or is checked by another rank)", w.unverified)):
                if names:
                    lines.append(f"    {label}: {len(names)}: {_names(names)}")
            if self.optimizer_loaded:
                lines.append("    the optimizer's state dict was loaded on this rank; `extra` was not returned")
            else:
                lines.append("    not loaded: the optimizer's state dict beyond the tensors listed (its param_groups, "
                             "and the state this load does not write in place), and `extra`" if optimizer else
                             "    `extra` was not returned")
        lines.append("  fix: load a checkpoint into this model again before training on (this one once its files "
                     "are restored, or an earlier one); LoadMode.STAGED changes nothing when content is bad")
        return PartialLoadError("\n".join(lines), rank=self.control.rank, whole=w.whole, partly=w.partly,
                                untouched=w.untouched, unverified=w.unverified)

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


def _names(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" ... and {len(names) - _LISTED} more (all in the error's attributes)" if len(names) > _LISTED
                    else "")


def _open(control: Control, path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool,
          verify: bool, mode: LoadMode) -> Loader:
    """Phase 1 on this rank: one generation opened, matched and planned (retried if it vanished)."""
    for attempt in range(_OPEN_ATTEMPTS):
        snapshot = Snapshot(path)
        try:
            loader = Loader(control, snapshot, mode)
            loader.verify = verify
            loader.plan_model(model, strict)
            if optimizer is not None:
                loader.plan_optimizer(model, optimizer, strict)
            loader.plan_blobs(optimizer)
            namespaces = {"model", "extra"} | ({"optim"} if optimizer is not None else set())
            share = loader.digest_share(namespaces)
            loader.digests = share if verify else set()
            used = {r.file for r in loader.model_reads + loader.optim_reads + loader.side_reads}
            if sys.byteorder == "little":  # images and streams hold the files' (little-endian) bytes as they are
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


def _mode(mode: LoadMode | str) -> LoadMode:
    try:
        return LoadMode(mode.value if isinstance(mode, LoadMode) else mode)
    except ValueError:
        raise ValueError(f"checkpoint.load: mode={mode!r} is not a LoadMode; expected one of "
                         f"{[m.name for m in LoadMode]} (LoadMode.STAGED, the default, changes nothing when a load "
                         "fails; LoadMode.IN_PLACE reads straight into the tensors)") from None


def load(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         strict: bool = True, verify: bool = True, mode: LoadMode | str = LoadMode.STAGED,
         timeout: datetime.timedelta | float | None = None) -> Any:
    """Load a checkpoint saved at any world size/mesh into ``model`` (+ ``optimizer``); returns ``extra``.

    Collective when a process group is initialized; also works in a plain single process and into an
    unsharded module. Before anything is written, every rank checks the index, the structure, every
    file's header and records, and ``extra``. ``mode`` says when the data is checked:

    * ``LoadMode.STAGED`` (default): each rank reads its share of the files into memory and every
      content digest is checked on all ranks before anything is copied: a failed load changes nothing.
    * ``LoadMode.IN_PLACE``: the bytes go straight into the model's and optimizer's existing tensors,
      hashed as they arrive (``verify=True``); a bad digest, a file that ends early or an I/O error
      leaves them partly loaded and raises ``PartialLoadError`` naming, on each rank, the tensors that
      were overwritten. Faster, and needs no memory for the share (DCP's contract).

    Optimizer state the optimizer already holds, laid out as the saved state will be, is written into
    its tensors; other state is read into fresh memory. ``load`` never modifies the checkpoint
    directory. ``timeout`` (seconds or a timedelta, default 5 minutes) bounds how long a rank waits for
    the others at each phase.
    """
    mode = _mode(mode)
    wait_pending()
    control = Control(timeout)
    path = os.path.abspath(os.fspath(path))
    what = f"checkpoint.load({path!r})"
    facts: dict[str, Any] = {"optimizer passed": optimizer is not None,
                             "strict, verify, mode": [strict, verify, mode.value]}
    loader: Loader | None = None
    try:
        with control.phase(f"{what}: opening", facts=facts):
            loader = _open(control, path, model, optimizer, strict, verify, mode)
            facts["index digest (generation)"] = loader.index.digest
            facts["model structure"] = {k: [d, list(s)] for k, (d, s) in sorted(loader.structure.items())}
        prepared: dict[str, Any] | None = None
        checks = "verifying files" if mode is LoadMode.STAGED else "checking file headers"
        with control.phase(f"{what}: {checks}, decoding optimizer state and extra"):
            loader.check_files(loader.model_reads + loader.optim_reads + loader.side_reads)
            loader.run(loader.side_reads)
            if optimizer is not None and loader.index.optimizer is not None:
                prepared = torch_optimizer_state(model, optimizer, loader.optimizer_state_dict(), strict,
                                                 loader.index.optimizer.sharded, copy=False)
            result = loader.extra()
        staged = mode is LoadMode.STAGED
        writing = ("copying the model and optimizer state and loading the optimizer (after every check passed: only "
                   "an I/O error can fail here)" if staged else
                   "reading the model and optimizer state in place, verifying each file as it is read")
        try:
            with control.phase(f"{what}: {writing}"):
                loader.write(loader.model_reads + loader.optim_reads)
                if staged and prepared is not None:  # every digest passed in the phase before
                    loader.load_optimizer(optimizer, prepared)
            if not staged and prepared is not None:  # only once every rank's digests passed
                with control.phase(f"{what}: loading the optimizer state"):
                    loader.load_optimizer(optimizer, prepared)
        except CheckpointError as e:
            raise loader.partial(e, optimizer=optimizer is not None) from e
    finally:
        if loader is not None:
            loader.close()
        POOL.settle()
    return result
