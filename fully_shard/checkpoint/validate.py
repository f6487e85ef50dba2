"""Validate what a checkpoint reads: strict JSON, the index's own digest, and every invariant of index.json.

Everything a loaded index promises is checked here before any data file is opened, so a damaged or
hostile index (a file outside the directory, overlapping chunks, a newer format) fails with the key
that is wrong instead of loading something partial. Order (design/checkpoint-format.md section 3):
size, UTF-8, the digest trailer (any changed byte fails here), strict JSON (no NaN/Infinity, no
duplicate keys, bounded nesting and string sizes), then the schema. Pure: no I/O, no torch.
"""

from __future__ import annotations

import json
import math
from typing import Any

import xxhash

from .boxes import Box
from .boxes import coverage_problem as box_coverage_problem
from .errors import CheckpointError, short
from .format import (
    DIGEST_ALGO,
    DIGEST_RE,
    DTYPE_SIZES,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_DIGEST_KEY,
    MAX_INDEX_BYTES,
    OLDEST_READABLE_VERSION,
    SEAL_RE,
    Chunk,
    FileEntry,
    Index,
    OptimEntry,
    TensorEntry,
    Value,
    check_file_name,
)
from .rows import coverage_problem, rows_of

MAX_JSON_DEPTH = 64  # nesting of objects/arrays; the index itself needs 7, the rest is `extra`
MAX_JSON_STRING = 16 << 20  # characters in one string (key or value)


def parse_index(text: str | bytes, source: str) -> Index:
    """Parse and fully validate an index; raise CheckpointError naming ``source`` and the bad key."""
    return IndexParser(source).parse(text)


def index_digest(raw: bytes, source: str) -> str:
    """Check the index's digest trailer against its body; return the digest (it names the generation)."""
    fix = ("the index was modified, truncated or damaged after it was written; restore it or load an earlier "
           "checkpoint (an index without the trailer was not written by this version of fully_shard)")
    m = SEAL_RE.search(raw)
    if m is None:
        raise CheckpointError(f"{source}: no valid {INDEX_DIGEST_KEY!r} trailer at the end of the file (expected "
                              f'\'{{... ,\\n "{INDEX_DIGEST_KEY}": "<32 hex digits>"\\n}}\'); fix: {fix}')
    recorded = m.group(1).decode()
    actual = xxhash.xxh3_128_hexdigest(raw[: m.start()])
    if actual != recorded:
        raise CheckpointError(f"{source}: content digest {actual} differs from the {recorded} recorded in its "
                              f"{INDEX_DIGEST_KEY!r} ({DIGEST_ALGO} of every byte before that field); fix: {fix}")
    return recorded


class _Duplicates(dict):  # type: ignore[type-arg]
    """An object with duplicate keys, kept so that the walk can name its path."""

    duplicate: str = ""


class _NonFinite:
    def __init__(self, name: str) -> None:
        self.name = name


def _pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(items)
    if len(out) == len(items):
        return out
    seen: set[str] = set()
    marked = _Duplicates(items)
    marked.duplicate = next(k for k, _ in items if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    return marked


def loads_strict(raw: bytes, source: str, *, max_depth: int = MAX_JSON_DEPTH,
                 max_string: int = MAX_JSON_STRING) -> Any:
    """JSON as RFC 8259 says and Python's json module does not enforce: UTF-8, no NaN/Infinity (nor numbers
    that overflow to infinity), no duplicate keys; plus bounded nesting and string sizes. Errors name
    ``source`` and the key path."""
    def fail(where: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{source}: {where}: {problem}; fix: the file is damaged or was not written by "
                               "fully_shard; restore it or load an earlier checkpoint")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"byte {e.start}", f"not valid UTF-8 ({e.reason})") from None
    suspect: list[bool] = []  # set by the parser's hooks: a duplicate key, or a number that is not finite

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = _pairs(items)
        if type(out) is _Duplicates:
            suspect.append(True)
        return out

    def constant(name: str) -> _NonFinite:
        suspect.append(True)
        return _NonFinite(name)

    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            suspect.append(True)
        return value

    try:
        doc = json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_float=number)
    except RecursionError:
        raise fail("top level", f"nesting far deeper than the {max_depth} levels allowed") from None
    except ValueError as e:
        raise fail("JSON", f"not valid JSON ({e})") from None
    if not suspect and len(text) <= max_string and _depth_below(doc, max_depth):
        return doc  # nothing the walk below could report (no string is longer than the whole text)
    # Something to report: walk again, naming where.

    def at(trail: _Trail) -> str:
        path = _path(trail)
        return (path if len(path) <= 120 else path[:117] + "...") or "top level"

    def check(value: Any, trail: _Trail) -> None:  # a value that is not an object or array
        if isinstance(value, _NonFinite) or (type(value) is float and not math.isfinite(value)):
            raise fail(at(trail), f"non-finite number {getattr(value, 'name', value)!r} (strict JSON has none)")
        if type(value) is str and len(value) > max_string:
            raise fail(at(trail), f"a string of {len(value)} characters, more than the {max_string} allowed")

    if not isinstance(doc, (dict, list)):
        check(doc, None)
        return doc
    # Objects and arrays only go on the stack; their other values are checked as their container is walked,
    # and a value's path is spelled out only when it is reported (the walk is most of a header's parse).
    stack: list[tuple[Any, _Trail, int]] = [(doc, None, 0)]
    while stack:
        value, trail, depth = stack.pop()
        if depth >= max_depth:
            raise fail(at(trail), f"nested deeper than the {max_depth} levels allowed")
        if isinstance(value, _Duplicates):
            raise fail(at(trail), f"duplicate key {short(value.duplicate)} (JSON readers disagree on which one wins)")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if type(k) is str and len(k) > max_string:
                raise fail(at(trail), f"a key of {len(k)} characters, more than the {max_string} allowed")
            if isinstance(v, (dict, list)):
                stack.append((v, (trail, k), depth + 1))
            elif type(v) is not int:
                check(v, (trail, k))
    return doc


def _depth_below(doc: Any, max_depth: int) -> bool:
    """Whether no object or array of ``doc`` is nested ``max_depth`` deep (the top level is depth 0)."""
    stack = [(doc, 0)] if isinstance(doc, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth >= max_depth:
            return False
        for v in value.values() if isinstance(value, dict) else value:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))
    return True


_Trail = tuple[Any, str | int] | None  # (the parent's trail, this key or index); None: the top level


def _path(trail: _Trail) -> str:
    """``a['b'][0]``: the path of a value in a JSON document, from its trail."""
    keys: list[str | int] = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path = (f"{path}[{key!r}]" if path else key) if isinstance(key, str) else f"{path}[{key}]"
    return path


class IndexParser:
    """Parse index.json and check every invariant of design/checkpoint-format.md section 3."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.version = FORMAT_VERSION

    def fail(self, where: str, problem: str, fix: str = "the checkpoint is damaged or was not written "
             "by fully_shard; re-save it or load an earlier checkpoint") -> CheckpointError:
        return CheckpointError(f"{self.source}: {where}: {problem}; fix: {fix}")

    def get(self, obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise self.fail(where, f"expected key {key!r}, found keys {keys}")
        value = obj[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise self.fail(f"{where}.{key}", f"expected {names}, found {type(value).__name__} {short(value)}")
        return value

    def parse(self, text: str | bytes) -> Index:
        raw = text.encode() if isinstance(text, str) else text
        if len(raw) > MAX_INDEX_BYTES:
            raise self.fail("size", f"index is {len(raw)} bytes, more than the {MAX_INDEX_BYTES} allowed")
        digest = index_digest(raw, self.source)
        doc = loads_strict(raw, self.source)
        if not isinstance(doc, dict):
            raise self.fail("top level", f"expected a JSON object, found {type(doc).__name__}")
        if doc.get("format") != FORMAT_NAME:
            raise self.fail("format", f"expected {FORMAT_NAME!r}, found {short(doc.get('format'))}",
                            "this is not a fully_shard checkpoint index")
        version = self.get(doc, "version", int, "index")
        if version > FORMAT_VERSION:
            raise self.fail("version", f"written in format version {version}, but this fully_shard reads "
                            f"versions up to {FORMAT_VERSION}", "upgrade fully_shard to load it")
        if version < OLDEST_READABLE_VERSION:
            raise self.fail("version", f"format version {version} predates the index digest (a development "
                            f"version); this fully_shard reads versions {OLDEST_READABLE_VERSION} to "
                            f"{FORMAT_VERSION}", "re-save the checkpoint")
        self.version = version
        algo = self.get(doc, "digest", str, "index")
        if algo != DIGEST_ALGO:
            raise self.fail("digest", f"expected {DIGEST_ALGO!r}, found {algo!r}")
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
            raise self.fail("extra_per_rank",
                            f"expected null or a list of {world} entries, found {short(extra_per_rank)}")
        self.check_keys_unique(model, optimizer, blobs)
        created: dict[str, Any] = doc["created"] if isinstance(doc.get("created"), dict) else {}
        return Index(world_size=world, files=files, model=model, aliases=aliases, optimizer=optimizer,
                     blobs=blobs, extra=doc.get("extra"), extra_per_rank=extra_per_rank, created=created,
                     version=version, digest=digest)

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
            if file not in files:
                check_file_name(file, f"{self.source}: {cw}.file")
                raise self.fail(f"{cw}.file", f"{file!r} is not listed under 'files'")
            chunks.append(Chunk(file, key, self.box(c, cw, shape)))
        if self.version == 2:  # row ranges, checked as such (a tensor of shape (5, 0) has chunks of 0 bytes)
            spans = [(c.box.offsets[0], c.box.ends[0]) if shape else (0, 1) for c in chunks]
            problem = coverage_problem(rows_of(shape), spans)
        else:
            problem = box_coverage_problem(shape, [c.box for c in chunks])
        if problem:
            raise self.fail(f"{where}.chunks", problem)
        return TensorEntry(dtype, shape, tuple(sorted(chunks, key=lambda c: c.box.offsets)))

    def box(self, c: dict[str, Any], where: str, shape: tuple[int, ...]) -> Box:
        """A chunk's box: format 3 ``offsets`` + ``sizes``, format 2 ``rows`` (whole rows of dim 0)."""
        def ints(name: str, n: int) -> list[int]:
            value = self.get(c, name, list, where)
            if len(value) != n or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise self.fail(f"{where}.{name}", f"expected {n} integers (one per dim of shape {list(shape)}), "
                                f"found {short(value)}")
            return value
        if self.version == 2:
            start, end = ints("rows", 2)
            if not shape:
                return Box((), ())
            return Box((start, *([0] * (len(shape) - 1))), (end - start, *shape[1:]))
        return Box(tuple(ints("offsets", len(shape))), tuple(ints("sizes", len(shape))))

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
