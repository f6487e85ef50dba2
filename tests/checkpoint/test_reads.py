"""What reading a checkpoint costs in preads and bytes, and that every read comes back bitwise.

DataFile.read_box: a block of whole rows is one pread; a strided block (Shard(1) columns, TP) is one
pread of the range enclosing its rows when the gaps are at most the wanted bytes, else one pread per
row; a range longer than the span limit is cut into slabs of rows, one pread each. FileImage (a file
of checkpoint.load's digest share read whole): bytes, digest, views, direct I/O and its fallback; and
a load at the saving world size reads each byte of its files exactly once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_shard import checkpoint
from fully_shard.checkpoint import boxes, direct, image, safetensors_io, stream
from fully_shard.checkpoint import direct as direct_io
from fully_shard.checkpoint.boxes import Box
from fully_shard.checkpoint.ledger import Ledger, Read
from fully_shard.checkpoint.safetensors_io import DataFile
from tests.checkpoint import common as C
from tests.distributed.harness import distributed


@contextmanager
def _opened(tmp: Path, tensors: dict[str, torch.Tensor]) -> Iterator[DataFile]:
    safetensors_io.save_file(tensors, str(tmp / "f.safetensors"), {})
    dir_fd = os.open(tmp, os.O_RDONLY)
    f = DataFile(dir_fd, "f.safetensors", str(tmp / "f.safetensors"), None)
    try:
        yield f
    finally:
        f.close()
        os.close(dir_fd)


def _read(f: DataFile, key: str, part: Box, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """The block read back, and the length in bytes of every pread it took."""
    sizes: list[int] = []
    real = DataFile.read_into

    def counted(self: DataFile, buf: memoryview, offset: int) -> None:
        sizes.append(len(buf))
        real(self, buf, offset)

    out = torch.empty(part.sizes, dtype=dtype)
    with mock.patch.object(DataFile, "read_into", counted):
        f.read_box(key, part, out)
    return out, sizes


def test_pread_counts(tmp_path: Path) -> None:
    w = torch.arange(8 * 10, dtype=torch.float32).reshape(8, 10)
    cube = torch.arange(4 * 6 * 5, dtype=torch.int16).reshape(4, 6, 5)
    with _opened(tmp_path, {"w": w, "cube": cube}) as f:
        f.header()
        cases = [  # (key, box, bytes of each pread)
            ("w", Box((2, 0), (3, 10)), [3 * 10 * 4]),  # whole rows: one contiguous run
            ("w", Box((0, 5), (8, 5)), [(7 * 10 + 5) * 4]),  # Shard(1) of 2: gaps 35 <= 40 wanted: the range once
            ("w", Box((1, 3), (6, 4)), [4 * 4] * 6),  # 6 runs of 4, gaps 5 x 6 = 30 > 24 wanted: per run
            ("w", Box((0, 0), (8, 2)), [2 * 4] * 8),  # 2 of 10 columns: per run
            ("w", Box((3, 4), (1, 6)), [6 * 4]),  # one row: one run
            ("cube", Box((1, 0, 2), (2, 6, 3)), [((1 * 6 + 5) * 5 + 3) * 2]),  # 12 runs of 3: gaps 22 <= 36
            ("cube", Box((0, 2, 0), (4, 3, 5)), [(3 * 30 + 15) * 2]),  # 4 runs of 15: gaps 45 <= 60
        ]
        for key, part, want in cases:
            source = {"w": w, "cube": cube}[key]
            got, sizes = _read(f, key, part, source.dtype)
            assert sizes == want, (key, part, sizes, want)
            assert torch.equal(got, source[part.slices()]), (key, part)


def test_span_reads_are_cut_into_slabs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(64, 16)
    monkeypatch.setattr(safetensors_io, "_SPAN_BYTES", 2 * 10 * 12 * 4)  # 10 rows of 12 (ranges <= 2x data)
    with _opened(tmp_path, {"w": w}) as f:
        f.header()
        got, sizes = _read(f, "w", Box((3, 4), (40, 12)), torch.float32)
        assert torch.equal(got, w[3:43, 4:16])
        assert sizes == [(9 * 16 + 12) * 4] * 4, sizes  # 4 slabs of 10 rows, each its enclosing range
        assert max(sizes) <= safetensors_io._SPAN_BYTES


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3), st.data())
def test_any_block_reads_back_bitwise(tmp_path_factory: pytest.TempPathFactory, shape: list[int],
                                      data: st.DataObject) -> None:
    t = torch.randn(shape).to(torch.bfloat16)
    offsets = [data.draw(st.integers(0, s - 1)) for s in shape]
    sizes = [data.draw(st.integers(1, s - o)) for s, o in zip(shape, offsets)]
    part = Box(tuple(offsets), tuple(sizes))
    with _opened(tmp_path_factory.mktemp("r"), {"t": t}) as f:
        f.header()
        got, reads = _read(f, "t", part, torch.bfloat16)
        run, starts = boxes.runs(shape, part)
        assert len(reads) == (1 if boxes.span_read(run, starts) else len(starts))
        assert sum(reads) <= 2 * part.numel * 2
        assert torch.equal(got.view(torch.int16), t[part.slices()].view(torch.int16))


# ---------------------------------------------------------------------------------------------------------
# FileImage: a data file read whole once (checkpoint.load's digest share)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("direct", [True, False])
def test_file_image_bytes_digest_views_and_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   direct: bool) -> None:
    monkeypatch.setattr(direct_io, "BLOCK_BYTES", 3 * 4096)  # many blocks in flight, a short last one
    if not direct:
        monkeypatch.setattr(direct_io, "set_direct", lambda fd, on: False)
    tensors = {"a": torch.randn(1000, 7), "b": torch.arange(12345, dtype=torch.int16), "c": torch.randn(3)}
    with _opened(tmp_path, tensors) as f:
        f.header()
        raw = (tmp_path / "f.safetensors").read_bytes()
        img = image.FileImage(f, digest=True)
        assert img.digest == xxhash.xxh3_128(raw).hexdigest() == f.digest()
        assert img.map is not None and bytes(img.map[:len(raw)]) == raw
        kept = img.keep("c")
        for key, t in tensors.items():
            assert torch.equal(img.tensor(key), t), key
        img.release()
        assert torch.equal(kept, tensors["c"])  # a kept view outlives the release
        kept.add_(1)  # and is ordinary writable memory (an optimizer steps it in place)
        assert torch.equal(kept, tensors["c"] + 1)


def test_file_image_finishes_buffered_after_a_refused_direct_read(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.preadv

    def refuse_aligned(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(22, "Invalid argument")  # EINVAL: the file system does not take direct I/O
        return real(fd, buffers, offset)

    tensors = {"a": torch.randn(5000)}
    with _opened(tmp_path, tensors) as f:
        f.header()
        monkeypatch.setattr(direct_io.os, "preadv", refuse_aligned)
        img = image.FileImage(f, digest=True, threads=1)
        assert img.digest == f.digest()
        assert torch.equal(img.tensor("a"), tensors["a"])
        assert calls[:2] == [0, 0]  # the same block again, buffered


def test_pooled_image_reuses_its_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image's buffer goes back to the pool when no tensor of it is left (at once, or when kept views die),
    and the next image of its size reads into the same mapping; settle() unmaps what the last load did not use."""
    pool = direct_io.BufferPool()
    monkeypatch.setattr(image, "POOL", pool)
    monkeypatch.setattr(direct_io, "BLOCK_BYTES", 2 * 4096)
    first = {"a": torch.randn(3000)}
    second = {"a": torch.randn(3000) + 5}  # same size, other bytes
    other = tmp_path / "other"
    other.mkdir()
    with _opened(tmp_path, first) as f, _opened(other, second) as g:
        f.header()
        g.header()
        img = image.FileImage(f, digest=True)
        assert img.digest == f.digest() and torch.equal(img.tensor("a"), first["a"])
        mapping = img.map
        img.release()
        assert pool.nbytes == len(mapping)  # type: ignore[arg-type]  # no tensor left: back at once
        img = image.FileImage(g, digest=True)
        assert img.map is mapping  # the same memory, already mapped
        assert img.digest == g.digest() and torch.equal(img.tensor("a"), second["a"])
        kept = img.keep("a")  # optimizer state that is a view of the image
        img.release()
        assert pool.nbytes == 0  # lent while the view lives
        with pytest.raises(BufferError):
            mapping.close()  # type: ignore[union-attr]  # and never unmapped under it
        assert torch.equal(kept, second["a"])
        pool.settle()
        assert torch.equal(kept, second["a"]) and pool.nbytes == 0
        fresh = image.FileImage(f, digest=True)  # needs another buffer meanwhile
        assert fresh.map is not mapping
        fresh.release()
        del kept  # the optimizer dropped that state
        assert pool.nbytes == 2 * len(mapping)  # type: ignore[arg-type]
    pool.settle()  # both came back or were used since the last settle: kept
    assert pool.nbytes == 2 * len(mapping)  # type: ignore[arg-type]
    pool.settle()  # not used since: unmapped
    assert pool.nbytes == 0


def test_flat_boxes_tile_a_flat_range() -> None:
    for shape in [(), (5,), (3, 4), (2, 3, 4), (1, 1, 3), (4, 1, 2, 3)]:
        n = math.prod(shape)
        t = torch.arange(n).reshape(shape)
        for a in range(n + 1):
            for b in range(a, n + 1):
                parts = boxes.flat_boxes(shape, a, b)
                got = torch.cat([t[p.slices()].reshape(-1) for p in parts]) if parts else torch.empty(0)
                assert torch.equal(got, torch.arange(a, b)), (shape, a, b, parts)
                assert len(parts) <= max(1, 2 * len(shape) - 1), (shape, a, b, parts)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=0, max_size=3), st.sampled_from([torch.float32, torch.bfloat16,
                                                                               torch.int64, torch.uint8]),
       st.integers(1, 3), st.data())
def test_stream_copies_any_boxes_as_blocks_arrive(tmp_path_factory: pytest.TempPathFactory, shape: list[int],
                                                  dtype: torch.dtype, block_pages: int, data: st.DataObject) -> None:
    """Every read's box, from a file streamed through tiny blocks (boxes cut by block edges anywhere), equals
    read_box's; the digest is the file's; the ledger counts every element; the ring goes back to the pool."""
    first = torch.arange(math.prod(shape) * 3 + 5).to(dtype)[:3 + block_pages]  # another tensor before it
    t = (torch.randn(shape) * 100).to(dtype) if shape else torch.tensor(7).to(dtype)
    big = torch.randn(700, 13)  # several blocks
    tensors = {"first": first, "big": big, "t": t}
    reads, want = [], []
    for key, source in (("t", t), ("big", big), ("t", t)):
        sizes = tuple(source.shape)
        offsets = tuple(data.draw(st.integers(0, s - 1)) for s in sizes)
        lengths = tuple(data.draw(st.integers(1, s - o)) for s, o in zip(sizes, offsets))
        part = Box(offsets, lengths)
        dst = torch.zeros(lengths, dtype=source.dtype)
        if data.draw(st.booleans()) and lengths:  # a strided destination (a view of a bigger tensor)
            dst = torch.zeros((*lengths[:-1], lengths[-1] + 2), dtype=source.dtype)[..., 1:-1]
        reads.append(Read("f.safetensors", key, part, dst, name=f"{key}{len(reads)}"))
        want.append(source[part.slices()])
    pool = direct_io.BufferPool()
    with mock.patch.object(direct_io, "BLOCK_BYTES", block_pages * 4096), \
            mock.patch.object(stream, "POOL", pool), _opened(tmp_path_factory.mktemp("s"), tensors) as f:
        f.header()
        assert all(stream.streamable(f, r) for r in reads)
        ledger = Ledger()
        ledger.expect(reads)
        digest = stream.stream(f, reads, ledger, digest=True)
        assert digest == f.digest()
        for r, w in zip(reads, want):
            assert torch.equal(r.dst, w), (r.key, r.src)
            back = torch.empty(r.src.sizes, dtype=w.dtype)
            f.read_box(r.key, r.src, back)
            assert torch.equal(back, w)
        assert ledger.done == ledger.need  # every element counted once
        written = ledger.written(lambda name: True)
        assert set(written.whole) == set(ledger.need) and not written.partly and not written.untouched
        block = block_pages * 4096
        ring = min(direct_io.DEPTH + 1, -(-f.size // block)) * direct_io.round_up(min(block, f.size), 4096)
    assert pool.nbytes == ring  # the ring (no more blocks than the file has), back in the pool


@distributed(world_size=2)
def _loads_read_once(tmp: str, mode: str) -> dict[str, Any]:
    """Bytes read per data file by checkpoint.load at the saving world size, digests on."""
    model = C.shard(C.make_gpt(seed=0, n_blocks=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    C.train(model, opt, 0, 1)
    checkpoint.save(os.path.join(tmp, "ck"), model, opt)
    want_model, want_optim = C.full_state(model), C.full_optim(model, opt)
    fresh = C.shard(C.make_gpt(seed=1, n_blocks=2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    C.train(fresh, fresh_opt, 5, 1)
    seen: dict[str, int] = {}
    real = os.preadv

    def counted(fd: int, buffers: list[memoryview], offset: int) -> int:
        got = real(fd, buffers, offset)
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        seen[name] = seen.get(name, 0) + got
        return got

    with mock.patch.object(os, "preadv", counted):
        checkpoint.load(os.path.join(tmp, "ck"), fresh, fresh_opt, mode=checkpoint.LoadMode(mode))
    C.assert_same(C.full_state(fresh), want_model, "model")
    C.assert_same(C.full_optim(fresh, fresh_opt), want_optim, "optimizer")
    C.train(fresh, fresh_opt, 1, 1)  # the loaded state (views of the file images) trains
    sizes = {n: os.path.getsize(os.path.join(tmp, "ck", n)) for n in seen if n.endswith(".safetensors")}
    return {"seen": seen, "sizes": sizes}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names descriptors through /proc (Linux)")
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_load_reads_each_byte_of_its_files_once(tmp_path: Path, mode: str) -> None:
    """Its own files (its digest share): the header once (parsed before anything else), then every byte once
    (staged: the image; in place: the stream); before, the digest pass read the file and the tensors were
    read again."""
    for rank, out in enumerate(_loads_read_once(str(tmp_path), mode)):
        own = {n: b for n, b in out["seen"].items() if n.endswith(f"-rank{rank:05d}.safetensors")}
        assert len(own) == 2, (rank, out)  # model and optimizer
        for name, got in own.items():
            with open(tmp_path / "ck" / name, "rb") as f:
                head = 8 + int.from_bytes(f.read(8), "little")
            assert got == head + out["sizes"][name], (rank, name, got, head, out["sizes"][name])


# ---------------------------------------------------------------------------------------------------------
# direct.read_range: load_hf's contiguous pieces, read past the page cache
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("refuse", [False, True])
def test_direct_read_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse: bool) -> None:
    data = os.urandom(3 * direct.ALIGN + 123)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    dfd = direct.open_direct(fd)
    try:
        if refuse:  # a file system without direct I/O: every direct read fails with EINVAL
            real = os.preadv

            def preadv(f: int, bufs: list[memoryview], offset: int) -> int:
                if f == dfd:
                    raise OSError(22, "Invalid argument")
                return real(f, bufs, offset)
            monkeypatch.setattr(direct.os, "preadv", preadv)
        arena = direct.AlignedArena()
        for begin, end in [(0, 10), (5, direct.ALIGN + 7), (direct.ALIGN, 2 * direct.ALIGN), (100, len(data)),
                           (len(data) - 3, len(data))]:
            buf, at = direct.read_range(fd, dfd, begin, end, arena)
            assert bytes(buf[at:at + end - begin]) == data[begin:end], (begin, end)
            got = direct.as_tensor(buf, at, end - begin, torch.uint8, (end - begin,))
            assert bytes(got.numpy()) == data[begin:end]
        with pytest.raises(EOFError, match="bytes short"):
            direct.read_range(fd, dfd, len(data) - 3, len(data) + 5, arena)
    finally:
        if dfd is not None:
            os.close(dfd)
        os.close(fd)
