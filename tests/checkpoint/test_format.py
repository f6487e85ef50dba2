"""Property tests of the pure checkpoint format: row planning, coverage, resharding identity, index schema."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_shard.checkpoint import boxes, validate
from fully_shard.checkpoint import format as fmt
from fully_shard.checkpoint import rows as row_math
from fully_shard.checkpoint.codec import Encoder, decode, tensor_refs
from fully_shard.checkpoint.commit import series_key
from fully_shard.checkpoint.consolidate import plan_output_shards
from fully_shard.checkpoint.errors import CheckpointError
from fully_shard.checkpoint.format import Chunk, Index, TensorEntry
from fully_shard.checkpoint.validate import parse_index

SETTINGS = settings(max_examples=150, deadline=None)

shapes = st.one_of(
    st.just(()),  # 0-dim
    st.tuples(st.integers(0, 23)),
    st.tuples(st.integers(0, 23), st.integers(0, 4)),
    st.tuples(st.integers(0, 9), st.integers(1, 3), st.integers(1, 2)),
)
S0, R = boxes.shard(0), boxes.replicate()
# A mesh: 1-D (shard), 2-D HSDP (replicate, shard), 2-D all-replicate, or 1-D replicate.
meshes = st.one_of(
    st.tuples(st.integers(1, 7)).map(lambda s: (s, (S0,))),
    st.tuples(st.integers(1, 3), st.integers(1, 4)).map(lambda s: (s, (R, S0))),
    st.tuples(st.integers(1, 3), st.integers(1, 3)).map(lambda s: (s, (S0, S0))),
    st.tuples(st.integers(1, 4)).map(lambda s: (s, (R,))),
)
Mesh = tuple[tuple[int, ...], tuple[boxes.Placement, ...]]


def coords(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in c) for c in np.ndindex(*mesh_shape)]


def placements_for(shape: tuple[int, ...], placements: tuple[boxes.Placement, ...]) -> tuple[boxes.Placement, ...]:
    """0-dim tensors cannot be sharded: fully_shard replicates them."""
    return placements if shape else tuple(R for _ in placements)


def save_chunks(shape: tuple[int, ...], mesh: Mesh) -> list[Chunk]:
    mesh_shape, placements = mesh
    placements = placements_for(shape, placements)
    chunks = []
    for i, c in enumerate(coords(mesh_shape)):
        box = boxes.write_box(shape, mesh_shape, c, placements)
        if box is not None:
            chunks.append(Chunk(f"model-rank{i:05d}.safetensors", "w", box))
    return chunks


@SETTINGS
@given(shapes, meshes)
def test_held_rows_match_torch_chunk(shape: tuple[int, ...], mesh: Mesh) -> None:
    mesh_shape, placements = mesh
    placements = placements_for(shape, placements)
    rows = row_math.rows_of(shape)
    for c in coords(mesh_shape):
        box = boxes.held_box(shape, mesh_shape, c, placements)
        assert box.sizes[1:] == tuple(shape[1:])
        expected = torch.arange(rows)
        for size, ci, pl in zip(mesh_shape, c, placements):
            if pl.kind == boxes.SHARD:
                parts = torch.chunk(expected, size) if expected.numel() else ()
                expected = parts[ci] if ci < len(parts) else expected[:0]
        if not shape:
            assert box == boxes.Box((), ())
        elif expected.numel():
            assert (box.offsets[0], box.ends[0]) == (int(expected[0]), int(expected[-1]) + 1)
        else:
            assert box.sizes[0] == 0


@SETTINGS
@given(shapes, meshes)
def test_written_chunks_cover_each_tensor_exactly_once(shape: tuple[int, ...], mesh: Mesh) -> None:
    chunks = save_chunks(shape, mesh)
    assert boxes.coverage_problem(shape, [c.box for c in chunks]) is None
    mesh_shape, placements = mesh
    placements = placements_for(shape, placements)
    # Every rank writes only what it holds; replicas share the work: each writes at most its torch.chunk
    # share of the rows they all hold.
    replicas = math.prod(size for size, pl in zip(mesh_shape, placements) if pl.kind == boxes.REPLICATE)
    for c in coords(mesh_shape):
        held = boxes.held_box(shape, mesh_shape, c, placements)
        written = boxes.write_box(shape, mesh_shape, c, placements)
        if written is not None:
            assert written.intersect(held) == written
            assert not shape or written.sizes[0] <= -(-held.sizes[0] // replicas)


@SETTINGS
@given(shapes, meshes, meshes, st.integers(0, 2**31 - 1))
def test_save_at_w_load_at_w_prime_is_identity(shape: tuple[int, ...], saved: Mesh, loaded: Mesh, seed: int) -> None:
    full = np.random.default_rng(seed).standard_normal(shape if shape else ())
    chunks = save_chunks(shape, saved)
    stored = {c.file: full[c.box.slices()].copy() for c in chunks}  # what each saving rank writes
    mesh_shape, placements = loaded
    placements = placements_for(shape, placements)
    for c in coords(mesh_shape):
        want = boxes.held_box(shape, mesh_shape, c, placements)
        target = np.full(want.sizes, np.nan)
        for chunk, part in boxes.overlaps(chunks, want):
            target[part.slices(want)] = stored[chunk.file][part.slices(chunk.box)]
        np.testing.assert_array_equal(target, full[want.slices()])


@SETTINGS
@given(st.integers(0, 40), st.lists(st.tuples(st.integers(0, 45), st.integers(0, 45)), max_size=6))
def test_coverage_problem_detects_gaps_overlaps_and_bounds(rows: int, spans: list[tuple[int, int]]) -> None:
    """Format 2's row ranges, and the same ranges as boxes of a (rows, 2) tensor."""
    covered = [0] * rows
    ok = True
    for s, e in spans:
        if not 0 <= s < e <= rows:
            ok = False
            continue
        for r in range(s, e):
            covered[r] += 1
    ok = ok and all(c == 1 for c in covered)
    assert (row_math.coverage_problem(rows, spans) is None) == ok
    as_boxes = [boxes.Box((s, 0), (e - s, 2)) for s, e in spans]
    assert (boxes.coverage_problem((rows, 2), as_boxes) is None) == ((ok and rows > 0) or (rows == 0 and not spans))


@SETTINGS
@given(st.dictionaries(st.text(min_size=1, max_size=5), st.integers(0, 1000), max_size=30), st.integers(1, 8))
def test_assign_whole_is_deterministic_and_balanced(sizes: dict[str, int], world: int) -> None:
    owner = row_math.assign_whole(sizes, world)
    assert owner == row_math.assign_whole(dict(reversed(list(sizes.items()))), world)
    loads = [0] * world
    for name, rank in owner.items():
        loads[rank] += max(sizes[name], 1)
    if sizes:
        assert max(loads) - min(loads) <= max(max(sizes.values()), 1)


@SETTINGS
@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 150))
def test_output_shards_respect_the_limit_and_keep_order(sizes: list[int], limit: int) -> None:
    named = [(f"t{i}", s) for i, s in enumerate(sizes)]
    groups = plan_output_shards(named, limit)
    assert [n for g in groups for n in g] == [n for n, _ in named]
    size_of = dict(named)
    for g in groups:
        assert len(g) == 1 or sum(size_of[n] for n in g) <= limit


def _box(start: int, end: int, cols: int = 3) -> boxes.Box:
    return boxes.Box((start, 0), (end - start, cols))


def _index(shape: tuple[int, ...] = (5, 3), chunks: tuple[Chunk, ...] | None = None) -> Index:
    chunks = chunks or (Chunk("model-rank00000.safetensors", "w", _box(0, 3)),
                        Chunk("model-rank00001.safetensors", "w", _box(3, 5)))
    files = {f"model-rank0000{i}.safetensors": fmt.FileEntry(100, "0" * 32, i) for i in range(2)}
    return Index(world_size=2, files=files, model={"w": TensorEntry("F32", shape, chunks)})


def test_index_round_trip() -> None:
    index = _index()
    index.files["optim-rank00000.safetensors"] = fmt.FileEntry(100, "f" * 32, 0)
    moment = TensorEntry("F32", (5, 3), (Chunk("optim-rank00000.safetensors", "w/exp_avg", _box(0, 5)),))
    index.optimizer = fmt.OptimEntry([{"lr": 0.1, "params": ["w"]}],
                                     {"w": {"exp_avg": moment, "k": fmt.Value(3)}}, {("w", "exp_avg")})
    shared = TensorEntry("F32", (5, 3), (Chunk("optim-rank00000.safetensors", "w", _box(0, 5)),))
    index.model["v"] = shared
    parse_index(index.to_json(), "x/index.json")
    index.blobs["b"] = shared  # two tensors claiming one stored chunk are rejected
    with pytest.raises(CheckpointError, match="also used by"):
        parse_index(index.to_json(), "x/index.json")
    del index.blobs["b"]
    text = index.to_json()
    again = parse_index(text, "x/index.json")
    assert again.to_json() == text
    assert again.optimizer is not None and ("w", "exp_avg") in again.optimizer.sharded


def _doc() -> dict:
    doc = json.loads(_index().to_json())
    del doc[fmt.INDEX_DIGEST_KEY]
    return doc


def _sealed(doc: dict) -> str:
    """An edited index with a recomputed digest (as an adversary or a tool could write it)."""
    return fmt.seal(json.dumps(doc))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=fmt.FORMAT_VERSION + 1), "upgrade fully_shard"),
    (lambda d: d.update(format="something-else"), "not a fully_shard checkpoint"),
    (lambda d: d["files"].update({"../evil.safetensors": {"size": 9, "digest": "0" * 32, "rank": 0}}), "'..'"),
    (lambda d: d["files"].update({"/abs/x.safetensors": {"size": 9, "digest": "0" * 32, "rank": 0}}), "absolute"),
    (lambda d: d["model"]["w"]["chunks"][0].update(file="../model-rank00000.safetensors"), "absolute"),
    (lambda d: d["model"]["w"]["chunks"][0].update(file="other.safetensors"), "not listed under 'files'"),
    (lambda d: d["model"]["w"]["chunks"][0].update(sizes=[4, 3]), "overlap"),
    (lambda d: d["model"]["w"]["chunks"][0].update(sizes=[2, 3]), "covered by no chunk"),
    (lambda d: d["model"]["w"]["chunks"][0].update(sizes=[3, 2]), "covered by no chunk"),
    (lambda d: d["model"]["w"]["chunks"][1].update(sizes=[6, 3]), "outside"),
    (lambda d: d["model"]["w"]["chunks"][1].update(offsets=[3]), "one per dim"),
    (lambda d: d["model"]["w"]["chunks"][1].pop("offsets"), "expected key 'offsets'"),
    (lambda d: d.update(version=1), "re-save the checkpoint"),
    (lambda d: d["model"]["w"].update(dtype="F31"), "expected one of"),
    (lambda d: d["model"]["w"].update(shape=[5, -3]), "non-negative"),
    (lambda d: d["files"]["model-rank00000.safetensors"].update(digest="xyz"), "32-hex-digit"),
    (lambda d: d.pop("model"), "expected key 'model'"),
    (lambda d: d.update(aliases={"v": "missing"}), "aliases"),
])
def test_bad_index_is_rejected_with_the_key(mutate, message: str) -> None:
    doc = _doc()
    mutate(doc)
    with pytest.raises(CheckpointError, match=r"x/index\.json") as err:
        parse_index(_sealed(doc), "x/index.json")
    assert message in str(err.value), str(err.value)
    with pytest.raises(CheckpointError, match=r"x/index\.json.*(digest|trailer)"):  # the edit without the digest
        parse_index(json.dumps(doc), "x/index.json")


def test_every_byte_of_the_index_is_covered_by_its_digest() -> None:
    text = _index().to_json().encode()
    assert parse_index(text, "x/index.json").digest == json.loads(text)[fmt.INDEX_DIGEST_KEY]
    for i in range(len(text)):  # every single-byte change, anywhere (the trailer included), is refused
        flipped = text[:i] + bytes([text[i] ^ 0x01]) + text[i + 1:]
        with pytest.raises(CheckpointError, match=r"x/index\.json"):
            parse_index(flipped, "x/index.json")


@pytest.mark.parametrize("body, message", [
    ('{"a": NaN}', "non-finite number 'NaN'"),
    ('{"a": {"b": [-Infinity]}}', "a['b'][0]: non-finite"),
    ('{"a": [1e999]}', "a[0]: non-finite number inf"),
    ('{"a": 1, "b": {"c": 1, "c": 2}}', "b: duplicate key 'c'"),
    ('{"a": ' + "[" * 70 + "]" * 70 + "}", "nested deeper than the 64 levels"),
    ('{"a": ' + "[" * 100000 + "]" * 100000 + "}", "nesting far deeper"),
])
def test_strict_json(body: str, message: str) -> None:
    with pytest.raises(CheckpointError, match=r"x/index\.json") as err:
        parse_index(fmt.seal(body), "x/index.json")
    assert message in str(err.value), str(err.value)


def test_index_bytes_must_be_utf8_and_strings_bounded() -> None:
    body = b'{"a": "caf\xe9"'  # latin-1, not UTF-8, under a valid digest
    raw = body + b',\n "index_digest": "' + xxhash.xxh3_128_hexdigest(body).encode() + b'"\n}\n'
    with pytest.raises(CheckpointError, match=r"x/index\.json: byte 10: not valid UTF-8"):
        parse_index(raw, "x/index.json")
    with pytest.raises(CheckpointError, match=r"a\['s'\]: a string of 40 characters"):
        validate.loads_strict(b'{"a": {"s": "' + b"x" * 40 + b'"}}', "x", max_string=32)


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.text(max_size=8),
                      st.floats(allow_nan=False), st.sampled_from([math.inf, -math.inf]), st.binary(max_size=8))
trees = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner),
    st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-5, 5)), inner, max_size=4)), max_leaves=20)


@SETTINGS
@given(trees)
def test_codec_round_trips_json_values(tree: object) -> None:
    enc = Encoder("x/")
    encoded = enc.encode(tree, "extra")
    text = json.dumps(encoded, allow_nan=False)  # strict JSON, no pickle
    assert decode(json.loads(text), enc.tensors.__getitem__) == tree


def test_codec_tensors_numpy_and_nan() -> None:
    enc = Encoder("x/")
    rng = np.random.default_rng(0)
    tree: dict = {"rng": torch.get_rng_state(), "np": rng.integers(0, 9, 5).astype(np.uint32), "nan": math.nan,
            "__dunder": 1, "scalar": np.float32(1.5)}
    encoded = json.loads(json.dumps(enc.encode(tree, "extra"), allow_nan=False))
    assert sorted(tensor_refs(encoded)) == sorted(enc.tensors)
    out: dict = decode(encoded, enc.tensors.__getitem__)
    assert torch.equal(out["rng"], tree["rng"]) and np.array_equal(out["np"], tree["np"])
    assert math.isnan(out["nan"]) and out["__dunder"] == 1 and out["scalar"] == 1.5


def test_codec_rejects_unstorable_values() -> None:
    with pytest.raises(CheckpointError, match=r"extra\['fn'\].*never pickle"):
        Encoder("x/").encode({"fn": lambda: 0}, "extra")


def test_series_key() -> None:
    """The step is the last digit run; everything else names the series."""
    assert series_key("step-000300") == ("step-", "", 300)
    assert series_key("exp1-step-000010") == ("exp1-step-", "", 10) != series_key("exp2-step-000010")[:2]  # type: ignore[index]
    assert series_key("seed2-step-100")[:2] != series_key("seed1-step-900")[:2]  # type: ignore[index]
    assert series_key("step-99")[:2] == series_key("step-100")[:2]  # type: ignore[index]
    assert series_key("final") is None and series_key(".step-1.tmp-ab12") is None


def test_data_file_layout_puts_small_tensors_first(tmp_path: object) -> None:
    """Within an element size, tensors of at most SMALL_BYTES come first (the step counters and replicated buffers
    another rank reads one by one share a page), otherwise state_dict order; the file reads back as written."""
    from safetensors.torch import load_file

    from fully_shard.checkpoint import safetensors_io as sio

    tensors = {"w/exp_avg": torch.arange(20000.0), "w/step": torch.tensor(3.0), "d": torch.arange(9000.0).double(),
               "v/exp_avg": torch.arange(17000.0), "v/step": torch.tensor(4.0), "bias": torch.arange(5.0),
               "half": torch.ones(3, dtype=torch.float16), "big_half": torch.ones(40000, dtype=torch.float16)}
    assert sio.encode_header(tensors, {})[1] == ["d", "w/step", "v/step", "bias", "w/exp_avg", "v/exp_avg", "half",
                                                 "big_half"]
    path = f"{tmp_path}/x.safetensors"
    sio.save_file(tensors, path, {})
    back = load_file(path)
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
