"""One generation of a checkpoint directory, opened read-only: its descriptor, its index and its data files.

The reader/writer contract (design/checkpoint-format.md section 6): a writer never changes a committed
directory, it renames a new one into place and deletes the old one. So a reader that opens the
directory once and every file relative to that descriptor reads one generation, whatever a writer
does meanwhile; a file deleted before it was opened fails clearly (and is retried by ``load``). A
load never modifies the directory: a path missing between a writer's two renames is read from the
committed sibling (commit.committed_sibling) instead of being renamed back.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from . import format as fmt
from .commit import committed_sibling
from .errors import CheckpointError, short
from .safetensors_io import DataFile, TensorMeta, open_regular
from .validate import loads_strict, parse_index

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


class Vanished(CheckpointError):
    """A file listed by the index was gone when opened: the generation was deleted under the reader."""


@dataclass(frozen=True)
class Stored:
    """What the index says one stored chunk is: its logical tensor, and the record its file must carry."""

    namespace: str
    name: str  # logical tensor name (the index's key; optimizer state: "fqn/state")
    entry: fmt.TensorEntry
    chunk: fmt.Chunk
    meta: TensorMeta


class Snapshot:
    """The checkpoint at ``path`` as one generation: the directory opened once, index.json parsed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.dir_fd, self.directory = _open_directory(path)
        self.files: dict[str, DataFile] = {}
        try:
            self.index = parse_index(self._read_index(), os.path.join(path, fmt.INDEX_FILE))
        except BaseException:
            os.close(self.dir_fd)
            raise

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
        os.close(self.dir_fd)

    def _read_index(self) -> bytes:
        index_path = os.path.join(self.path, fmt.INDEX_FILE)
        try:
            fd = open_regular(fmt.INDEX_FILE, dir_fd=self.dir_fd, where=index_path,
                              fix="index.json must be a plain file inside the checkpoint directory (not a symbolic "
                                  "link, directory or FIFO)")
        except FileNotFoundError:
            raise _not_a_checkpoint(self.path, sorted(os.listdir(self.dir_fd))) from None
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > fmt.MAX_INDEX_BYTES:
                raise CheckpointError(f"{index_path}: {size} bytes, more than the {fmt.MAX_INDEX_BYTES} allowed; fix: "
                                      "the index is damaged")
            return f.read()

    def open(self, names: set[str]) -> None:
        """Open every data file in ``names`` now (through the directory's descriptor)."""
        for name in sorted(names - set(self.files)):
            entry = self.index.files[name]
            where = os.path.join(self.path, name)
            try:
                self.files[name] = DataFile(self.dir_fd, name, where, entry.size)
            except CheckpointError as e:
                if _gone(self.dir_fd):
                    raise Vanished(f"{where}: the checkpoint was deleted or replaced while loading (a concurrent "
                                   "save of this path or keep_last); fix: retry the load") from e
                raise

    def stored_by_file(self) -> dict[str, list[Stored]]:
        """Every chunk the index lists, grouped by data file."""
        out: dict[str, list[Stored]] = defaultdict(list)
        for ns, name, entry, fqn, state in _logical(self.index):
            for c in entry.chunks:
                out[c.file].append(Stored(ns, name, entry, c, TensorMeta(fqn, state, entry.shape, c.box.offsets)))
        return out

    def check(self, name: str, stored: list[Stored]) -> None:
        """A file's header and its own records (namespace, rank, per-tensor FQN, global shape, offsets)
        against what the index says it holds: a swapped, foreign or mixed file is caught even when the
        index's digests were recomputed to match it."""
        f = self.files[name]
        header = f.header()
        rank = self.index.files[name].rank
        want = {"format": fmt.FORMAT_NAME, "format_version": str(self.index.version),
                "namespace": stored[0].namespace if stored else None, "rank": str(rank),
                "world_size": str(self.index.world_size)}
        found = {k: header.metadata.get(k) for k in want}
        if stored and found != want:
            raise f.bad(f"the file's metadata says {found}, but index.json expects {want}")
        records = loads_strict(header.metadata.get("tensors", "{}").encode(), f"{f.where} (__metadata__.tensors)",
                               max_depth=4)
        listed = {s.chunk.key for s in stored}
        if not isinstance(records, dict) or set(records) != listed or set(header.tensors) != listed:
            extra = sorted(set(header.tensors) - listed)
            lacking = sorted(listed - set(header.tensors))
            raise f.bad(f"the file holds tensors {short(extra)} that index.json does not list for it and lacks "
                        f"{short(lacking)} (or its own records disagree); the file does not belong to this index "
                        "(mixed checkpoints?)")
        for s in stored:
            dtype, shape, _, _ = header.tensors[s.chunk.key]
            meta = TensorMeta.from_json(records[s.chunk.key])
            if (dtype, shape) != (s.entry.dtype, s.entry.chunk_shape(s.chunk)) or meta != s.meta:
                raise f.bad(f"tensor {s.chunk.key!r} (offsets {list(s.chunk.box.offsets)} of {s.name!r}) should be "
                            f"{s.entry.dtype}{list(s.entry.chunk_shape(s.chunk))} recorded as {s.meta.to_json()}, "
                            f"found {dtype}{list(shape)} recorded as {records[s.chunk.key]}; the file does not "
                            "belong to this index (mixed checkpoints?) or is damaged")

    def verify_digest(self, name: str, digest: str | None = None) -> None:
        """The file's content digest (``digest`` if already taken, else hashed now) against the index's."""
        f = self.files[name]
        recorded = self.index.files[name].digest
        digest = f.digest() if digest is None else digest
        if digest != recorded:
            raise CheckpointError(f"{f.where}: content digest {digest} differs from {recorded} recorded in "
                                  f"{fmt.INDEX_FILE} (xxh3_128): the file was modified or corrupted after the save; "
                                  "fix: restore it or load an earlier checkpoint (verify=False skips this check, "
                                  "not recommended)")


def _logical(index: fmt.Index) -> Iterator[tuple[str, str, fmt.TensorEntry, str, str | None]]:
    """(namespace, name, entry, fqn, state) of every logical tensor, as the writer records them."""
    for name, entry in index.model.items():
        yield "model", name, entry, name, None
    if index.optimizer is not None:
        for fqn, names in index.optimizer.state.items():
            for state, value in names.items():
                if isinstance(value, fmt.TensorEntry):
                    yield "optim", fmt.optim_name(fqn, state), value, fqn, state
    for name, entry in index.blobs.items():
        yield "extra", name, entry, name, None


def _open_directory(path: str) -> tuple[int, str]:
    """A descriptor of ``path`` (or, while ``path`` is missing, of its committed sibling) and which one."""
    for _ in range(3):  # a writer may rename between our checks: look again
        try:
            return os.open(path, _DIR_FLAGS), path
        except NotADirectoryError:
            raise CheckpointError(f"{path} is a file, not a checkpoint directory; fix: pass the directory that "
                                  f"holds {fmt.INDEX_FILE}") from None
        except FileNotFoundError:
            sibling = committed_sibling(path)
            if sibling is None:
                if os.path.exists(path):
                    continue
                break
            try:
                return os.open(sibling, _DIR_FLAGS), sibling
            except FileNotFoundError:
                continue
    raise CheckpointError(f"{path}: no such checkpoint directory; fix: check the path (checkpoints exist only "
                          "after save() returned / handle.wait() committed them)")


def _gone(dir_fd: int) -> bool:
    try:
        os.stat(fmt.INDEX_FILE, dir_fd=dir_fd, follow_symlinks=False)
        return False
    except FileNotFoundError:
        return True


def _not_a_checkpoint(path: str, listing: list[str]) -> CheckpointError:
    hint = ""
    if "model.safetensors" in listing or "model.safetensors.index.json" in listing:
        hint = " It looks like a Hugging Face model directory: read it with safetensors.torch.load_file and " \
               "set_model_state_dict(model, sd, full=True)."
    elif ".metadata" in listing:
        hint = " It looks like a torch.distributed.checkpoint directory: use torch.distributed.checkpoint.load."
    return CheckpointError(f"{path} is not a fully_shard checkpoint: it has no {fmt.INDEX_FILE} (found "
                           f"{listing[:10]}{' ...' if len(listing) > 10 else ''}). An interrupted save never "
                           f"leaves an index.{hint} fix: pass a committed checkpoint directory")
