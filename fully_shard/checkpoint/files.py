"""Checkpoint files on disk: safetensors write/validate/digest, fsync, atomic directory commit and retention.

Commit protocol (see design/checkpoint-format.md): every rank writes into ``.NAME.tmp-NONCE`` next to
``path``; rank 0 writes ``index.json`` last, fsyncs, then renames the directory onto ``path``. An existing
checkpoint is first renamed aside to ``.NAME.old-NONCE``; ``recover`` finishes or rolls back an
interrupted commit, so a crash at any instant leaves ``path`` (or a recoverable sibling) loadable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from safetensors.torch import save_file

from . import format as fmt
from .format import CheckpointError

_READ_BLOCK = 16 << 20


def tmp_dir(path: str, nonce: str) -> str:
    return _sibling(path, "tmp", nonce)


def _sibling(path: str, kind: str, nonce: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{kind}-{nonce}")


def new_nonce() -> str:
    return uuid.uuid4().hex[:16]


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# safetensors files.
# --------------------------------------------------------------------------------------------------


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """Write one safetensors file with the safetensors package, fsync it; return its size and digest."""
    save_file(tensors, path, metadata=metadata)
    fsync_path(path)
    return {"size": os.stat(path).st_size, "digest": _digest_from_memory(path, tensors)}


def _tensor_bytes(tensor: torch.Tensor) -> Any:
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _digest_from_memory(path: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """Digest of the file's bytes: its header read back, then the tensors' memory in file order.

    safetensors writes each tensor's raw little-endian bytes back to back after the header, so hashing
    the in-memory tensors in offset order equals hashing the file, without reading the data back. Any
    surprise (layout, byte order) falls back to hashing the file itself.
    """
    if sys.byteorder != "little":
        return digest_file(path)
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        header_bytes = f.read(n)
    header = json.loads(header_bytes)
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")
    pos = 0
    for start, end, key in spans:
        if start != pos or key not in tensors or end - start != tensors[key].numel() * tensors[key].element_size():
            return digest_file(path)
        pos = end
    if 8 + n + pos != size:
        return digest_file(path)
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(header_bytes)
    for _, _, key in spans:
        h.update(_tensor_bytes(tensors[key].contiguous()))
    return h.hexdigest()


def digest_file(path: str) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(_READ_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


@dataclass
class Header:
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    data_start: int


def read_header(path: str, expected_size: int | None, where: str) -> Header:
    """Read and validate a safetensors header: bounds, JSON, dtypes, shapes and data offsets."""
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{where}: {problem}; fix: the file is damaged (truncated, overwritten or "
                               "corrupted): restore it or load an earlier checkpoint")
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointError(f"{where}: file is missing (index.json lists it"
                              f"{'' if expected_size is None else f' with {expected_size} bytes'}); fix: the "
                              "checkpoint is incomplete: restore the file or load an earlier checkpoint") from None
    if expected_size is not None and size != expected_size:
        raise bad(f"file has {size} bytes but index.json records {expected_size} (truncated or replaced)")
    if size < 8:
        raise bad(f"file has {size} bytes, too short for a safetensors header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > fmt.MAX_HEADER_BYTES:
            raise bad(f"header declares {n} bytes, more than the {fmt.MAX_HEADER_BYTES} allowed (oversized header)")
        if 8 + n > size:
            raise bad(f"header declares {n} bytes but the file has only {size - 8} after the length field")
        raw = f.read(n)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise bad(f"header is a JSON {type(doc).__name__}, expected an object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("header __metadata__ is not an object of strings")
    data = size - 8 - n
    for key, t in doc.items():
        ok = isinstance(t, dict) and t.get("dtype") in fmt.DTYPE_SIZES and isinstance(t.get("shape"), list) \
            and all(isinstance(s, int) and s >= 0 for s in t["shape"]) and isinstance(t.get("data_offsets"), list) \
            and len(t["data_offsets"]) == 2 and all(isinstance(o, int) for o in t["data_offsets"])
        if not ok:
            raise bad(f"header entry {key!r} is malformed: {str(t)[:120]}")
        begin, end = t["data_offsets"]
        nbytes = fmt.DTYPE_SIZES[t["dtype"]]
        for s in t["shape"]:
            nbytes *= s
        if not 0 <= begin <= end <= data or end - begin != nbytes:
            raise bad(f"tensor {key!r} has data offsets [{begin}, {end}) for {nbytes} bytes of "
                      f"{t['dtype']}{t['shape']}, outside the {data} data bytes of the file")
    return Header(tensors=doc, metadata=metadata, data_start=8 + n)


def file_metadata(namespace: str, rank: int, world: int, tensors: dict[str, dict[str, Any]]) -> dict[str, str]:
    """safetensors ``__metadata__``: format, version, namespace, rank and per-tensor fqn/global shape/offset."""
    return {"format": fmt.FORMAT_NAME, "format_version": str(fmt.FORMAT_VERSION), "namespace": namespace,
            "rank": str(rank), "world_size": str(world), "tensors": json.dumps(tensors, separators=(",", ":"))}


# --------------------------------------------------------------------------------------------------
# Directory protocol.
# --------------------------------------------------------------------------------------------------


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, fmt.INDEX_FILE))


def _siblings(path: str) -> list[tuple[str, str, str]]:
    """(kind, nonce, full path) of this checkpoint's temporary/old/deleting siblings."""
    parent, name = os.path.split(path)
    pattern = re.compile(r"^\." + re.escape(name) + r"\.(tmp|old|deleting)-([0-9a-f]+)$")
    out = []
    try:
        entries = os.listdir(parent or ".")
    except FileNotFoundError:
        return []
    for entry in entries:
        m = pattern.match(entry)
        if m:
            out.append((m.group(1), m.group(2), os.path.join(parent, entry)))
    return out


def recover(path: str, cleanup: bool = True) -> list[str]:
    """Finish or roll back an interrupted commit of ``path``; with ``cleanup`` delete leftovers.

    Single writer per path: call on one rank while no save of ``path`` is in flight. Returns the
    actions taken. Loading only restores a missing ``path`` (cleanup=False) and deletes nothing.
    """
    actions = []
    parent = os.path.dirname(path) or "."
    siblings = _siblings(path)
    if not os.path.exists(path):
        olds = {nonce: p for kind, nonce, p in siblings if kind == "old" and is_complete(p)}
        tmps = {nonce: p for kind, nonce, p in siblings if kind == "tmp" and is_complete(p)}
        promote = next((tmps[n] for n in olds if n in tmps), None)  # crashed between the two renames
        if promote is None and olds:
            promote = next(iter(olds.values()))  # cannot happen in our sequence; keep the old data
        if promote is not None:
            os.rename(promote, path)
            fsync_path(parent, directory=True)
            actions.append(f"restored {path} from {os.path.basename(promote)}")
    for kind, _, p in _siblings(path) if cleanup else []:
        shutil.rmtree(p, ignore_errors=True)
        actions.append(f"removed leftover {kind} directory {os.path.basename(p)}")
    return actions


def check_target(path: str) -> None:
    """``save`` replaces only checkpoints (or an empty directory): never a user's file or directory."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a directory; save writes a checkpoint directory and "
                              "will not replace it; fix: choose another path")
    if not is_complete(path) and os.listdir(path):
        raise CheckpointError(f"{path} exists and is not a fully_shard checkpoint (no {fmt.INDEX_FILE}); save "
                              "replaces only checkpoints; fix: choose another path or remove the directory")


def commit(tmp: str, path: str, nonce: str) -> None:
    """Rename the complete ``tmp`` directory onto ``path`` (moving an existing checkpoint aside first)."""
    parent = os.path.dirname(path) or "."
    fsync_path(tmp, directory=True)
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise CheckpointError(f"{path} exists and is not a checkpoint directory; fix: choose another path")
        old = _sibling(path, "old", nonce)
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_path(parent, directory=True)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
        fsync_path(parent, directory=True)


def retain(path: str, keep_last: int) -> list[str]:
    """Delete older checkpoints of the same series as ``path`` so that ``keep_last`` remain.

    The series is the sibling directories whose names equal ``path``'s with every digit run replaced
    (``step-000300`` and ``step-000600``) and that hold an ``index.json``; ordered by those numbers.
    ``path`` itself is always kept. Each victim is renamed to a hidden name before it is deleted, so a
    crash never leaves a half-deleted directory under a checkpoint name.
    """
    parent, name = os.path.split(path)
    key = fmt.series_key(name)
    if key is None:
        return []
    series = []
    for entry in os.listdir(parent or "."):
        full = os.path.join(parent, entry)
        k = fmt.series_key(entry)
        if k is not None and k[0] == key[0] and os.path.isdir(full) and is_complete(full):
            series.append((k[1], entry, full))
    series.sort()
    keep = {full for _, _, full in series[-keep_last:]} | {path}
    removed = []
    for _, entry, full in series:
        if full in keep:
            continue
        doomed = _sibling(full, "deleting", new_nonce())
        os.rename(full, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(entry)
    if removed:
        fsync_path(parent or ".", directory=True)
    return removed
