"""checkpoint.save_hf: write a sharded model as a Hugging Face directory that ``from_pretrained`` loads.

The HF tensors (the model's, through the inverse of the key map) are packed into files of at most
``max_shard_size`` in model order, tensors that share a source (a split) always in one file. Each file
has one writing rank (files spread over ranks by bytes); for each model tensor in turn, the ranks that
hold its blocks send them to that rank, which assembles the whole tensor once, derives the HF tensors
from it and writes them at their offsets (the header is known in advance). Files are written under
temporary names and renamed into place after every rank finished; ``model.safetensors.index.json``
is written last. Config and tokenizer files are the user's (design/hf-interop.md).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .boxes import Box
from .commit import new_nonce
from .control import Control
from .errors import CheckpointError
from .hf_keys import COPY, STACK, TRANSPOSE, KeyMap, Link, RenameSpec
from .hf_load import HF_INDEX, HF_SINGLE
from .safetensors_io import encode_header, fsync_path, tensor_bytes
from .views import View, mesh_roles, model_views, split_writes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_STALE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or '5GB' / '500MB' (powers of 10, as transformers) / '2GiB'."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size) if isinstance(size, str) else None
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size: expected a positive int (bytes) or a size like '5GB', '500MB', '2GiB', "
                         f"found {size!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass
class _Group:
    """Model tensors and the HF tensors made from them (a split joins several model tensors)."""

    models: list[str]
    hfs: list[str]
    nbytes: int = 0
    file: int = 0


@dataclass
class _File:
    name: str
    groups: list[_Group] = field(default_factory=list)
    nbytes: int = 0
    owner: int = 0


def _groups(views: list[View], links: dict[str, list[Link]]) -> list[_Group]:
    """Connected model/HF tensors, in model order."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for name, ls in links.items():
        for link in ls:
            parent[find("h:" + link.hf)] = find("m:" + name)
    out: dict[str, _Group] = {}
    for v in views:
        g = out.setdefault(find("m:" + v.name), _Group([], []))
        g.models.append(v.name)
        for link in links[v.name]:
            if link.hf not in g.hfs:
                g.hfs.append(link.hf)
    return list(out.values())


def _pack(groups: list[_Group], limit: int, world: int) -> list[_File]:
    files: list[_File] = []
    for g in groups:
        if not files or (files[-1].nbytes and files[-1].nbytes + g.nbytes > limit):
            files.append(_File(""))
        files[-1].groups.append(g)
        files[-1].nbytes += g.nbytes
    n = len(files)
    load = [0] * world
    for i, f in sorted(enumerate(files), key=lambda x: (-x[1].nbytes, x[0])):
        f.name = HF_SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        f.owner = min(range(world), key=lambda r: (load[r], r))
        load[f.owner] += f.nbytes
    for i, f in enumerate(files):
        for g in f.groups:
            g.file = i
    return files


class _Writer:
    """One file being written by its owner: header first, then each tensor at its offset."""

    def __init__(self, path: str, name: str, nonce: str, tensors: dict[str, torch.Tensor]) -> None:
        self.final = os.path.join(path, name)
        self.tmp = os.path.join(path, f".{name}.tmp-{nonce}")
        head, order = encode_header(tensors, {"format": "pt"})
        self.offsets: dict[str, int] = {}
        pos = len(head)
        for key in order:
            self.offsets[key] = pos
            pos += tensors[key].numel() * tensors[key].element_size()
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._write(head, 0)

    def _write(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def put(self, key: str, tensor: torch.Tensor) -> None:
        self._write(tensor_bytes(tensor.contiguous()), self.offsets[key])

    def finish(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def _hf_tensor(shape: tuple[int, ...], links: list[Link], full: dict[str, torch.Tensor],
               dtype: torch.dtype) -> torch.Tensor:
    """The HF tensor made of its links' boxes of the assembled model tensors."""
    one = links[0]
    if len(links) == 1 and one.op == COPY and one.model_box.sizes == tuple(full[one.model].shape) \
            and one.hf_box.sizes == shape:
        return full[links[0].model].to(dtype)
    out = torch.empty(shape, dtype=dtype)
    for link in links:
        src = full[link.model][link.model_box.slices()]
        src = src.t() if link.op == TRANSPOSE else src.squeeze(link.dim) if link.op == STACK else src
        out[link.hf_box.slices()] = src
    return out


def save_hf(path: str | os.PathLike[str], model: nn.Module, *, key_map: KeyMap | RenameSpec = None,
            max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
            timeout: datetime.timedelta | float | None = None) -> list[str]:
    """Write ``model`` (sharded by fully_shard, or plain) as safetensors files ``from_pretrained`` loads.

    Collective when a process group is initialized. Each whole tensor is assembled once, by the rank
    that writes its file (files spread over ranks); no other rank holds it. ``key_map``: the map
    ``load_hf`` reads with, inverted (a Fuse needs its ``sizes``; regex/callable renames need
    ``rename_inverse``). ``max_shard_size``: bytes per file (int, or '5GB', '500MB'); several files
    get ``model.safetensors.index.json``. ``dtype``: cast on write (default: the model's dtypes).
    Tied parameters are written once, under their first name (as transformers does). Files appear
    complete or not at all (temporary name + rename); earlier ``model*.safetensors`` files in ``path``
    are replaced, other files (config.json, tokenizer) are left alone: copy them yourself. Returns
    the names of the files written.
    """
    if sys.byteorder != "little":
        raise CheckpointError("save_hf writes little-endian safetensors and runs only on little-endian machines")
    limit = parse_size(max_shard_size)
    control = Control(timeout)
    path = os.path.abspath(os.fspath(path))
    what = f"checkpoint.save_hf({path!r})"
    facts: dict[str, Any] = {"max_shard_size": limit, "dtype": str(dtype)}
    writers: dict[int, _Writer] = {}

    def cleanup() -> None:
        for w in writers.values():
            w.abandon()

    with control.phase(f"{what}: planning", facts=facts, on_error=cleanup):
        if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
            raise CheckpointError(f"{path} exists and is not a directory; fix: pass a directory (it is created)")
        views, _aliases = model_views(model)
        for v in views:
            if v.local.device.type == "meta":
                raise CheckpointError(f"{v.name}: on the meta device, nothing to save; fix: load or initialize the "
                                      "model first")
        resolved = KeyMap.of(key_map).resolve_save({v.name: v.shape for v in views})
        by_name = {v.name: v for v in views}
        groups = _groups(views, resolved.links)
        out_dtype: dict[str, torch.dtype] = {}
        for g in groups:
            for name in g.models:
                for link in resolved.links[name]:
                    out_dtype.setdefault(link.hf, dtype or by_name[name].local.dtype)
            g.nbytes = sum(Box((0,) * len(resolved.shapes[h]), resolved.shapes[h]).numel * out_dtype[h].itemsize
                           for h in g.hfs)
        files = _pack(groups, limit, control.world)
        facts["files"] = [[f.name, f.owner, f.nbytes] for f in files]
        if control.rank == 0:
            os.makedirs(path, exist_ok=True)
    nonce = control.broadcast_json(new_nonce(), what=what)
    roles = control.all_gather_json(mesh_roles(views), what=what)
    split_writes(views, roles, control.rank)  # deterministic from the gathered roles: same outcome on every rank
    boxes = control.all_gather_json({v.name: None if v.write is None else [list(v.write.offsets), list(v.write.sizes)]
                                  for v in views if v.sharded}, what=what)
    written: list[str] = []
    with control.phase(f"{what}: assembling and writing", on_error=cleanup):
        error: BaseException | None = None
        for i, f in enumerate(files):
            if f.owner == control.rank:
                try:
                    meta = {h: torch.empty(resolved.shapes[h], dtype=out_dtype[h], device="meta")
                            for g in f.groups for h in g.hfs}
                    writers[i] = _Writer(path, f.name, nonce, meta)
                except Exception as e:
                    error = error or e
        for f_index, f in enumerate(files):
            for g in f.groups:
                full = {}
                for name in g.models:
                    got = _assemble(control, by_name[name], f.owner, boxes)
                    if got is not None:
                        full[name] = got
                if f.owner != control.rank or error is not None:
                    continue
                try:
                    links_of: dict[str, list[Link]] = {}
                    for name in g.models:
                        for link in resolved.links[name]:
                            links_of.setdefault(link.hf, []).append(link)
                    for h in g.hfs:
                        writers[f_index].put(h, _hf_tensor(resolved.shapes[h], links_of[h], full, out_dtype[h]))
                except Exception as e:
                    error = e
        if error is None:
            for w in writers.values():
                w.finish()
        if error is not None:
            raise error
    with control.phase(f"{what}: committing", on_error=cleanup):
        for w in writers.values():
            os.replace(w.tmp, w.final)
        writers.clear()
        if control.rank == 0:
            _commit_index(path, files)
        written = [f.name for f in files]
    return written


def _assemble(control: Control, v: View, owner: int, boxes: list[dict[str, Any]]) -> torch.Tensor | None:
    """The whole tensor ``v`` on ``owner`` (None elsewhere): each rank sends the block it writes."""
    with torch.no_grad():
        if not v.sharded:
            return v.local.detach().cpu() if control.rank == owner else None
        if control.rank != owner:
            if v.write is not None:
                _wait(dist.isend(v.block(v.write).contiguous(), dst=owner))
            return None
        full = torch.empty(v.shape, dtype=v.local.dtype)
        pending = []
        for r, rank_boxes in enumerate(boxes):
            b = rank_boxes.get(v.name)
            if b is None:
                continue
            box = Box(tuple(b[0]), tuple(b[1]))
            if r == control.rank:
                full[box.slices()] = v.block(box).cpu()
                continue
            buf = torch.empty(box.sizes, dtype=v.local.dtype, device=v.local.device)
            pending.append((box, buf, dist.irecv(buf, src=r)))
        for box, buf, work in pending:
            _wait(work)
            full[box.slices()] = buf.cpu()
        return full


def _wait(work: Any) -> None:
    if work is not None:
        work.wait()


def _commit_index(path: str, files: list[_File]) -> None:
    """Rank 0, after every file is in place: remove stale shards of an earlier save, write the index last."""
    names = {f.name for f in files}
    for entry in os.listdir(path):
        if _STALE.match(entry) and entry not in names:
            os.remove(os.path.join(path, entry))
    index = os.path.join(path, HF_INDEX)
    if len(files) == 1:
        if os.path.exists(index):
            os.remove(index)
    else:
        total = sum(f.nbytes for f in files)
        weight_map = {h: f.name for f in files for g in f.groups for h in g.hfs}
        doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        tmp = os.path.join(path, f".{HF_INDEX}.tmp-{new_nonce()}")
        with open(tmp, "w") as out:
            json.dump(doc, out, indent=2)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, index)
    fsync_path(path, directory=True)
