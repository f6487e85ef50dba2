"""The checkpoint index schema: records for tensors, chunks, files and optimizer state, and their JSON.

See design/checkpoint-format.md sections 2-3. A checkpoint is a directory of safetensors files plus one
JSON index. The index lists, per logical tensor, its dtype, global shape and the chunks (boxes: offsets
and sizes in every dim, each one safetensors tensor in one file) that tile it exactly once. Parsing and
validating an index is validate.py's job; this module only describes, serializes and seals it (no I/O, no torch).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .boxes import Box
from .errors import CheckpointError, short

FORMAT_NAME = "fully_shard-checkpoint"
# 2: the index ends with its own digest; safetensors headers are deterministic.
# 3: chunks are boxes (offsets and sizes in every dim) instead of dim-0 row ranges. Version 2 is still read.
FORMAT_VERSION = 3
OLDEST_READABLE_VERSION = 2
INDEX_FILE = "index.json"
DIGEST_ALGO = "xxh3_128"
INDEX_DIGEST_KEY = "index_digest"
# The index's last field: the xxh3_128 of every byte before this trailer, so any changed byte is caught
# before the JSON is even parsed. The trailer's form is fixed for every format version.
SEAL_RE = re.compile(rb',\n "index_digest": "([0-9a-f]{32})"\n}\n\Z')
MAX_INDEX_BYTES = 256 << 20
MAX_HEADER_BYTES = 100_000_000  # the safetensors reference implementation's own limit

# safetensors dtype code -> bytes per element.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1, "C64": 8,
    "U64": 8, "U32": 4, "U16": 2,
}

_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.safetensors$")
DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")


def data_file_name(namespace: str, rank: int) -> str:
    """The one place data files are named: ``{model,optim,extra}-rankNNNNN.safetensors``."""
    return f"{namespace}-rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class Chunk:
    """One box of a logical tensor (global offsets and sizes), stored as safetensors tensor ``key`` of ``file``."""

    file: str
    key: str
    box: Box

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "key": self.key, **self.box.to_json()}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def chunk_shape(self, chunk: Chunk) -> tuple[int, ...]:
        """Shape of the safetensors tensor that stores ``chunk``: the box's sizes."""
        return chunk.box.sizes

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
    digest: str = ""  # the index's own digest (set by parse_index): it names this generation

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
        return seal(_dump(doc, 0))


def seal(text: str) -> str:
    """``text`` (a JSON object) with the digest trailer as its last field: the form index.json has on disk."""
    body = text.rstrip()
    if not body.endswith("}") or body.rstrip("}").rstrip().endswith("{"):
        raise ValueError("seal() needs a non-empty JSON object")
    body = body[:-1].rstrip()
    digest = xxhash.xxh3_128_hexdigest(body.encode())
    return f'{body},\n "{INDEX_DIGEST_KEY}": "{digest}"\n}}\n'


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
