"""Checkpoint data files on disk: safetensors write + fsync, header validation and xxh3 content digests.

The file layout is the safetensors package's (design/checkpoint-format.md section 2); the digest is
XXH3-128 of the whole file (section 4), computed at save from the tensors' memory instead of reading
the file back.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from safetensors.torch import save_file

from . import format as fmt
from .errors import CheckpointError

_READ_BLOCK = 16 << 20


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)




@dataclass(frozen=True)
class WrittenFile:
    """A data file as written: its size in bytes and its xxh3_128 digest (hex)."""

    size: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "digest": self.digest}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> WrittenFile:
        return cls(int(doc["size"]), str(doc["digest"]))


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> WrittenFile:
    """Write one safetensors file with the safetensors package, fsync it; return its size and digest."""
    save_file(tensors, path, metadata=metadata)
    fsync_path(path)
    return WrittenFile(os.stat(path).st_size, _digest_from_memory(path, tensors))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


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
        h.update(tensor_bytes(tensors[key].contiguous()))
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


@dataclass(frozen=True)
class TensorMeta:
    """What a data file records about one of its tensors: which logical tensor, and which rows of it."""

    fqn: str
    state: str | None  # optimizer state name, None for model and extra tensors
    global_shape: tuple[int, ...]
    row_offset: int

    def to_json(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "state": self.state, "global_shape": list(self.global_shape),
                "row_offset": self.row_offset}


def file_metadata(namespace: str, rank: int, world: int, tensors: Mapping[str, TensorMeta]) -> dict[str, str]:
    """safetensors ``__metadata__``: format, version, namespace, rank and per-tensor fqn/global shape/offset."""
    described = {key: meta.to_json() for key, meta in tensors.items()}
    return {"format": fmt.FORMAT_NAME, "format_version": str(fmt.FORMAT_VERSION), "namespace": namespace,
            "rank": str(rank), "world_size": str(world), "tensors": json.dumps(described, separators=(",", ":"))}
