"""Pure checkpoint format logic: index schema and validation, row planning and overlap math (no I/O, no torch).

See design/checkpoint-format.md. A checkpoint is a directory of safetensors files plus one JSON index.
Every tensor is cut along dim 0 into *chunks* of whole rows; a chunk is one safetensors tensor in one
file. The index lists, per logical tensor, its dtype, global shape and the chunks that cover its rows
exactly once. 0-dim tensors count as one row. Everything here is a pure function of plain values so it
can be property-tested without process groups.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..layout import DimZeroLayout

FORMAT_NAME = "fully_shard-checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
DIGEST_ALGO = "xxh3_128"
MAX_INDEX_BYTES = 256 << 20
MAX_HEADER_BYTES = 100_000_000  # the safetensors reference implementation's own limit
NAMESPACES = ("model", "optim", "extra")

# safetensors dtype code -> bytes per element.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "C64": 8,
    "U64": 8, "U32": 4, "U16": 2,
}

_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")
DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, loaded or consolidated; the message names the file/key and the fix."""


# --------------------------------------------------------------------------------------------------
# Row planning: which global rows a rank holds, and which of them it writes.
# --------------------------------------------------------------------------------------------------

SHARD = "shard"
REPLICATE = "replicate"


def rows_of(shape: Sequence[int]) -> int:
    """Number of dim-0 rows; a 0-dim tensor is one row."""
    return int(shape[0]) if len(shape) else 1


def row_numel(shape: Sequence[int]) -> int:
    return math.prod(shape[1:]) if len(shape) else 1


def held_rows(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[str]) -> tuple[int, int]:
    """[start, end) of the global rows a rank at ``coord`` holds (DTensor ``Shard(0)`` = torch.chunk).

    Several ``shard`` mesh dims split the rows one after the other, left to right, as DTensor does.
    """
    if not (len(mesh_shape) == len(coord) == len(placements)):
        raise ValueError(f"mesh_shape {mesh_shape}, coord {coord} and placements {placements} differ in length")
    start, end = 0, rows_of(shape)
    for size, c, placement in zip(mesh_shape, coord, placements):
        if placement == SHARD:
            if not len(shape):
                raise ValueError("a 0-dim tensor cannot be sharded along dim 0")
            s, e = DimZeroLayout((end - start,), size).row_range(c)
            start, end = start + s, start + e
        elif placement != REPLICATE:
            raise ValueError(f"unknown placement {placement!r}")
    return start, end


def write_rows(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
               placements: Sequence[str]) -> tuple[int, int]:
    """[start, end) of the rows this rank writes: its held rows, split evenly among the replicas.

    The ranks that hold the same rows (they differ only on ``replicate`` mesh dims) each write one
    torch.chunk part of those rows, so replicated data is written exactly once and the bytes are spread
    over all ranks. A 0-dim tensor is written by replica 0.
    """
    start, end = held_rows(shape, mesh_shape, coord, placements)
    replicas, index = 1, 0
    for size, c, placement in zip(mesh_shape, coord, placements):
        if placement == REPLICATE:
            replicas, index = replicas * size, index * size + c
    s, e = DimZeroLayout((end - start,), replicas).row_range(index)
    return start + s, start + e


def assign_whole(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """Balance tensors that must be written whole by one rank: largest first onto the least-loaded rank.

    Deterministic in its inputs, so every rank computes the same assignment without communication.
    """
    heap = [(0, rank) for rank in range(world)]
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        out[name] = rank
        heapq.heappush(heap, (load + max(sizes[name], 1), rank))
    return out


# --------------------------------------------------------------------------------------------------
# Index schema.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """Rows [start, end) of one logical tensor, stored as safetensors tensor ``key`` of ``file``."""

    file: str
    key: str
    start: int
    end: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, "rows": [self.start, self.end]}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def rows(self) -> int:
        return rows_of(self.shape)

    @property
    def row_numel(self) -> int:
        return row_numel(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def chunk_shape(self, chunk: Chunk) -> tuple[int, ...]:
        """Shape of the safetensors tensor that stores ``chunk``."""
        return () if not self.shape else (chunk.end - chunk.start, *self.shape[1:])

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "chunks": [c.to_json() for c in self.chunks]}


@dataclass(frozen=True)
class FileEntry:
    size: int
    digest: str
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "digest": self.digest, "rank": self.rank}


@dataclass(frozen=True)
class Value:
    """A non-tensor optimizer state value, kept as encoded JSON (see codec.py)."""

    value: Any


@dataclass
class OptimEntry:
    param_groups: list[dict[str, Any]]  # encoded hyperparameters + "params": [fqn, ...]
    state: dict[str, dict[str, TensorEntry | Value]]
    sharded: set[tuple[str, str]] = field(default_factory=set)  # (fqn, name) saved as DTensors like the param

    def to_json(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for fqn, names in self.state.items():
            state[fqn] = {}
            for n, v in names.items():
                if isinstance(v, TensorEntry):
                    state[fqn][n] = {"tensor": v.to_json(), "sharded": (fqn, n) in self.sharded}
                else:
                    state[fqn][n] = {"value": v.value}
        return {"param_groups": self.param_groups, "state": state}

    def tensors(self) -> Iterable[tuple[str, TensorEntry]]:
        for fqn, names in self.state.items():
            for n, v in names.items():
                if isinstance(v, TensorEntry):
                    yield optim_name(fqn, n), v


def optim_name(fqn: str, state_name: str) -> str:
    """The safetensors key (and display name) of one optimizer state tensor."""
    return f"{fqn}/{state_name}"


@dataclass
class Index:
    world_size: int
    files: dict[str, FileEntry]
    model: dict[str, TensorEntry]
    aliases: dict[str, str] = field(default_factory=dict)
    optimizer: OptimEntry | None = None
    blobs: dict[str, TensorEntry] = field(default_factory=dict)
    extra: Any = None
    extra_per_rank: list[Any] | None = None
    created: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    def all_tensors(self) -> Iterable[tuple[str, str, TensorEntry]]:
        """(namespace, name, entry) for every logical tensor in the checkpoint."""
        for name, entry in self.model.items():
            yield "model", name, entry
        if self.optimizer is not None:
            for name, entry in self.optimizer.tensors():
                yield "optim", name, entry
        for name, entry in self.blobs.items():
            yield "extra", name, entry

    def to_json(self) -> str:
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "created": self.created,
            "world_size": self.world_size,
            "digest": DIGEST_ALGO,
            "files": {name: f.to_json() for name, f in sorted(self.files.items())},
            "model": {name: e.to_json() for name, e in self.model.items()},
            "aliases": self.aliases,
            "optimizer": None if self.optimizer is None else self.optimizer.to_json(),
            "blobs": {name: e.to_json() for name, e in self.blobs.items()},
            "extra": self.extra,
            "extra_per_rank": self.extra_per_rank,
        }
        return _dump(doc, 0) + "\n"

    @classmethod
    def parse(cls, text: str | bytes, source: str) -> Index:
        """Parse and fully validate an index; raise CheckpointError naming ``source`` and the bad key."""
        from .validate import IndexParser

        return IndexParser(source).parse(text)


def _dump(value: Any, depth: int, limit: int = 2) -> str:
    """JSON with the upper levels on separate lines and everything deeper compact (one tensor per line)."""
    if depth >= limit or not isinstance(value, dict) or not value:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    pad = " " * (depth + 1)
    items = [f"{pad}{json.dumps(k)}: {_dump(v, depth + 1, 3 if depth == 0 and k == 'optimizer' else limit)}"
             for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"


def check_file_name(name: Any, where: str) -> str:
    """Reject anything but a plain file name inside the checkpoint directory (no '..', '/', absolute)."""
    if not isinstance(name, str) or not _FILE_RE.match(name) or ".." in name:
        raise CheckpointError(
            f"{where}: file name {short(name)} is not a plain '*.safetensors' name inside the checkpoint "
            "directory (no '/', '\\', '..' or absolute paths are allowed); fix: the index is damaged or "
            "hostile, do not load it")
    return name


def coverage_problem(rows: int, chunks: Sequence[Chunk]) -> str | None:
    """None if ``chunks`` cover rows [0, rows) exactly once with non-empty chunks, else what is wrong."""
    pos = 0
    for c in sorted(chunks, key=lambda c: (c.start, c.end)):
        if not 0 <= c.start < c.end <= rows:
            return f"chunk rows [{c.start}, {c.end}) are empty or outside the tensor's rows [0, {rows})"
        if c.start < pos:
            return f"chunk rows [{c.start}, {c.end}) overlap rows already covered up to {pos}"
        if c.start > pos:
            return f"rows [{pos}, {c.start}) are covered by no chunk"
        pos = c.end
    if pos != rows:
        return f"rows [{pos}, {rows}) are covered by no chunk"
    return None


def overlaps(chunks: Sequence[Chunk], start: int, end: int) -> list[tuple[Chunk, int, int]]:
    """The parts of ``chunks`` inside global rows [start, end), as (chunk, global_start, global_end).

    Read chunk rows [global_start - chunk.start, global_end - chunk.start) into target rows
    [global_start - start, global_end - start).
    """
    out = []
    for c in chunks:
        s, e = max(c.start, start), min(c.end, end)
        if s < e:
            out.append((c, s, e))
    return sorted(out, key=lambda t: t[1])


# --------------------------------------------------------------------------------------------------
# Structure diffs and consolidation planning.
# --------------------------------------------------------------------------------------------------


def structure_diff(expected: Mapping[str, tuple[str, tuple[int, ...]]],
                   found: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, mismatched) names; mismatched lines show expected vs found dtype[shape]."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = []
    for name in expected:
        if name in found and expected[name] != found[name]:
            mismatched.append(f"{name}: expected {_sig(expected[name])}, found {_sig(found[name])}")
    return missing, unexpected, mismatched


def format_diff(title: str, missing: Sequence[str], unexpected: Sequence[str], mismatched: Sequence[str],
                fix: str, limit: int = 20) -> str:
    lines = [title]
    for label, items in (("missing in checkpoint (expected by the model)", missing),
                         ("unexpected in checkpoint (not in the model)", unexpected),
                         ("dtype/shape differs", mismatched)):
        if items:
            lines.append(f"  {label}: {len(items)}")
            lines += [f"    - {item}" for item in items[:limit]]
            if len(items) > limit:
                lines.append(f"    ... and {len(items) - limit} more")
    lines.append(f"  fix: {fix}")
    return "\n".join(lines)


def _sig(sig: tuple[str, tuple[int, ...]]) -> str:
    return f"{sig[0]}{list(sig[1])}"


def plan_output_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group tensors, in order, into output files of at most ``max_shard_bytes`` each.

    A tensor larger than the limit gets a file of its own (it cannot be split across files).
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes:
        if current and used + size > max_shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current or not groups:
        groups.append(current)
    return groups


def series_key(name: str) -> tuple[str, tuple[int, ...]] | None:
    """(pattern, numbers) for retention: 'step-000300' -> ('step-#', (300,)); None without digits."""
    numbers = tuple(int(n) for n in re.findall(r"\d+", name))
    if not numbers:
        return None
    return re.sub(r"\d+", "#", name), numbers


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
