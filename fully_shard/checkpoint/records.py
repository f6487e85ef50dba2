"""Save records: what each rank reports to rank 0 after writing, and rank 0's assembly of them into the index.

Every rank reports the chunks and files it wrote (RankReport, exchanged as JSON); rank 0 holds the
Skeleton (signatures of every model and optimizer tensor, hyperparameters, aliases) and checks each
report against it, so a rank with a different structure is named instead of producing a bad index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import format as fmt
from .boxes import Box
from .codec import Encoded
from .errors import CheckpointError, Signature
from .safetensors_io import WrittenFile


@dataclass(frozen=True)
class ChunkRecord:
    """One box of a logical tensor that a rank wrote, under the key ``name`` of its data file."""

    namespace: str
    name: str
    box: Box
    dtype: str
    shape: tuple[int, ...]

    @property
    def signature(self) -> Signature:
        return self.dtype, self.shape

    def to_json(self) -> dict[str, Any]:
        return {"ns": self.namespace, "name": self.name, **self.box.to_json(), "dtype": self.dtype,
                "shape": list(self.shape)}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ChunkRecord:
        box = Box(tuple(int(o) for o in doc["offsets"]), tuple(int(s) for s in doc["sizes"]))
        return cls(doc["ns"], doc["name"], box, doc["dtype"], tuple(doc["shape"]))


@dataclass(frozen=True)
class RankReport:
    """One rank's files and chunks, and its encoded ``extra``."""

    files: dict[str, WrittenFile]
    chunks: tuple[ChunkRecord, ...]
    extra: Encoded

    def to_json(self) -> dict[str, Any]:
        return {"files": {n: f.to_json() for n, f in self.files.items()},
                "chunks": [c.to_json() for c in self.chunks], "extra": self.extra}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RankReport:
        return cls({n: WrittenFile.from_json(f) for n, f in doc["files"].items()},
                   tuple(ChunkRecord.from_json(c) for c in doc["chunks"]), doc["extra"])


@dataclass(frozen=True)
class OptimSkeleton:
    """Rank 0's optimizer description: encoded param groups, and per FQN per state a signature or value."""

    param_groups: list[dict[str, Encoded]]  # encoded hyperparameters + "params": [fqn, ...]
    state: dict[str, dict[str, Signature | fmt.Value]]
    sharded: frozenset[tuple[str, str]]  # (fqn, name) of state saved as DTensors laid out like the param


@dataclass(frozen=True)
class Skeleton:
    """Rank 0's description of everything the index will list, before any rank reports its chunks."""

    model: dict[str, Signature]
    aliases: dict[str, str]
    optimizer: OptimSkeleton | None


def assemble_index(world: int, skeleton: Skeleton, reports: Sequence[RankReport], extra_per_rank: bool) -> fmt.Index:
    """Rank 0: build the index from its skeleton and every rank's chunks; mismatches name the rank."""
    sigs: dict[tuple[str, str], Signature] = {("model", n): sig for n, sig in skeleton.model.items()}
    if skeleton.optimizer is not None:
        for fqn, names in skeleton.optimizer.state.items():
            for name, v in names.items():
                if not isinstance(v, fmt.Value):
                    sigs[("optim", fmt.optim_name(fqn, name))] = v
    chunks: dict[tuple[str, str], list[fmt.Chunk]] = {k: [] for k in sigs}
    files: dict[str, fmt.FileEntry] = {}
    for rank, report in enumerate(reports):
        for name, written in report.files.items():
            files[name] = fmt.FileEntry(written.size, written.digest, rank)
        for c in report.chunks:
            key = (c.namespace, c.name)
            if c.namespace == "extra":
                sigs.setdefault(key, c.signature)
                chunks.setdefault(key, [])
            if key not in sigs:
                raise CheckpointError(f"rank {rank} saved {c.namespace} tensor {c.name!r}, which rank 0 does not "
                                      "have; fix: every rank must save the same model/optimizer structure")
            if sigs[key] != c.signature:
                raise CheckpointError(f"{c.namespace} tensor {c.name!r} is {c.signature} on rank {rank} but "
                                      f"{sigs[key]} on rank 0; fix: every rank must hold the same global shapes and "
                                      "dtypes")
            chunks[key].append(fmt.Chunk(fmt.data_file_name(c.namespace, rank), c.name, c.box))

    def entry(key: tuple[str, str]) -> fmt.TensorEntry:
        return fmt.TensorEntry(sigs[key][0], sigs[key][1], tuple(sorted(chunks[key], key=lambda c: c.box.offsets)))

    model = {n: entry(("model", n)) for n in skeleton.model}
    optimizer = None
    if skeleton.optimizer is not None:
        state: dict[str, dict[str, fmt.TensorEntry | fmt.Value]] = {}
        for fqn, names in skeleton.optimizer.state.items():
            state[fqn] = {name: v if isinstance(v, fmt.Value) else entry(("optim", fmt.optim_name(fqn, name)))
                          for name, v in names.items()}
        optimizer = fmt.OptimEntry(skeleton.optimizer.param_groups, state, set(skeleton.optimizer.sharded))
    blobs = {k[1]: entry(k) for k in chunks if k[0] == "extra"}
    created = {"writer": "fully_shard.checkpoint", "torch": torch.__version__}
    return fmt.Index(world_size=world, files=files, model=model, aliases=skeleton.aliases, optimizer=optimizer,
                     blobs=blobs, extra=reports[0].extra,
                     extra_per_rank=[r.extra for r in reports] if extra_per_rank else None, created=created)
