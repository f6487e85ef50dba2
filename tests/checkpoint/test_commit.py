"""Commit protocol: async save overlapping training, overwrite, keep_last retention, interrupted-commit recovery."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from fully_shard import checkpoint
from fully_shard.checkpoint import commit as commit_dir
from fully_shard.checkpoint import safetensors_io as sio
from tests.checkpoint import common as C
from tests.distributed.harness import distributed


def _fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = C.shard(C.make_gpt(seed=seed))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@distributed(world_size=2)
def _async_save(tmp: str) -> dict:
    path = os.path.join(tmp, "async")
    model, opt = _fresh(0)
    C.train(model, opt, 0, 2)
    before, before_opt = C.full_state(model), C.full_optim(model, opt)
    real_write = sio.write_file
    writing = threading.Event()

    def slow_write(*args: object, **kwargs: object) -> sio.WrittenFile:
        writing.set()
        time.sleep(0.4)  # a slow disk, so that the overlap is observable
        return real_write(*args, **kwargs)  # type: ignore[arg-type]

    sio.write_file = slow_write  # type: ignore[assignment]
    try:
        handle = checkpoint.save(path, model, opt, extra={"step": 2}, async_save=True)
        assert handle is not None
        C.train(model, opt, 2, 1)  # a training step while the files are written (it updates params in place)
        overlapped = writing.is_set() and not handle.done()
        exists_before_wait = os.path.exists(path)
        handle.wait()
        handle.wait()  # idempotent
    finally:
        sio.write_file = real_write
    after = C.full_state(model)
    loaded, loaded_opt = _fresh(9)
    assert checkpoint.load(path, loaded, loaded_opt) == {"step": 2}
    C.assert_same(C.full_state(loaded), before, "async checkpoint holds the state at save() time")
    C.assert_same(C.full_optim(loaded, loaded_opt), before_opt, "async optimizer state")
    changed = any(not torch.equal(after[k], before[k]) for k in before)
    # A load right after an async save waits for it (no race with an unfinished commit).
    checkpoint.save(os.path.join(tmp, "async2"), model, opt, async_save=True)
    checkpoint.load(os.path.join(tmp, "async2"), loaded, loaded_opt)
    C.assert_same(C.full_state(loaded), after, "load after async save")
    return {"overlapped": overlapped, "exists_before_wait": exists_before_wait, "changed": changed}


def test_async_save_overlaps_a_training_step(tmp_path: Path) -> None:
    for result in _async_save(str(tmp_path)):
        assert result == {"overlapped": True, "exists_before_wait": False, "changed": True}, result


@distributed(world_size=2)
def _retention_and_overwrite(tmp: str) -> list[str]:
    model, opt = _fresh(0)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(tmp, "step-0"))  # same series name, no index.json: not a checkpoint, never touched
        os.makedirs(os.path.join(tmp, "other"))
    for step in range(1, 5):
        C.train(model, opt, step, 1)
        checkpoint.save(os.path.join(tmp, f"step-{step}"), model, opt, extra={"step": step}, keep_last=2)
    # Overwriting a checkpoint in place is safe and leaves nothing behind.
    last = C.full_state(model)
    C.train(model, opt, 5, 1)
    checkpoint.save(os.path.join(tmp, "step-4"), model, opt, extra={"step": 5}, keep_last=2)
    fresh, fresh_opt = _fresh(3)
    assert checkpoint.load(os.path.join(tmp, "step-4"), fresh, fresh_opt) == {"step": 5}
    now = C.full_state(model)
    C.assert_same(C.full_state(fresh), now, "overwritten checkpoint")
    assert any(not torch.equal(now[k], last[k]) for k in now)
    dist.barrier()
    return sorted(os.listdir(tmp))


def test_keep_last_and_overwrite(tmp_path: Path) -> None:
    listing = _retention_and_overwrite(str(tmp_path))[0]
    assert listing == ["other", "step-0", "step-3", "step-4"], listing


def _save_gen(path: str, gen: float) -> None:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(gen)
    checkpoint.save(path, model, extra={"gen": gen})


def _load_gen(path: str) -> float:
    model = torch.nn.Linear(4, 3)
    gen = checkpoint.load(path, model)["gen"]
    assert all(bool((p == gen).all()) for p in model.parameters())
    return gen


def _tree(root: Path) -> list[tuple[str, int, int]]:
    """Every entry under ``root`` with its size and mtime: what a read-only load must leave as it found it."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.stat(os.path.join(dirpath, name))
            out.append((os.path.relpath(os.path.join(dirpath, name), root), st.st_size, st.st_mtime_ns))
    return sorted(out)


def test_recovery_of_interrupted_commits(tmp_path: Path) -> None:
    """The states a crash can leave on disk (single process), and what load / the next save make of them."""
    path = str(tmp_path / "ckpt")
    _save_gen(path, 1.0)
    _save_gen(str(tmp_path / "new"), 2.0)
    # Crash between "rename old aside" and "rename new in": path is missing, both complete siblings exist.
    os.rename(path, commit_dir._sibling(path, "old", "ab12"))
    os.rename(str(tmp_path / "new"), commit_dir.tmp_dir(path, "ab12"))
    assert not os.path.exists(path)
    before = _tree(tmp_path)
    assert _load_gen(path) == 2.0  # load reads the new generation from its sibling ...
    assert _tree(tmp_path) == before  # ... and never modifies the directory
    _save_gen(str(tmp_path / "other"), 9.0)  # a save of another path leaves this one alone
    assert not os.path.exists(path)
    commit_dir.recover(path)  # the next save of the path finishes the commit (rank 0 calls recover)
    assert os.path.isdir(path) and _load_gen(path) == 2.0
    shutil.rmtree(tmp_path / "other")
    # Crash before the index was written: an incomplete tmp dir never loads and the next save removes it.
    os.makedirs(commit_dir.tmp_dir(path, "cd34"))
    Path(commit_dir.tmp_dir(path, "cd34"), "model-rank00000.safetensors").write_bytes(b"half")
    assert _load_gen(path) == 2.0
    # Crash after the new checkpoint was renamed in, before the old one was deleted.
    _save_gen(str(tmp_path / "older"), 0.5)
    os.rename(str(tmp_path / "older"), commit_dir._sibling(path, "old", "ef56"))
    assert _load_gen(path) == 2.0
    _save_gen(path, 3.0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # leftovers cleaned by the next save
    assert _load_gen(path) == 3.0
    # Only an old copy survives (path missing, no new tmp): it is restored rather than lost.
    os.rename(path, commit_dir._sibling(path, "old", "0099"))
    assert _load_gen(path) == 3.0


@distributed(world_size=2)
def _per_rank_extra(tmp: str) -> dict:
    rank = dist.get_rank()
    model, opt = _fresh(0)
    path = os.path.join(tmp, "per-rank")
    checkpoint.save(path, model, opt, extra={"rank": rank, "rng": torch.full((3,), rank), "shared": "same"})
    return checkpoint.load(path, model, opt)


def test_extra_state_that_differs_per_rank(tmp_path: Path) -> None:
    out = _per_rank_extra(str(tmp_path))
    for rank, extra in enumerate(out):  # same world size: each rank gets its own
        assert extra["rank"] == rank and torch.equal(extra["rng"], torch.full((3,), rank)) and extra["shared"] == "same"
    model = C.make_gpt(seed=4)  # another world size (one process): rank 0's, with a warning
    with pytest.warns(UserWarning, match="differed between the 2 saving ranks"):
        extra = checkpoint.load(tmp_path / "per-rank", model)
    assert extra["rank"] == 0


def test_tied_weights_are_stored_once(tmp_path: Path) -> None:
    tied = C.make_gpt(seed=1, tied=True)
    checkpoint.save(tmp_path / "tied", tied)
    index = json.loads((tmp_path / "tied" / "index.json").read_text())
    assert index["aliases"] == {"head.weight": "tok.weight"}
    fresh = C.make_gpt(seed=2, tied=True)
    checkpoint.load(tmp_path / "tied", fresh)
    assert fresh.head.weight is fresh.tok.weight
    C.assert_same(dict(fresh.state_dict()), dict(tied.state_dict()), "tied")
    untied = C.make_gpt(seed=2)  # an untied model gets the shared tensor under both names
    checkpoint.load(tmp_path / "tied", untied)
    assert torch.equal(untied.head.weight, tied.tok.weight)
    hf = checkpoint.consolidate(tmp_path / "tied", tmp_path / "hf")
    untied.load_state_dict(load_file(hf[0]))  # both names present: strict load_state_dict works


def test_parameters_that_are_views_of_one_buffer(tmp_path: Path) -> None:
    """Parameters that are disjoint views of one flat buffer (saved without copies) save and load."""
    flat = torch.randn(30)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(flat[:10].view(2, 5))
    model.b = torch.nn.Parameter(flat[10:])
    checkpoint.save(tmp_path / "views", model)
    other = torch.nn.Module()
    other.a = torch.nn.Parameter(torch.zeros(2, 5))
    other.b = torch.nn.Parameter(torch.zeros(20))
    checkpoint.load(tmp_path / "views", other)
    assert torch.equal(other.a, model.a) and torch.equal(other.b, model.b)


def _tiny(gen: float) -> torch.nn.Module:
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(gen)
    return model


def _series(root: Path, names: list[str]) -> None:
    for name in names:
        checkpoint.save(root / name, _tiny(1.0))


@pytest.mark.parametrize("existing, written, keep, expected", [
    # Another experiment's series is never touched.
    (["exp1-step-000010", "exp1-step-000020", "exp1-step-000030"], "exp2-step-000010", 1,
     ["exp1-step-000010", "exp1-step-000020", "exp1-step-000030", "exp2-step-000010"]),
    (["seed1-step-900"], "seed2-step-100", 1, ["seed1-step-900", "seed2-step-100"]),
    # Ordered by step number, not by name; unpadded and padded steps of one series mix.
    (["step-99", "step-100", "step-0098"], "step-101", 2, ["step-100", "step-101"]),
    # The checkpoint just written is kept even when it is not the newest step.
    (["run-step-10", "run-step-20"], "run-step-5", 1, ["run-step-20", "run-step-5"]),
    # Suffixes are part of the series name.
    (["m-1.ckpt", "m-2.ckpt", "m-3.bak"], "m-4.ckpt", 1, ["m-3.bak", "m-4.ckpt"]),
])
def test_keep_last_deletes_only_older_steps_of_the_same_series(tmp_path: Path, existing: list[str], written: str,
                                                               keep: int, expected: list[str]) -> None:
    _series(tmp_path, existing)
    checkpoint.save(tmp_path / written, _tiny(2.0), keep_last=keep)
    assert sorted(os.listdir(tmp_path)) == sorted(expected)


def test_keep_last_leaves_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    _series(tmp_path, ["step-1", "step-2"])
    (tmp_path / "step-0").mkdir()  # no index.json: not a checkpoint
    os.symlink(tmp_path / "step-1", tmp_path / "step-00")  # a link named like the series
    (tmp_path / "step-3.txt").write_text("notes")
    checkpoint.save(tmp_path / "step-4", _tiny(2.0), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["step-0", "step-00", "step-3.txt", "step-4"]


@distributed(world_size=2)
def _deterministic(tmp: str) -> None:
    model, opt = _fresh(0)
    C.train(model, opt, 0, 1)
    extra = {"step": 1, "rng": torch.arange(3), "nested": {"b": (1, 2.5), "a": [None, "x"]}}
    for name in ("a", "b"):
        checkpoint.save(os.path.join(tmp, name), model, opt, extra=extra)
    checkpoint.save(os.path.join(tmp, "c"), model, opt, extra=extra, async_save=True)
    checkpoint.wait_pending()


def test_identical_state_gives_identical_files(tmp_path: Path) -> None:
    _deterministic(str(tmp_path))
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(os.listdir(tmp_path / "b")) == sorted(os.listdir(tmp_path / "c")) and len(names) > 4
    for name in names:
        data = (tmp_path / "a" / name).read_bytes()
        assert data == (tmp_path / "b" / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name


def _writer_loop(path: str, stop: Any, conn: Any) -> None:
    """Overwrite ``path`` with generation 2, 3, ... until told to stop; report (saves, errors)."""
    torch.set_num_threads(1)
    saves, errors = 0, []
    gen = 2.0
    while not stop.is_set():
        try:
            checkpoint.save(path, _tiny(gen), extra={"gen": gen})
            saves += 1
        except Exception as e:  # a load must never make a save fail
            errors.append(f"{type(e).__name__}: {e}")
        gen += 1.0
    conn.send((saves, errors))


def test_a_reader_beside_a_writer_reads_one_generation(tmp_path: Path) -> None:
    """The "evaluate the latest checkpoint" pattern: loads (a third of them in place) race an overwriting writer,
    bounded loop."""
    import multiprocessing as mp

    path = str(tmp_path / "latest")
    checkpoint.save(path, _tiny(1.0), extra={"gen": 1.0})
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    parent, child = ctx.Pipe()
    writer = ctx.Process(target=_writer_loop, args=(path, stop, child))
    writer.start()
    counts = {"loaded": 0, "failed cleanly": 0, "mixed": 0}
    seen: set[float] = set()
    failures: list[str] = []
    try:
        deadline = time.monotonic() + 8.0
        for i in range(400):
            if time.monotonic() > deadline:
                break
            model = _tiny(-1.0)
            try:
                mode = checkpoint.LoadMode.IN_PLACE if i % 3 == 0 else checkpoint.LoadMode.STAGED
                gen = checkpoint.load(path, model, verify=i % 2 == 0, mode=mode)["gen"]
            except checkpoint.CheckpointError as e:
                counts["failed cleanly"] += 1
                failures.append(str(e).splitlines()[-1][:160])
                continue
            values = {float(v) for p in model.parameters() for v in p.detach().flatten()}
            counts["mixed" if values != {gen} else "loaded"] += 1
            seen.add(gen)
    finally:
        stop.set()
        writer.join(60)
    saves, errors = parent.recv()
    print(f"\nreader beside writer: {sum(counts.values())} loads {counts}, {len(seen)} generations seen, "
          f"{saves} saves by the writer, {len(errors)} save errors; failures: {sorted(set(failures))[:3]}")
    assert counts["mixed"] == 0, counts
    assert not errors, errors[:3]
    assert counts["loaded"] > 0 and len(seen) > 1, (counts, seen)
