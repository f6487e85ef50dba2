"""Checkpoint data files on disk: deterministic safetensors write + fsync, strict header checks, digests, reads.

The file layout is the safetensors package's (design/checkpoint-format.md section 2), written here so
that identical state gives identical bytes (the package orders ``__metadata__`` by hash). The digest
is XXH3-128 of the whole file (section 4), computed at save from the tensors' memory. Reading goes
through one descriptor per file (DataFile), never by path twice.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from . import format as fmt
from .boxes import Box, runs, slabs, span_read
from .codec import st_dtype
from .errors import CheckpointError
from .validate import loads_strict

_READ_BLOCK = 16 << 20
_SPAN_BYTES = 16 << 20  # a strided block read as enclosing ranges: each range at most this (or one index of dim 0)
SMALL_BYTES = 64 << 10  # tensors of at most this many bytes are written first within their element size


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(name: str, *, dir_fd: int | None, where: str, fix: str) -> int:
    """A read-only descriptor of ``name`` (relative to ``dir_fd``), refusing anything but a regular file.

    Opened without blocking (a FIFO would otherwise block the open forever) and without following a
    symbolic link; the kind is checked on the descriptor (fstat), so nothing can swap it in between.
    FileNotFoundError propagates (callers word "missing" their own way); every other refusal is a
    CheckpointError naming ``where`` and ending with ``fix``.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        link = "; it is a symbolic link" if os.path.islink(where) else ""
        raise CheckpointError(f"{where}: cannot open ({e.strerror}{link}); fix: {fix}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((k for test, k in _KINDS if test(mode)), f"not a regular file (mode {oct(mode)})")
        raise CheckpointError(f"{where}: expected a regular file, found {kind}; fix: {fix}")
    os.set_blocking(fd, True)
    return fd


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


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _little_endian(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous, CPU) with its elements' bytes in little-endian order, as safetensors stores them."""
    size = tensor.element_size()
    if sys.byteorder == "little" or size == 1 or tensor.numel() == 0:
        return tensor
    return tensor.reshape(-1).view(torch.uint8).reshape(-1, size).flip(1).contiguous().view(tensor.dtype)


def encode_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[bytes, list[str]]:
    """The length field + header of a safetensors file holding ``tensors``, and the order of their data.

    Deterministic: ``__metadata__`` first with sorted keys, then the tensors by decreasing element size
    (so every tensor starts aligned to its element size), within a size the small ones (at most
    ``SMALL_BYTES``) first, and otherwise in the given order. Small tensors are those other ranks read
    whole one by one (step counters, replicated buffers): side by side, a few pages hold them all, so
    one disk read (and the kernel's read-ahead) serves every such read of a load. The header is padded
    with spaces to a multiple of 8 bytes, as the safetensors package does.
    """
    def place(key: str) -> tuple[int, bool]:
        t = tensors[key]
        return -t.element_size(), t.numel() * t.element_size() > SMALL_BYTES

    order = sorted(tensors, key=place)  # stable: keeps the given order
    doc: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    pos = 0
    for key in order:
        t = tensors[key]
        nbytes = t.numel() * t.element_size()
        doc[key] = {"dtype": st_dtype(t.dtype, key), "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


def save_file(tensors: Mapping[str, torch.Tensor], path: str, metadata: Mapping[str, str]) -> None:
    """Write a safetensors file (a new file: never overwrites), byte for byte as encode_header describes."""
    head, order = encode_header(tensors, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(head)
        for key in order:
            f.write(tensor_bytes(_little_endian(tensors[key].contiguous())))


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> WrittenFile:
    """Write one safetensors file, fsync it; return its size and digest (hashed from memory, not re-read)."""
    save_file(tensors, path, metadata)
    fsync_path(path)
    return WrittenFile(os.stat(path).st_size, digest_from_memory(tensors, metadata))


def digest_from_memory(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """The digest of the file save_file writes for these arguments, hashed from memory (equal by design)."""
    head, order = encode_header(tensors, metadata)
    h = xxhash.xxh3_128(head)
    for key in order:
        h.update(tensor_bytes(_little_endian(tensors[key].contiguous())))
    return h.hexdigest()


@dataclass(frozen=True)
class Header:
    """A validated safetensors header: per key its dtype, shape and absolute byte range in the file."""

    tensors: dict[str, tuple[str, tuple[int, ...], int, int]]  # key -> (dtype, shape, begin, end), absolute
    metadata: dict[str, str]


class DataFile:
    """One data file of a checkpoint, opened once and read only through that descriptor.

    Opened relative to the checkpoint directory's descriptor, so every file comes from the same
    generation of the directory even while a writer renames a newer one into place (section 6).
    """

    def __init__(self, dir_fd: int, name: str, where: str, expected_size: int | None) -> None:
        """``expected_size``: the size index.json records (checked with the header); None: not known (HF files)."""
        self.name, self.where = name, where
        try:
            self.fd = open_regular(name, dir_fd=dir_fd, where=where,
                                   fix="checkpoint data files are plain files inside the checkpoint directory")
        except FileNotFoundError:
            raise CheckpointError(f"{where}: file is missing (index.json lists it with {expected_size} bytes); fix: "
                                  "the checkpoint is incomplete, or it was replaced or deleted while loading (a "
                                  "concurrent save with keep_last?): restore the file, retry, or load an earlier "
                                  "checkpoint") from None
        self.size = os.fstat(self.fd).st_size
        self.expected_size = expected_size
        self._header: Header | None = None

    def close(self) -> None:
        os.close(self.fd)

    def bad(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {problem}; fix: the file is damaged (truncated, overwritten or "
                               "corrupted): restore it or load an earlier checkpoint")

    def pread(self, offset: int, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out), offset)
        return bytes(out)

    def read_into(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            got = os.preadv(self.fd, [buf[done:]], offset + done)
            if got <= 0:
                raise self.bad(f"file ended at byte {offset + done}, {len(buf) - done} bytes short")
            done += got

    def header(self) -> Header:
        """Read and validate the header: sizes, strict JSON, dtypes, shapes, contiguous data offsets."""
        if self._header is None:
            self._header = self._read_header()
        return self._header

    def adopt(self, header: Header) -> None:
        """Use a header another rank read and validated (each file's header is parsed once per job); a header
        this rank parsed itself is kept."""
        if self._header is not None:
            return
        last = max((end for *_, end in header.tensors.values()), default=0)
        if last > self.size:
            raise self.bad(f"the header (as another rank read it) needs {last} bytes, the file has {self.size}")
        self._header = header

    def _read_header(self) -> Header:
        if self.expected_size is not None and self.size != self.expected_size:
            raise self.bad(f"file has {self.size} bytes but index.json records {self.expected_size} (truncated or "
                           "replaced)")
        if self.size < 8:
            raise self.bad(f"file has {self.size} bytes, too short for a safetensors header length")
        (n,) = struct.unpack("<Q", self.pread(0, 8))
        if n > fmt.MAX_HEADER_BYTES:
            raise self.bad(f"header declares {n} bytes, more than the {fmt.MAX_HEADER_BYTES} allowed "
                           "(oversized header)")
        if 8 + n > self.size:
            raise self.bad(f"header declares {n} bytes but the file has only {self.size - 8} after the length field")
        raw = self.pread(8, n)
        if not raw.startswith(b"{"):
            raise self.bad("header is not valid JSON (it must start with '{')")
        doc = loads_strict(raw.rstrip(b" "), self.where, max_depth=4)
        if not isinstance(doc, dict):
            raise self.bad(f"header is a JSON {type(doc).__name__}, expected an object")
        metadata = doc.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self.bad("header __metadata__ is not an object of strings")
        return Header(self._tensors(doc, 8 + n), metadata)

    def _tensors(self, doc: dict[str, Any], start: int) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
        out = {}
        for key, t in doc.items():
            ok = isinstance(t, dict) and set(t) == {"dtype", "shape", "data_offsets"} \
                and t["dtype"] in fmt.DTYPE_SIZES and isinstance(t["shape"], list) \
                and all(type(s) is int and s >= 0 for s in t["shape"]) and isinstance(t["data_offsets"], list) \
                and len(t["data_offsets"]) == 2 and all(type(o) is int for o in t["data_offsets"])
            if not ok:
                raise self.bad(f"header entry {key!r} is malformed: {str(t)[:120]}")
            out[key] = (t["dtype"], tuple(t["shape"]), *t["data_offsets"])
        pos, data = 0, self.size - start
        for key, (dtype, shape, begin, end) in sorted(out.items(), key=lambda kv: (kv[1][2], kv[1][3])):
            nbytes = fmt.DTYPE_SIZES[dtype] * math.prod(shape)
            if begin != pos or end - begin != nbytes or end > data:
                raise self.bad(f"tensor {key!r} has data offsets [{begin}, {end}) for {nbytes} bytes of "
                               f"{dtype}{list(shape)}; expected [{pos}, {pos + nbytes}) within the {data} data bytes "
                               "of the file (tensors back to back, in order)")
            pos = end
        if pos != data:
            raise self.bad(f"the tensors cover {pos} data bytes but the file has {data} after the header")
        return {k: (d, s, start + b, start + e) for k, (d, s, b, e) in out.items()}

    def digest(self) -> str:
        """xxh3_128 of the whole file, read through the descriptor."""
        h = xxhash.xxh3_128()
        buf = bytearray(min(_READ_BLOCK, max(self.size, 1)))
        view = memoryview(buf)
        offset = 0
        while True:
            n = os.preadv(self.fd, [view], offset)
            if not n:
                break
            h.update(view[:n])
            offset += n
        return h.hexdigest()

    def read_box(self, key: str, part: Box, dst: torch.Tensor) -> None:
        """Copy ``part`` (indices relative to stored tensor ``key``) into ``dst`` (of ``part.sizes``).

        A block of whole rows is one contiguous run: one ``pread`` straight into ``dst``. A strided block
        (``Shard(1)``, TP columns: one run per row) is read as the range enclosing its runs, once, into
        a buffer the rows are copied out of, when the gaps are at most the wanted bytes
        (boxes.span_read; ranges of at most _SPAN_BYTES); a narrower block is read with one ``pread``
        per run, so a rank never reads more than twice its bytes.
        """
        dtype, shape, begin, _ = self.header().tensors[key]
        item = fmt.DTYPE_SIZES[dtype]
        run, starts = runs(shape, part)
        staged = dst if dst.device.type == "cpu" and dst.is_contiguous() else torch.empty(
            dst.shape, dtype=dst.dtype)
        if staged.numel() and span_read(run, starts):
            self._read_spans(begin, item, shape, part, staged)
        elif staged.numel():
            buf = tensor_bytes(staged).cast("B")
            step = run * item
            for i, start in enumerate(starts):
                self.read_into(buf[i * step:(i + 1) * step], begin + start * item)
            if sys.byteorder != "little" and staged.element_size() > 1:
                staged.copy_(_little_endian(staged))  # the same byte swap, undone
        if staged is not dst:
            dst.copy_(staged)

    def _read_spans(self, begin: int, item: int, shape: tuple[int, ...], part: Box, staged: torch.Tensor) -> None:
        """``part`` (strided runs) into contiguous ``staged``: per slab, one read of the enclosing range.

        A slab of ``n`` elements spans at most ``2 n`` (span_read holds for every slab when it holds for
        ``part``), so slabs of ``_SPAN_BYTES / 2`` bytes of data keep each range within ``_SPAN_BYTES``."""
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        for slab in slabs(part, max(1, _SPAN_BYTES // (2 * item))):
            run, starts = runs(shape, slab)
            span = torch.empty(starts[-1] + run - starts[0], dtype=staged.dtype)
            self.read_into(tensor_bytes(span).cast("B"), begin + starts[0] * item)
            if sys.byteorder != "little" and span.element_size() > 1:
                span = _little_endian(span)
            staged[slab.relative_to(part).slices()].copy_(span.as_strided(slab.sizes, strides))

@dataclass(frozen=True)
class TensorMeta:
    """What a data file records about one of its tensors: which logical tensor, and where its box starts."""

    fqn: str
    state: str | None  # optimizer state name, None for model and extra tensors
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]  # the chunk's global offset in every dim

    def to_json(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "state": self.state, "global_shape": list(self.global_shape),
                "offsets": list(self.offsets)}

    @classmethod
    def from_json(cls, doc: Any) -> TensorMeta | None:
        """None if ``doc`` is not a well-formed record (format 3, or format 2's ``row_offset``)."""
        if not isinstance(doc, dict) or set(doc) not in ({"fqn", "state", "global_shape", "offsets"},
                                                         {"fqn", "state", "global_shape", "row_offset"}):
            return None
        shape = doc["global_shape"]
        if not isinstance(doc["fqn"], str) or not isinstance(doc["state"], (str, type(None))) \
                or not isinstance(shape, list) or not all(type(s) is int for s in shape):
            return None
        if "row_offset" in doc:  # format 2: chunks were dim-0 row ranges
            if type(doc["row_offset"]) is not int:
                return None
            offsets = [doc["row_offset"], *([0] * (len(shape) - 1))] if shape else []
        else:
            offsets = doc["offsets"]
            if not isinstance(offsets, list) or not all(type(o) is int for o in offsets):
                return None
        return cls(doc["fqn"], doc["state"], tuple(shape), tuple(offsets))


def file_metadata(namespace: str, rank: int, world: int, tensors: Mapping[str, TensorMeta]) -> dict[str, str]:
    """safetensors ``__metadata__``: format, version, namespace, rank and per-tensor fqn/global shape/offsets."""
    described = {key: meta.to_json() for key, meta in tensors.items()}
    return {"format": fmt.FORMAT_NAME, "format_version": str(fmt.FORMAT_VERSION), "namespace": namespace,
            "rank": str(rank), "world_size": str(world),
            "tensors": json.dumps(described, separators=(",", ":"), sort_keys=True)}
