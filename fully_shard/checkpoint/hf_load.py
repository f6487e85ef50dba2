"""checkpoint.load_hf: read a Hugging Face ``save_pretrained`` directory into a sharded model, shard on read.

Phases (each inside ``control.phase``, so bad input raises the same error on every rank; see
design/hf-interop.md):
1. opening: each rank opens the directory once, reads ``model.safetensors.index.json`` (if any) and
   parses the headers of its share of the files (file i on rank i mod W); the ranks exchange the
   parsed headers, so every header is parsed by one rank only.
2. planning: the key map turns HF names into model names; the structure (missing, unexpected, shape,
   dtype kind) is checked; each rank plans, per model tensor, the boxes of HF tensors that make up
   the block it holds, cut into pieces of at most ``_PIECE_BYTES``, and opens the files it reads.
3. reading: the pieces are read by a small thread pool, each with one ``pread`` per contiguous run,
   and copied into the local shards (dtype converted in the copy). Only an I/O error can fail here.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from .boxes import Box, runs, slabs
from .codec import ST_TO_TORCH
from .control import Control
from .direct import AlignedArena, as_tensor, open_direct, read_range
from .errors import CheckpointError, format_diff, short
from .hf_keys import COPY, STACK, TRANSPOSE, KeyMap, Link, RenameSpec
from .safetensors_io import DataFile, Header, open_regular
from .validate import loads_strict
from .views import View, model_views

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
MAX_HF_INDEX_BYTES = 100_000_000
_PIECE_BYTES = 16 << 20  # a read (and its dtype-conversion buffer) covers at most this much, or one row
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,250}\.safetensors$")
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


class HFLoadResult(NamedTuple):
    """What ``load_hf`` did not load, as ``nn.Module.load_state_dict`` reports it (empty when strict)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class HFDirectory:
    """A ``save_pretrained`` directory opened once: its descriptor, its safetensors files and weight map."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.dir_fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no such directory; fix: pass the directory save_pretrained wrote "
                                  f"(holding {HF_SINGLE} or {HF_INDEX})") from None
        except NotADirectoryError:
            raise CheckpointError(f"{path} is a file, expected a directory; fix: pass the directory that holds "
                                  f"{HF_SINGLE} or {HF_INDEX}") from None
        self.opened: dict[str, DataFile] = {}
        self.direct: dict[str, int | None] = {}  # a direct-I/O descriptor of each opened file (direct.py)
        try:
            self.weight_map, self.files = self._read_index()
        except BaseException:
            os.close(self.dir_fd)
            raise

    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        for f in self.opened.values():
            f.close()
        for fd in self.direct.values():
            if fd is not None:
                os.close(fd)
        self.opened.clear()
        self.direct.clear()
        os.close(self.dir_fd)

    def _read_index(self) -> tuple[dict[str, str] | None, list[str]]:
        where = self.where(HF_INDEX)
        fix = f"{HF_INDEX} must be a plain file inside the model directory (not a link, directory or FIFO)"
        try:
            fd = open_regular(HF_INDEX, dir_fd=self.dir_fd, where=where, fix=fix)
        except FileNotFoundError:
            listing = sorted(os.listdir(self.dir_fd))
            if HF_SINGLE not in listing:
                hint = " It is a fully_shard checkpoint: use checkpoint.load." if "index.json" in listing else ""
                raise CheckpointError(
                    f"{self.path}: expected {HF_SINGLE} or {HF_INDEX}, found {listing[:10]}"
                    f"{' ...' if len(listing) > 10 else ''}.{hint} fix: pass a directory written by "
                    "save_pretrained with safetensors (safe_serialization=True)") from None
            return None, [HF_SINGLE]
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_HF_INDEX_BYTES:
                raise CheckpointError(f"{where}: {size} bytes, more than the {MAX_HF_INDEX_BYTES} allowed; fix: the "
                                      "index is damaged")
            doc = loads_strict(f.read(), where, max_depth=4)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{where}: expected an object with a 'weight_map' of tensor name -> file name, found "
                                  f"{type(weight_map).__name__}; fix: the index is damaged: restore it")
        for key, name in weight_map.items():
            if not _FILE_NAME.match(name) or ".." in name:
                raise CheckpointError(f"{where}: weight_map[{key!r}] is {name!r}, expected a plain file name ending in "
                                      ".safetensors inside the directory; fix: the index is damaged: restore it")
        return weight_map, sorted(set(weight_map.values()))

    def open(self, name: str) -> DataFile:
        if name not in self.opened:
            try:
                self.opened[name] = DataFile(self.dir_fd, name, self.where(name), None)
            except CheckpointError as e:
                if "is missing" in str(e):
                    raise CheckpointError(f"{self.where(name)}: file is missing ({HF_INDEX} lists it); fix: download "
                                          "or copy the complete model directory") from None
                raise
        return self.opened[name]

    def parse(self, name: str) -> dict[str, list[Any]]:
        """Parse one file's header (and check it against the weight map): {key: [dtype, shape, begin, end]}."""
        f = self.open(name)
        header = f.header()
        if self.weight_map is not None:
            listed = {k for k, v in self.weight_map.items() if v == name}
            lacking = sorted(listed - set(header.tensors))
            extra = sorted(set(header.tensors) - listed)
            if lacking or extra:
                found = [f"{HF_INDEX} lists {short(lacking)} in this file, which lacks them"] if lacking else []
                found += [f"the file holds {short(extra)}, which the index does not list for it"] if extra else []
                raise CheckpointError(f"{f.where}: expected the tensors {HF_INDEX} lists for this file, found: "
                                      f"{'; '.join(found)}; fix: the directory mixes files of different saves: "
                                      "restore it")
        return {k: [d, list(s), b, e] for k, (d, s, b, e) in header.tensors.items()}

    def adopt(self, name: str, header: Mapping[str, list[Any]]) -> DataFile:
        f = self.open(name)
        f.adopt(Header({k: (d, tuple(s), b, e) for k, (d, s, b, e) in header.items()}, {}))
        if name not in self.direct:
            self.direct[name] = open_direct(f.fd) if sys.byteorder == "little" else None
        return f


@dataclass
class _Read:
    file: str
    key: str
    part: Box  # in the HF tensor's global indices
    dst: torch.Tensor  # a view of the local shard
    op: str
    dim: int
    dtype: torch.dtype  # the file's


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


class Arena(threading.local):
    """Each reading thread's conversion buffer, reused from piece to piece (fresh memory costs page faults)."""

    buf: torch.Tensor | None = None


def scratch(sizes: tuple[int, ...], dtype: torch.dtype, arena: Arena) -> torch.Tensor:
    """A buffer for one piece read in the file's dtype before conversion (the only memory a load allocates)."""
    n = math.prod(sizes) * dtype.itemsize
    if arena.buf is None or arena.buf.numel() < n:
        arena.buf = torch.empty(n, dtype=torch.uint8)  # grows to the largest piece, at most _PIECE_BYTES or a row
    return arena.buf[:n].view(dtype).view(sizes)


class _ReadPlan:
    """Where each key of the directory lives (file, header) and how each rank's block is read from it."""

    def __init__(self, directory: HFDirectory, headers: dict[str, dict[str, list[Any]]]) -> None:
        self.dir = directory
        self.headers = headers
        self.where_key: dict[str, str] = {}  # HF key -> file
        for name, tensors in headers.items():
            for key in tensors:
                self.where_key[key] = name
        self.reads: list[_Read] = []
        self.structure: dict[str, list[Any]] = {}

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(self.headers[f][k][1]) for k, f in self.where_key.items()}

    def hf_dtype(self, key: str) -> str:
        return str(self.headers[self.where_key[key]][key][0])

    def plan(self, model: nn.Module, key_map: KeyMap, strict: bool) -> HFLoadResult:
        views, aliases = model_views(model)
        groups: dict[str, list[str]] = {v.name: [v.name] for v in views}
        for alias, stored in aliases.items():
            groups[stored].append(alias)
        wanted = {n: v.shape for v in views for n in groups[v.name]}
        resolved = key_map.resolve_load(self.hf_shapes(), wanted)
        mismatched = list(resolved.problems)
        missing: list[str] = []
        chosen: dict[str, str] = {}
        for v in views:
            source = next((n for n in groups[v.name] if n in resolved.links), None)
            if source is None:
                missing += groups[v.name]
                continue
            chosen[v.name] = source
            for n in groups[v.name]:
                if n in resolved.shapes and tuple(resolved.shapes[n]) != v.shape:
                    mismatched.append(f"{n}: the model has shape {list(v.shape)}, the files give "
                                      f"{list(resolved.shapes[n])} (from {self._sources(resolved.links[n])})")
            for link in resolved.links[source]:
                dtype = ST_TO_TORCH.get(self.hf_dtype(link.hf))
                if dtype is None or _kind(dtype) != _kind(v.local.dtype):
                    mismatched.append(f"{link.hf} ({self.where_key[link.hf]}): dtype {self.hf_dtype(link.hf)} "
                                      f"cannot load into {v.name} of dtype {v.local.dtype} (a different kind)")
        unexpected = list(resolved.unexpected)
        self.structure = {v.name: [str(v.local.dtype), list(v.shape)] for v in views}
        if mismatched or (strict and (missing or unexpected)):
            raise CheckpointError(format_diff(
                f"{self.dir.path} does not match the model:", missing if strict else [],
                [f"{k} ({self.where_key[k]})" for k in unexpected] if strict else [], mismatched,
                "pass a key_map that maps the file's names to the model's (load_hf(..., key_map=...)), or build the "
                "model from the same config; strict=False loads what matches and returns the rest, never a "
                "shape/dtype difference"))
        for v in views:
            if v.name in chosen:
                self._plan_view(v, resolved.links[chosen[v.name]])
        return HFLoadResult(sorted(missing), sorted(unexpected))

    def _sources(self, links: list[Link]) -> str:
        names = [f"{link.hf} in {self.where_key[link.hf]}" for link in links]
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    def _plan_view(self, v: View, links: list[Link]) -> None:
        if v.local.device.type == "meta":
            raise CheckpointError(f"{v.name}: the model's parameters are on the meta device; load_hf copies into "
                                  "existing storage; fix: materialize first (model.to_empty(device=...)), then "
                                  "load_hf")
        for link in links:
            inter = v.held.intersect(link.model_box)
            if inter is None:
                continue
            dtype = ST_TO_TORCH[self.hf_dtype(link.hf)]
            for piece in slabs(inter, max(1, _PIECE_BYTES // dtype.itemsize)):
                self.reads.append(_Read(self.where_key[link.hf], link.hf, link.to_hf(piece),
                                        v.block(piece), link.op, link.dim, dtype))

    def open_files(self) -> None:
        for name in sorted({r.file for r in self.reads}):
            self.dir.adopt(name, self.headers[name])

    def run(self, threads: int) -> None:
        arena, pages = Arena(), AlignedArena()
        with torch.no_grad():
            if threads <= 1 or len(self.reads) <= 1:
                for r in self.reads:
                    self._read(r, arena, pages)
                return
            with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="load_hf") as pool:
                for future in [pool.submit(self._read, r, arena, pages) for r in self.reads]:
                    future.result()

    def _read(self, r: _Read, arena: Arena, pages: AlignedArena) -> None:
        f = self.dir.opened[r.file]
        try:
            direct = self.dir.direct.get(r.file)
            if direct is not None and self._copy_direct(f, direct, r, pages):
                return
            self._copy(f, r, arena)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{f.where}: reading {r.key!r} failed ({type(e).__name__}: {e})") from e

    @staticmethod
    def _copy_direct(f: DataFile, direct: int, r: _Read, pages: AlignedArena) -> bool:
        """A piece that is one contiguous range of the file: read past the page cache into this thread's
        page-aligned buffer, then converted into place (False: the piece is strided, use ``_copy``)."""
        _, shape, begin, _ = f.header().tensors[r.key]
        run, starts = runs(shape, r.part)
        if len(starts) != 1:
            return False
        item = r.dtype.itemsize
        lo, n = begin + starts[0] * item, run * item
        buf, at = read_range(f.fd, direct, lo, lo + n, pages, f.bad)
        src = as_tensor(buf, at, n, r.dtype, r.part.sizes)
        with torch.no_grad():
            r.dst.copy_(src.t() if r.op == TRANSPOSE else src.unsqueeze(r.dim) if r.op == STACK else src)
        return True

    @staticmethod
    def _copy(f: DataFile, r: _Read, arena: Arena) -> None:
        with torch.no_grad():  # grad mode is per thread: the pool's threads start with it on
            if r.op == COPY and r.dtype == r.dst.dtype:
                f.read_box(r.key, r.part, r.dst)  # straight into the shard when it is contiguous CPU memory
                return
            buf = scratch(r.part.sizes, r.dtype, arena)
            f.read_box(r.key, r.part, buf)
            src = buf.t() if r.op == TRANSPOSE else buf.unsqueeze(r.dim) if r.op == STACK else buf
            r.dst.copy_(src)


def load_hf(path: str | os.PathLike[str], model: nn.Module, *, key_map: KeyMap | RenameSpec = None,
            strict: bool = True, threads: int = 4,
            timeout: datetime.timedelta | float | None = None) -> HFLoadResult:
    """Load a Hugging Face ``save_pretrained`` directory into ``model`` (sharded by fully_shard, or plain).

    Collective when a process group is initialized. Each rank reads only the bytes of the blocks it
    holds (any placements: ``Shard(d)``, ``_StridedShard``, 2-D meshes) and copies them into its local
    shards, converting dtype in the copy; no rank holds a full tensor. ``key_map`` maps HF names to the
    model's (a KeyMap, or a rename: dict, regex pairs, callable). Tied parameters load once from
    whichever of their names the files hold. Nothing is copied before every rank has checked the
    files and the structure: missing and unexpected keys (when ``strict``), shapes, dtype kinds,
    headers, files the index names. Returns the missing and unexpected keys (empty when ``strict``).
    The model must be materialized (not on the meta device). ``threads``: reads in flight per rank.
    """
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    control = Control(timeout)
    path = os.path.abspath(os.fspath(path))
    what = f"checkpoint.load_hf({path!r})"
    facts: dict[str, Any] = {"strict": strict}
    directory: HFDirectory | None = None
    try:
        mine: dict[str, dict[str, list[Any]]] = {}
        with control.phase(f"{what}: opening the directory and reading file headers", facts=facts):
            directory = HFDirectory(path)
            facts["files"] = directory.files
            for i, name in enumerate(directory.files):
                if i % control.world == control.rank:
                    mine[name] = directory.parse(name)
        headers: dict[str, dict[str, list[Any]]] = {}
        for part in control.all_gather_json(mine, what):
            headers.update(part)
        plan = _ReadPlan(directory, headers)
        result = HFLoadResult([], [])
        with control.phase(f"{what}: matching the files to the model and planning reads", facts=facts):
            result = plan.plan(model, KeyMap.of(key_map), strict)
            facts["model structure"] = plan.structure
            plan.open_files()
        with control.phase(f"{what}: reading (after every check passed: only an I/O error can fail here, and it can "
                        "leave the model partially loaded)"):
            plan.run(threads)
    finally:
        if directory is not None:
            directory.close()
    return result
