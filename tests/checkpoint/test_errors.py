"""Bad input: every case raises a clear CheckpointError on every rank (no hang, no partial load)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fully_shard import checkpoint
from fully_shard.checkpoint import CheckpointError
from fully_shard.checkpoint import format as fmt
from tests.checkpoint import common as C
from tests.distributed.harness import distributed


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset if offset >= 0 else os.path.getsize(path) + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x55]))


def _edit_index(d: str, edit: Callable[[dict], None]) -> None:
    """Edit index.json and recompute its digest (an adversary's or a tool's edit), to reach the checks behind it."""
    p = os.path.join(d, "index.json")
    doc = json.loads(Path(p).read_text())
    del doc[fmt.INDEX_DIGEST_KEY]
    edit(doc)
    Path(p).write_text(fmt.seal(json.dumps(doc)))


def _edit_text(d: str, pattern: str, replacement: str) -> None:
    """Edit index.json's text in place, keeping its (now stale) digest."""
    p = Path(d, "index.json")
    text, n = re.subn(pattern, replacement, p.read_text())
    assert n == 1, (pattern, n)
    p.write_text(text)


def _set_header_len(path: str, n: int) -> None:
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", n))


def _replace_with_file(d: str) -> None:
    shutil.rmtree(d)
    Path(d).write_text("hi")


def _replace(path: str, make: Callable[[str], object]) -> None:
    """``path`` replaced by something that is not a regular file (os.mkfifo, os.mkdir)."""
    os.remove(path)
    make(path)


def _chunk_file(doc: dict, name: str) -> None:
    doc["model"]["pos"]["chunks"][0]["file"] = name
    doc["files"][name] = doc["files"].pop("model-rank00000.safetensors")


def _swap_chunks(doc: dict) -> None:
    """Two same-shaped tensors' chunk lists swapped: only the files' own records can tell."""
    m = doc["model"]
    m["blocks.0.qkv.weight"]["chunks"], m["blocks.1.qkv.weight"]["chunks"] = \
        m["blocks.1.qkv.weight"]["chunks"], m["blocks.0.qkv.weight"]["chunks"]


M0, M1, O1 = "model-rank00000.safetensors", "model-rank00001.safetensors", "optim-rank00001.safetensors"

# name -> (corrupt(dir), model kwargs, load kwargs, expected message fragments)
CASES: dict[str, tuple[Callable[[str], object] | str | None, dict, dict, list[str]]] = {
    "missing shard file": (lambda d: os.remove(os.path.join(d, M1)), {}, {}, [M1, "missing"]),
    "truncated file": (lambda d: os.truncate(os.path.join(d, M0), os.path.getsize(os.path.join(d, M0)) - 7), {}, {},
                       [M0, "truncated"]),
    # Only rank 1 hashes optim-rank00001 and only rank 1 reads from it at W=2: rank 0 must fail too.
    "flipped data byte (seen by one rank)": (lambda d: _flip(os.path.join(d, O1), -3), {}, {}, [O1, "digest"]),
    "flipped header byte": (lambda d: _flip(os.path.join(d, M0), 8), {}, {"verify": False}, [M0, "not valid JSON"]),
    "oversized header": (lambda d: _set_header_len(os.path.join(d, M0), 1 << 40), {}, {"verify": False},
                         [M0, "oversized header"]),
    "header longer than file": (lambda d: _set_header_len(os.path.join(d, M1), 10 << 20), {}, {"verify": False},
                                [M1, "only"]),
    "shape mismatch": (None, {"hidden": 150}, {},
                       ["dtype/shape differs", "blocks.0.up.weight: expected F32[150, 60], found F32[157, 60]"]),
    "dtype mismatch": (None, {"dtype": torch.float64}, {}, ["dtype/shape differs", "tok.weight: expected F64[997, 60], "
                                                            "found F32[997, 60]"]),
    "missing keys (strict)": (None, {"n_blocks": 3}, {}, ["missing in checkpoint", "blocks.2.qkv.weight"]),
    "unexpected keys (strict)": (None, {"n_blocks": 1}, {}, ["unexpected in checkpoint", "blocks.1.qkv.weight"]),
    "file outside the checkpoint": (
        lambda d: _edit_index(d, lambda doc: _chunk_file(doc, "../model-rank00000.safetensors")), {}, {},
        ["'..'", "index.json"]),
    "absolute file path": (lambda d: _edit_index(d, lambda doc: _chunk_file(doc, "/etc/passwd")), {}, {},
                           ["absolute", "index.json"]),
    "newer format version": (lambda d: _edit_index(d, lambda doc: doc.update(version=99)), {}, {},
                             ["version 99", "upgrade fully_shard"]),
    "malformed index": (lambda d: Path(d, "index.json").write_text('{"format": "fully_shard-checkpoint", "ver'), {}, {},
                        ["index_digest", "index.json"]),
    "malformed index under a valid digest": (
        lambda d: Path(d, "index.json").write_text(fmt.seal('{"format": "fully_shard-checkpoint", "ver": [}')), {}, {},
        ["not valid JSON", "index.json"]),
    "edited index (digest not recomputed)": (
        lambda d: _edit_text(d, r'"step": ?1\b', '"step": 2'), {}, {},
        ["index.json", "content digest", "differs"]),
    # All or nothing: extra is decoded and its file checked before the model or optimizer is touched.
    "bad marker in extra (digest recomputed)": (
        lambda d: _edit_index(d, lambda doc: doc["extra"].update(step={"__tuple__": 5})), {}, {},
        ["index.json", "extra: cannot decode"]),
    "extra refers to a missing tensor (digest recomputed)": (
        lambda d: _edit_index(d, lambda doc: doc["extra"].update(step={"__tensor__": "extra/9"})), {}, {},
        ["index.json", "extra refers to tensor 'extra/9'"]),
    "extra file header damaged (verify=False)": (
        lambda d: _flip(os.path.join(d, "extra-rank00000.safetensors"), 8), {}, {"verify": False},
        ["extra-rank00000.safetensors", "not valid JSON"]),
    "two chunk lists swapped (digest recomputed)": (lambda d: _edit_index(d, _swap_chunks), {}, {},
                                                    [M0, "does not belong to this index"]),
    "not a checkpoint (no index)": (lambda d: os.remove(os.path.join(d, "index.json")), {}, {},
                                    ["not a fully_shard checkpoint", "no index.json"]),
    "not a checkpoint (no directory)": (lambda d: shutil.rmtree(d), {}, {}, ["no such checkpoint"]),
    "not a checkpoint (a file)": (lambda d: _replace_with_file(d), {}, {}, ["is a file"]),
    "optimizer state absent": ("no-optim", {}, {}, ["has no optimizer state"]),
    # Found by a fuzz: a FIFO made the open block forever; a directory gave an error naming no file.
    "data file is a FIFO": (lambda d: _replace(os.path.join(d, M1), os.mkfifo), {}, {}, [M1, "FIFO"]),
    "index.json is a FIFO": (lambda d: _replace(os.path.join(d, "index.json"), os.mkfifo), {}, {},
                             ["index.json", "FIFO", "regular file"]),
    "index.json is a directory": (lambda d: _replace(os.path.join(d, "index.json"), os.mkdir), {}, {},
                                  ["index.json", "a directory", "regular file"]),
}


def _model(kwargs: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    model = C.make_gpt(seed=5, **kwargs)
    if dtype is not None:
        model = model.to(dtype)
    C.shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@distributed(world_size=2)
def _bad_inputs(tmp: str, names: list[str]) -> dict[str, str | None]:
    rank = dist.get_rank()
    good = os.path.join(tmp, "good")
    model, opt = _model({})
    C.train(model, opt, 0, 1)
    checkpoint.save(good, model, opt, extra={"step": 1, "rng": torch.arange(3)})
    checkpoint.save(os.path.join(tmp, "no-optim"), model)
    results: dict[str, str | None] = {}
    for name in names:
        corrupt, model_kwargs, load_kwargs, _ = CASES[name]
        case = os.path.join(tmp, f"case-{names.index(name)}")
        if corrupt == "no-optim":
            case = os.path.join(tmp, "no-optim")
        elif rank == 0:
            shutil.copytree(good, case)
            if callable(corrupt):
                corrupt(case)
        dist.barrier()
        target, target_opt = _model(model_kwargs)
        before = C.full_state(target)
        try:
            checkpoint.load(case, target, target_opt, **load_kwargs)
            results[name] = None
        except CheckpointError as e:
            results[name] = str(e)
        C.assert_same(C.full_state(target), before, f"{name}: model changed by a failed load")
        assert not target_opt.state, f"{name}: optimizer changed by a failed load"
    # The pool still works and the good checkpoint still loads.
    target, target_opt = _model({})
    loaded = checkpoint.load(good, target, target_opt)
    assert loaded["step"] == 1 and torch.equal(loaded["rng"], torch.arange(3)), loaded
    C.assert_same(C.full_state(target), C.full_state(model), "good checkpoint")
    # strict=False skips missing/unexpected keys and loads the rest.
    small, small_opt = _model({"n_blocks": 1})
    checkpoint.load(good, small, small_opt, strict=False)
    want = {k: v for k, v in C.full_state(model).items() if not k.startswith("blocks.1.")}
    C.assert_same(C.full_state(small), want, "strict=False")
    return results


def test_every_bad_input_fails_clearly_on_every_rank(tmp_path: Path) -> None:
    names = list(CASES)
    per_rank = _bad_inputs(str(tmp_path), names)
    C.assert_clear_errors(per_rank, {name: CASES[name][3] for name in names})
    print("\n" + per_rank[0]["shape mismatch"])  # type: ignore[operator]


def test_single_process_errors(tmp_path: Path) -> None:
    """Without a process group: bad save inputs and not-a-checkpoint paths."""
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"extra\['fn'\]"):
        checkpoint.save(tmp_path / "a", model, extra={"fn": print})
    assert not (tmp_path / "a").exists() and not list(tmp_path.iterdir())  # nothing left behind
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        checkpoint.load(tmp_path / "nope", model)
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_text("x")
    with pytest.raises(CheckpointError, match=r"torch\.distributed\.checkpoint"):
        checkpoint.load(tmp_path / "dcp", model)
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.save(tmp_path / "b", model, keep_last=0)
    # save never replaces what is not a checkpoint.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="not a fully_shard checkpoint"):
        checkpoint.save(tmp_path / "mine", model)
    (tmp_path / "file").write_text("precious")
    with pytest.raises(CheckpointError, match="not a directory"):
        checkpoint.save(tmp_path / "file", model)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious" == (tmp_path / "file").read_text()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary directory left
    (tmp_path / "empty").mkdir()
    checkpoint.save(tmp_path / "empty", model)  # an empty directory is fine
    checkpoint.load(tmp_path / "empty", model)
