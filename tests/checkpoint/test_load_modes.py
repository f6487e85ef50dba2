"""checkpoint.load's two modes (design/checkpoint-format.md section 7).

LoadMode.IN_PLACE gives bitwise the staged result (here into fresh and into existing optimizer state;
every layout of test_resume.py and test_multidim.py loads both ways through common.load_both), writes
into the tensors the model and optimizer hold, and maps no memory beyond its ring of blocks. When
content is bad it raises PartialLoadError on every rank, and what it says each rank's tensors hold is
checked tensor by tensor against their bytes: untouched ones as before, overwritten ones as stored,
partly overwritten ones element by element one or the other. What can be checked before writing
(sizes, headers, missing files) still fails with nothing changed. A staged load that hits an I/O error
while copying reports the same way; a staged load that fails its checks changes nothing (test_errors,
test_fuzz).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import shutil
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fully_shard import checkpoint, fully_shard
from fully_shard.checkpoint import LoadMode, PartialLoadError, direct, reader
from tests.checkpoint import common as C
from tests.distributed.harness import _free_port, distributed

STAGED, IN_PLACE = LoadMode.STAGED, LoadMode.IN_PLACE


def _target(seed: int = 5, lr: float = 0.5, placement_fn: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A sharded TinyGPT from another seed whose AdamW already holds state (one step) and another lr."""
    model = C.make_gpt(seed=seed)
    for blk in model.blocks:
        fully_shard(blk, shard_placement_fn=placement_fn)
    fully_shard(model, shard_placement_fn=placement_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    C.train(model, opt, 7, 1)
    return model, opt


def _pointers(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    out = {k: (v.to_local() if isinstance(v, DTensor) else v).data_ptr() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"{names[id(p)]}/{k}"] = (v.to_local() if isinstance(v, DTensor) else v).data_ptr()
    return out


def _mapped(fn: Any) -> list[int]:
    """Sizes of the page-aligned mappings ``fn()`` creates (file images, ring blocks)."""
    sizes: list[int] = []
    real = direct.aligned

    def counted(nbytes: int) -> Any:
        sizes.append(nbytes)
        return real(nbytes)

    with mock.patch.object(direct, "aligned", counted):
        fn()
    return sizes


@distributed(world_size=2)
def _equal_and_in_place(tmp: str) -> dict[str, Any]:
    good = os.path.join(tmp, "good")
    model = C.shard(C.make_gpt(seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    C.train(model, opt, 0, 2)
    checkpoint.save(good, model, opt, extra={"step": 2, "rng": torch.arange(3)})
    truth = C.local_bytes(model, opt)
    out: dict[str, Any] = {}
    for first, second in ((STAGED, IN_PLACE), (IN_PLACE, STAGED)):
        target = C.shard(C.make_gpt(seed=5))
        target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)  # no state yet: it is read into fresh memory
        extra = checkpoint.load(good, target, target_opt, mode=first)
        assert extra["step"] == 2 and torch.equal(extra["rng"], torch.arange(3)), extra
        got = C.local_bytes(target, target_opt)
        assert got == truth, f"{first} into a fresh optimizer: {[k for k in truth if got.get(k) != truth[k]]}"
        before = _pointers(target, target_opt)
        C.scramble(target, target_opt)
        checkpoint.load(good, target, target_opt, mode=second)  # into the state the optimizer now holds
        got = C.local_bytes(target, target_opt)
        assert got == truth, f"{second} into existing state: {[k for k in truth if got.get(k) != truth[k]]}"
        after = _pointers(target, target_opt)
        moved = [k for k in before if after[k] != before[k]]
        if second is IN_PLACE:
            assert not moved, f"in place: not written into the tensors held: {moved}"
        else:  # the model's tensors are written; CPU optimizer state becomes views of the new file image
            assert moved and all("/" in k for k in moved), moved
        C.train(target, target_opt, 2, 1)  # and it trains on
    # Memory: in place maps only its ring of blocks (and the small extra file's image, whose tensor it keeps);
    # staged maps the rank's share, then a second buffer for the optimizer's file (the first is its state until
    # the load replaces it), then nothing: the two alternate.
    target, target_opt = _target()
    extra_bytes = sum(os.path.getsize(os.path.join(good, n)) for n in os.listdir(good) if n.startswith("extra-"))
    share = sum(os.path.getsize(os.path.join(good, n)) for n in os.listdir(good)
                if n.endswith(f"rank{dist.get_rank():05d}.safetensors") and not n.startswith("extra-"))
    direct.POOL.clear()
    out["in place"] = _mapped(lambda: checkpoint.load(good, target, target_opt, mode=IN_PLACE))
    assert sum(out["in place"]) <= (direct.DEPTH + 1) * direct.BLOCK_BYTES + extra_bytes + 4096, out
    direct.POOL.clear()
    out["staged, empty pool"] = _mapped(lambda: checkpoint.load(good, target, target_opt))
    assert sum(out["staged, empty pool"]) >= share, (out, share)
    optim = os.path.getsize(os.path.join(good, f"optim-rank{dist.get_rank():05d}.safetensors"))
    out["staged again"] = _mapped(lambda: checkpoint.load(good, target, target_opt))
    assert sum(out["staged again"]) <= optim + extra_bytes + 2 * 4096, out
    for i in range(2):
        out[f"staged, load {i + 3}"] = _mapped(lambda: checkpoint.load(good, target, target_opt))
        assert sum(out[f"staged, load {i + 3}"]) <= extra_bytes + 4096, out  # every image from the pool
    assert direct.POOL.nbytes <= share + optim + extra_bytes + 3 * 4096, direct.POOL.nbytes
    assert C.local_bytes(target, target_opt) == truth
    return out


def test_in_place_equals_staged_and_writes_into_the_held_tensors(tmp_path: Path) -> None:
    print(f"\nmapped per load (bytes, rank 0): {_equal_and_in_place(str(tmp_path))[0]}")


# ---------------------------------------------------------------------------------------------------------
# Bad content in place: every rank says exactly what it overwrote
# ---------------------------------------------------------------------------------------------------------

def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x55]))


def _data_middle(path: str) -> int:
    with open(path, "rb") as f:
        head = 8 + int.from_bytes(f.read(8), "little")
    return (head + os.path.getsize(path)) // 2




def _single(name: str) -> bool:
    """Written by one rank (into its files) however the model is sharded: the buffer, the 0-dim gates and
    their state, AdamW's step counters."""
    return name == "calib" or name.endswith("/step") or name.split("/")[0] in ("blocks.0.gate", "blocks.1.gate")


M0, M1, O0 = "model-rank00000.safetensors", "model-rank00001.safetensors", "optim-rank00000.safetensors"


@contextlib.contextmanager
def _cut_while_loading(name: str, rank: int) -> Iterator[None]:
    """On ``rank``, file ``name`` is cut to half its size after every check passed, just before its bytes are
    written (an I/O error mid-load); files are read in blocks of 16 KiB, so that some blocks arrive first."""
    real = reader.Loader.write

    def write(self: reader.Loader, reads: list[Any]) -> None:
        if dist.get_rank() == rank:
            f = self.snap.files[name]
            os.truncate(f.where, f.size // 2)
        real(self, reads)

    with mock.patch.object(reader.Loader, "write", write), mock.patch.object(direct, "BLOCK_BYTES", 16 << 10):
        yield


# name -> (damage to the copy before the load, patch during it, mode, load kwargs, expect a partial load)
CASES: dict[str, tuple[Any, Any, LoadMode, dict[str, Any], bool]] = {
    "flipped byte in rank 1's model file": (lambda d: _flip(os.path.join(d, M1), _data_middle(os.path.join(d, M1))),
                                            None, IN_PLACE, {}, True),
    "flipped byte in rank 0's optimizer file": (lambda d: _flip(os.path.join(d, O0), _data_middle(os.path.join(d, O0))),
                                                None, IN_PLACE, {}, True),
    "file cut in half while loading": (None, lambda: _cut_while_loading(M0, 0), IN_PLACE, {}, True),
    "truncated file": (lambda d: os.truncate(os.path.join(d, M1), os.path.getsize(os.path.join(d, M1)) - 7), None,
                       IN_PLACE, {}, False),
    "missing file": (lambda d: os.remove(os.path.join(d, O0)), None, IN_PLACE, {}, False),
    "flipped header byte": (lambda d: _flip(os.path.join(d, M0), 8), None, IN_PLACE, {}, False),
    # Staged: a column-sharded target reads part of the other rank's file with pread after every check passed.
    "staged: the other rank's file cut while copying": (None, lambda: _cut_while_loading(M0, 1), STAGED,
                                                        {"placement_fn": "shard1"}, True),
}


def _shard1(p: torch.nn.Parameter) -> Shard | None:
    return Shard(1) if p.dim() == 2 else None


def _items(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Element size of every tensor C.local_bytes lists."""
    out = {k: v.element_size() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    out.update({f"{names[id(p)]}/{k}": v.element_size() for p, s in opt.state.items() for k, v in s.items()})
    return out


def _elements(raw: bytes, item: int) -> list[bytes]:
    return [raw[i:i + item] for i in range(0, len(raw), item)]


@distributed(world_size=2, timeout=300)
def _partial_loads(tmp: str, names: list[str]) -> dict[str, Any]:
    rank = dist.get_rank()
    good = os.path.join(tmp, "good")
    model = C.shard(C.make_gpt(seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    C.train(model, opt, 0, 2)
    checkpoint.save(good, model, opt, extra={"step": 2})
    results: dict[str, Any] = {}
    for i, name in enumerate(names):
        damage, patch, mode, kwargs, partial = CASES[name]
        case = os.path.join(tmp, f"case-{i}")
        if rank == 0:
            shutil.copytree(good, case)
            if damage is not None:
                damage(case)
        dist.barrier()
        placement = _shard1 if kwargs.get("placement_fn") == "shard1" else None
        # What each tensor holds if the load writes it whole: the checkpoint's bytes as they are on disk.
        stored_model, stored_opt = _target(seed=3, placement_fn=placement)
        if partial and patch is None:
            checkpoint.load(case, stored_model, stored_opt, verify=False)
        else:
            checkpoint.load(good, stored_model, stored_opt)
        stored = C.local_bytes(stored_model, stored_opt)
        target, target_opt = _target(placement_fn=placement)
        before = C.local_bytes(target, target_opt)
        error: Exception | None = None
        try:
            if patch is None:
                checkpoint.load(case, target, target_opt, mode=mode)
            else:
                with patch():
                    checkpoint.load(case, target, target_opt, mode=mode)
        except checkpoint.CheckpointError as e:
            error = e
        now = C.local_bytes(target, target_opt)
        assert error is not None, f"{name}: loaded"
        assert "fix" in str(error), str(error)
        loaded = "the optimizer's state dict was loaded on this rank" in str(error)  # staged: it did not wait
        assert now["param_groups"] == (stored if loaded else before)["param_groups"], f"{name}: hyperparameters"
        assert not loaded or mode is STAGED, f"{name}: an in-place load loaded the optimizer before the digests passed"
        if not partial:
            assert not isinstance(error, PartialLoadError), f"{name}: {error}"
            assert now == before, f"{name}: a load that failed before writing changed the state"
            results[name] = {"message": str(error), "partial": False}
            continue
        assert isinstance(error, PartialLoadError), f"{name}: {type(error).__name__}: {error}"
        assert error.rank == rank
        listed = [*error.whole, *error.partly, *error.untouched]
        # In place, every model and optimizer tensor is written where it is; staged, CPU optimizer state is not
        # written but replaced by views of the file's image, when (if) the optimizer is loaded.
        planned = [k for k in now if k != "param_groups" and (mode is IN_PLACE or "/" not in k)]
        assert sorted(listed) == sorted(planned), (name, listed)
        for k in now:
            if k not in planned and k != "param_groups":
                assert now[k] == (stored if loaded else before)[k], f"{name}: {k}"
        for k in error.untouched:
            assert now[k] == before[k], f"{name}: {k} reported untouched but changed"
        for k in error.whole:
            assert now[k] == stored[k], f"{name}: {k} reported overwritten but differs from the stored bytes"
        items = _items(target, target_opt)
        for k in error.partly:  # some elements overwritten (a read that failed may have written some), the rest not
            elements = list(zip(*(_elements(x[k], items[k]) for x in (now, before, stored))))
            assert all(n in (b, s) for n, b, s in elements), f"{name}: {k}: an element is neither before nor stored"
            assert any(n == b != s for n, b, s in elements), f"{name}: {k} reported partly overwritten, is whole"
        results[name] = {"message": str(error), "partial": True, "whole": list(error.whole),
                         "partly": list(error.partly), "untouched": list(error.untouched),
                         "unverified": list(error.unverified)}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(case)
    # The pool of buffers and the good checkpoint still load, both ways.
    target, target_opt = _target()
    C.load_both(good, target, target_opt)
    return results


def _names(per_rank: dict[str, Any]) -> list[str]:
    return per_rank["whole"] + per_rank["partly"] + per_rank["untouched"]


def test_bad_content_in_place_says_what_it_overwrote(tmp_path: Path) -> None:
    names = list(CASES)
    per_rank = _partial_loads(str(tmp_path), names)
    for name in names:
        r0, r1 = per_rank[0][name], per_rank[1][name]
        first0, first1 = r0["message"].split("\n")[0], r1["message"].split("\n")[0]
        assert first0 == first1, (name, first0, first1)  # the common verdict
        if not r0["partial"]:
            assert "case-" in r0["message"], r0["message"]
            continue
        for r, out in enumerate((r0, r1)):
            assert f"on rank {r} this load had written into" in out["message"], out["message"]
    # Which tensors each case left where (the checks above made sure the lists are true):
    flip1 = per_rank[1]["flipped byte in rank 1's model file"]
    assert M1 in flip1["message"] and "content digest" in flip1["message"], flip1["message"]
    # Its model file streamed whole, then failed: those tensors hold unverified bytes; what comes from rank 0's
    # files with pread (plain tensors written by one rank) and its optimizer file were not read.
    assert flip1["unverified"] and set(flip1["unverified"]) <= set(flip1["whole"]), flip1
    assert all("/" not in n for n in flip1["unverified"]), flip1
    assert {n for n in _names(flip1) if "/" in n} <= set(flip1["untouched"]), flip1
    # Rank 0 read everything: its own files verified; the plain tensors another rank writes (AdamW's step) come
    # from rank 1's files, whose digests rank 1 checks: not verified on rank 0.
    flip0 = per_rank[0]["flipped byte in rank 1's model file"]
    assert not flip0["untouched"] and "tok.weight" not in flip0["unverified"], flip0
    assert all(_single(n) for n in flip0["unverified"]), flip0
    opt0 = per_rank[0]["flipped byte in rank 0's optimizer file"]
    assert "tok.weight/exp_avg" in opt0["unverified"] and all(_single(n) for n in opt0["untouched"]), opt0
    assert all("/" in n or _single(n) for n in opt0["unverified"]), opt0
    cut = per_rank[0]["file cut in half while loading"]
    assert "file ended at byte" in cut["message"] and len(cut["partly"]) == 1, cut
    assert cut["whole"] and cut["untouched"], cut
    staged = per_rank[1]["staged: the other rank's file cut while copying"]
    assert "file ended at byte" in staged["message"] and staged["untouched"], staged
    assert not staged["unverified"], staged  # staged: every digest had passed before anything was written
    print("\n" + per_rank[1]["flipped byte in rank 1's model file"]["message"])


def test_mode_argument() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="is not a LoadMode"):
        checkpoint.load("/nonexistent", model, mode="fast")
    assert reader._mode("in_place") is IN_PLACE and reader._mode(STAGED) is STAGED


# ---------------------------------------------------------------------------------------------------------
# Staged: a failed load changes nothing, also when the optimizer's state is a view of a pooled image
# ---------------------------------------------------------------------------------------------------------

BAD_STAGED: dict[str, Any] = {  # name -> damage to a copy of checkpoint A
    "flipped data byte in rank 0's optimizer file": lambda d: _flip(os.path.join(d, O0),
                                                                    _data_middle(os.path.join(d, O0))),
    "flipped data byte in rank 1's model file": lambda d: _flip(os.path.join(d, M1), _data_middle(os.path.join(d, M1))),
    "truncated optimizer file": lambda d: os.truncate(os.path.join(d, O0), os.path.getsize(os.path.join(d, O0)) - 9),
    "missing model file": lambda d: os.remove(os.path.join(d, M1)),
}


def _in_lent_images(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors whose bytes lie in a buffer the pool has lent (a file image's views)."""
    spans = []
    for buf, _ in direct.POOL._lent:
        c = ctypes.c_char.from_buffer(buf)
        spans.append((ctypes.addressof(c), ctypes.addressof(c) + len(buf)))
        del c
    locals_ = [v.to_local() if isinstance(v, DTensor) else v for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor)]
    return [t for t in locals_ if any(lo <= t.data_ptr() < hi for lo, hi in spans)]


@distributed(world_size=2, timeout=300)
def _staged_failures(tmp: str) -> dict[str, Any]:
    """Staged loads of two checkpoints (A, B) in turn, each followed by a damaged copy of A: after each good load
    the CPU optimizer state is a view of a pooled file image, which the next load's images must not reuse; the
    damaged load must fail on both ranks before writing and leave every byte as the good load left it."""
    rank = dist.get_rank()
    a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
    model = C.shard(C.make_gpt(seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    C.train(model, opt, 0, 2)
    checkpoint.save(a, model, opt, extra={"step": 2})
    truth = {a: C.local_bytes(model, opt)}
    C.train(model, opt, 2, 1)
    opt.param_groups[0]["lr"] = 3e-3
    checkpoint.save(b, model, opt, extra={"step": 3})
    truth[b] = C.local_bytes(model, opt)
    assert all(truth[a][k] != truth[b][k] for k in truth[a] if k != "calib" and not _single(k)), "A and B must differ"
    for i, damage in enumerate(BAD_STAGED.values()):
        if rank == 0:
            shutil.copytree(a, os.path.join(tmp, f"bad-{i}"))
            damage(os.path.join(tmp, f"bad-{i}"))
    dist.barrier()
    target, target_opt = _target()
    direct.POOL.clear()
    seen: dict[str, list[str]] = {}
    views = 0
    for good in (a, b, a, b):
        assert checkpoint.load(good, target, target_opt)["step"] == (2 if good == a else 3)
        assert C.local_bytes(target, target_opt) == truth[good], good
        views += len(_in_lent_images(target_opt))
        for i, name in enumerate(BAD_STAGED):
            error = None
            try:
                checkpoint.load(os.path.join(tmp, f"bad-{i}"), target, target_opt)
            except checkpoint.CheckpointError as e:
                error = e
            assert error is not None and not isinstance(error, PartialLoadError), f"{name}: {error!r}"
            seen.setdefault(name, []).append(str(error).split("\n")[0])
            got = C.local_bytes(target, target_opt)
            assert got == truth[good], f"{name} after {good}: changed {[k for k in got if got[k] != truth[good][k]]}"
    assert views, "the optimizer's state never was a view of a file image: this test tests nothing"
    C.train(target, target_opt, 3, 1)  # and it trains on
    return seen


def test_staged_failures_change_nothing(tmp_path: Path) -> None:
    per_rank = _staged_failures(str(tmp_path))
    for name, messages in per_rank[0].items():
        assert messages == per_rank[1][name], (name, messages, per_rank[1][name])
        assert all(f"bad-{list(BAD_STAGED).index(name)}" in m for m in messages), messages


# ---------------------------------------------------------------------------------------------------------
# In place, a rank that stalls or dies mid-load: every rank that is alive says what it overwrote, in bounded time
# ---------------------------------------------------------------------------------------------------------

TIMEOUT = 2.0
STALL = 3 * TIMEOUT  # rank 1's stall in the middle of its model file: longer than rank 0 waits for its report
CTX = mp.get_context("fork")


def _stalling_rank(rank: int, port: int, tmp: str, how: str, conn: Any, done: Any) -> None:
    """One rank of a fresh 2-rank job: save, then load in place, rank 1 stalling (or dying) after its model file's
    first 16 KiB block was copied into the model; reports (error text, lists, seconds, bytes check)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    good = os.path.join(tmp, "good")
    model = C.shard(C.make_gpt(seed=0, n_blocks=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    C.train(model, opt, 0, 1)
    checkpoint.save(good, model, opt)
    stored = C.local_bytes(model, opt)
    target = C.shard(C.make_gpt(seed=5, n_blocks=1))
    target_opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    C.train(target, target_opt, 3, 1)
    before = C.local_bytes(target, target_opt)
    real_read, real_write = direct.read_block, reader.Loader.write
    writing = [False]

    def write(self: reader.Loader, reads: list[Any]) -> None:
        writing[0] = True
        real_write(self, reads)

    def read_block(fd: int, buf: memoryview, start: int, end: int, *a: Any) -> bool:
        if writing[0] and rank == 1 and start == 16 << 10 and os.readlink(f"/proc/self/fd/{fd}").endswith(M1):
            time.sleep(0.3)  # the first block is copied meanwhile
            if how == "dies":
                os._exit(3)
            time.sleep(STALL)
        return bool(real_read(fd, buf, start, end, *a))

    dist.barrier()
    start = time.monotonic()
    error: Exception | None = None
    with mock.patch.object(reader.Loader, "write", write), mock.patch.object(direct, "read_block", read_block), \
            mock.patch.object(direct, "BLOCK_BYTES", 16 << 10):
        try:
            checkpoint.load(good, target, target_opt, mode=IN_PLACE, timeout=TIMEOUT)
        except Exception as e:
            error = e
            trace = traceback.format_exc()
    elapsed = time.monotonic() - start
    now = C.local_bytes(target, target_opt)
    out: dict[str, Any] = {"elapsed": elapsed, "type": type(error).__name__, "message": str(error),
                           "trace": trace if error is not None else ""}
    if isinstance(error, PartialLoadError):
        out.update(whole=list(error.whole), partly=list(error.partly), untouched=list(error.untouched),
                   unverified=list(error.unverified))
        out["wrong"] = ([k for k in error.whole if now[k] != stored[k]] + [k for k in error.untouched
                                                                           if now[k] != before[k]])
        out["optimizer as before"] = now["param_groups"] == before["param_groups"]
    conn.send(out)
    done.wait(STALL + 4 * TIMEOUT + 10)  # rank 0 stays up until rank 1 has reported (or died)
    os._exit(0)


@pytest.mark.parametrize("how", ["stalls", "dies"])
def test_a_rank_that_stalls_or_dies_mid_load_in_place(tmp_path: Path, how: str) -> None:
    port = _free_port()
    done = CTX.Event()
    pipes, procs = [], []
    for rank in range(2):
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_stalling_rank, args=(rank, port, str(tmp_path), how, child, done))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        assert pipes[0].poll(120), "rank 0 hung"
        r0 = pipes[0].recv()
        r1 = pipes[1].recv() if how == "stalls" and pipes[1].poll(STALL + 4 * TIMEOUT + 30) else None
    finally:
        done.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
            proc.join()
    print(f"\n{how}: rank 0 after {r0['elapsed']:.1f} s: {r0['message'].splitlines()[0][:160]}"
          + (f"\nrank 1 after {r1['elapsed']:.1f} s: {r1['message'].splitlines()[0][:160]}" if r1 else ""))
    # Rank 0 wrote everything it loads, verified its files, then waited at most the timeout for rank 1's report.
    assert r0["type"] == "PartialLoadError", r0
    assert r0["elapsed"] < TIMEOUT + 10, r0["elapsed"]
    assert "rank(s) 1 did not arrive within the timeout" in r0["message"] or "rank 1 did not" in r0["message"], r0
    assert "on rank 0 this load had written into" in r0["message"] and "fix" in r0["message"], r0["message"]
    assert r0["whole"] and not r0["partly"] and not r0["untouched"] and not r0["wrong"], r0
    assert all(_single(n) for n in r0["unverified"]), r0  # only what came from rank 1's files, which rank 1 hashes
    assert r0["optimizer as before"], "the optimizer's state dict was loaded before every rank's digests passed"
    assert procs[1].exitcode == (0 if how == "stalls" else 3), procs[1].exitcode
    if how == "dies":
        return
    # Rank 1 finished its reads after the stall and found rank 0 gone from the phase: its own report, bounded.
    assert r1 is not None, "rank 1 did not report"
    assert r1["type"] == "PartialLoadError", r1["trace"]
    assert r1["elapsed"] < STALL + 2 * TIMEOUT + 10, r1["elapsed"]
    assert "rank 0 did not" in r1["message"] and "on rank 1 this load had written into" in r1["message"], r1
    assert r1["whole"] and not r1["wrong"] and r1["optimizer as before"], r1
