"""Validate index.json: types, version, file names, chunk bounds, coverage and key uniqueness (pure).

Everything a loaded index promises is checked here before any data file is opened, so a damaged or
hostile index (a file outside the directory, overlapping chunks, a newer format) fails with the key
that is wrong instead of loading something partial.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import CheckpointError, short
from .format import (
    DIGEST_ALGO,
    DIGEST_RE,
    DTYPE_SIZES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_INDEX_BYTES,
    Chunk,
    FileEntry,
    Index,
    OptimEntry,
    TensorEntry,
    Value,
    check_file_name,
)
from .rows import coverage_problem, rows_of


def parse_index(text: str | bytes, source: str) -> Index:
    """Parse and fully validate an index; raise CheckpointError naming ``source`` and the bad key."""
    return IndexParser(source).parse(text)


class IndexParser:
    """Parse index.json and check every invariant of design/checkpoint-format.md section 3."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str, fix: str = "the checkpoint is damaged or was not written "
             "by fully_shard; re-save it or load an earlier checkpoint") -> CheckpointError:
        return CheckpointError(f"{self.source}: {where}: {problem}; fix: {fix}")

    def get(self, obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise self.fail(where, f"expected key {key!r}, found keys {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}")
        value = obj[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.fail(f"{where}.{key}", f"expected {names}, found {type(value).__name__} {short(value)}")
        return value

    def parse(self, text: str | bytes) -> Index:
        if len(text) > MAX_INDEX_BYTES:
            raise self.fail("size", f"index is {len(text)} bytes, more than the {MAX_INDEX_BYTES} allowed")
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise self.fail("JSON", f"not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise self.fail("top level", f"expected a JSON object, found {type(doc).__name__}")
        if doc.get("format") != FORMAT_NAME:
            raise self.fail("format", f"expected {FORMAT_NAME!r}, found {short(doc.get('format'))}",
                            "this is not a fully_shard checkpoint index")
        version = self.get(doc, "version", int, "index")
        if version > FORMAT_VERSION:
            raise self.fail("version", f"written in format version {version}, but this fully_shard reads "
                            f"versions up to {FORMAT_VERSION}", "upgrade fully_shard to load it")
        if version < 1:
            raise self.fail("version", f"expected a version >= 1, found {version}")
        digest = self.get(doc, "digest", str, "index")
        if digest != DIGEST_ALGO:
            raise self.fail("digest", f"expected {DIGEST_ALGO!r}, found {digest!r}")
        world = self.get(doc, "world_size", int, "index")
        if world < 1:
            raise self.fail("world_size", f"expected >= 1, found {world}")
        files: dict[str, FileEntry] = {}
        for name, f in self.get(doc, "files", dict, "index").items():
            check_file_name(name, f"{self.source}: files")
            size = self.get(f, "size", int, f"files[{name!r}]")
            fdigest = self.get(f, "digest", str, f"files[{name!r}]")
            rank = self.get(f, "rank", int, f"files[{name!r}]")
            if size < 8 or not DIGEST_RE.match(fdigest) or not 0 <= rank < world:
                raise self.fail(f"files[{name!r}]", f"expected size >= 8, a 32-hex-digit digest and a rank in "
                                f"[0, {world}), found size {size}, digest {fdigest!r}, rank {rank}")
            files[name] = FileEntry(size, fdigest, rank)
        model = {k: self.entry(v, f"model[{k!r}]", files) for k, v in self.get(doc, "model", dict, "index").items()}
        aliases = self.get(doc, "aliases", dict, "index")
        for alias, target in aliases.items():
            if not isinstance(target, str) or target not in model or alias in model:
                raise self.fail(f"aliases[{alias!r}]", f"expected the name of a stored model tensor other than "
                                f"itself, found {short(target)}")
        optimizer = None
        if doc.get("optimizer") is not None:
            optimizer = self.optim(self.get(doc, "optimizer", dict, "index"), files)
        blobs = {k: self.entry(v, f"blobs[{k!r}]", files) for k, v in self.get(doc, "blobs", dict, "index").items()}
        extra_per_rank = doc.get("extra_per_rank")
        if extra_per_rank is not None and (not isinstance(extra_per_rank, list) or len(extra_per_rank) != world):
            raise self.fail("extra_per_rank", f"expected null or a list of {world} entries, found {short(extra_per_rank)}")
        self.check_keys_unique(model, optimizer, blobs)
        created: dict[str, Any] = doc["created"] if isinstance(doc.get("created"), dict) else {}
        return Index(world_size=world, files=files, model=model, aliases=aliases, optimizer=optimizer,
                     blobs=blobs, extra=doc.get("extra"), extra_per_rank=extra_per_rank, created=created,
                     version=version)

    def optim(self, doc: dict[str, Any], files: dict[str, FileEntry]) -> OptimEntry:
        groups = self.get(doc, "param_groups", list, "optimizer")
        seen: set[str] = set()
        for i, group in enumerate(groups):
            params = self.get(group, "params", list, f"optimizer.param_groups[{i}]")
            for p in params:
                if not isinstance(p, str) or p in seen:
                    raise self.fail(f"optimizer.param_groups[{i}].params", f"expected unique parameter names, "
                                    f"found {short(p)} (duplicate or not a string)")
                seen.add(p)
        state: dict[str, dict[str, TensorEntry | Value]] = {}
        sharded: set[tuple[str, str]] = set()
        for fqn, names in self.get(doc, "state", dict, "optimizer").items():
            if fqn not in seen:
                raise self.fail(f"optimizer.state[{fqn!r}]", "state for a parameter that is in no param group")
            if not isinstance(names, dict):
                raise self.fail(f"optimizer.state[{fqn!r}]", f"expected an object, found {short(names)}")
            out: dict[str, TensorEntry | Value] = {}
            for n, v in names.items():
                where = f"optimizer.state[{fqn!r}][{n!r}]"
                if isinstance(v, dict) and set(v) == {"tensor", "sharded"} and isinstance(v["sharded"], bool):
                    out[n] = self.entry(v["tensor"], where, files)
                    if v["sharded"]:
                        sharded.add((fqn, n))
                elif isinstance(v, dict) and set(v) == {"value"}:
                    out[n] = Value(v["value"])
                else:
                    raise self.fail(where, f"expected {{'tensor': ..., 'sharded': bool}} or {{'value': ...}}, "
                                    f"found {short(v)}")
            state[fqn] = out
        return OptimEntry(param_groups=groups, state=state, sharded=sharded)

    def entry(self, doc: Any, where: str, files: dict[str, FileEntry]) -> TensorEntry:
        dtype = self.get(doc, "dtype", str, where)
        if dtype not in DTYPE_SIZES:
            raise self.fail(f"{where}.dtype", f"expected one of {sorted(DTYPE_SIZES)}, found {dtype!r}")
        shape_raw = self.get(doc, "shape", list, where)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape_raw):
            raise self.fail(f"{where}.shape", f"expected non-negative integers, found {short(shape_raw)}")
        shape = tuple(shape_raw)
        chunks = []
        for i, c in enumerate(self.get(doc, "chunks", list, where)):
            cw = f"{where}.chunks[{i}]"
            file = self.get(c, "file", str, cw)
            key = self.get(c, "key", str, cw)
            rows = self.get(c, "rows", list, cw)
            if file not in files:
                check_file_name(file, f"{self.source}: {cw}.file")
                raise self.fail(f"{cw}.file", f"{file!r} is not listed under 'files'")
            if len(rows) != 2 or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows):
                raise self.fail(f"{cw}.rows", f"expected [start, end], found {short(rows)}")
            chunks.append(Chunk(file, key, rows[0], rows[1]))
        problem = coverage_problem(rows_of(shape), chunks)
        if problem:
            raise self.fail(f"{where}.chunks", problem)
        return TensorEntry(dtype, shape, tuple(sorted(chunks, key=lambda c: c.start)))

    def check_keys_unique(self, model: dict[str, TensorEntry], optimizer: OptimEntry | None,
                          blobs: dict[str, TensorEntry]) -> None:
        seen: dict[tuple[str, str], str] = {}
        everything: list[tuple[str, TensorEntry]] = [(f"model[{n!r}]", e) for n, e in model.items()]
        if optimizer is not None:
            everything += [(f"optimizer[{n!r}]", e) for n, e in optimizer.tensors()]
        everything += [(f"blobs[{n!r}]", e) for n, e in blobs.items()]
        for owner, entry in everything:
            for chunk in entry.chunks:
                other = seen.setdefault((chunk.file, chunk.key), owner)
                if other != owner:
                    raise self.fail(owner, f"chunk key {chunk.key!r} of {chunk.file!r} is also used by {other}")
