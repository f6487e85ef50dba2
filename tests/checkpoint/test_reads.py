"""DataFile.read_box: which preads a block costs, and that every block reads back bitwise.

A block of whole rows is one pread; a strided block (Shard(1) columns, TP) is one pread of the range
enclosing its rows when the gaps are at most the wanted bytes, else one pread per row; a range longer
than the span limit is cut into slabs of rows, one pread each.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_shard.checkpoint import boxes, safetensors_io
from fully_shard.checkpoint.boxes import Box
from fully_shard.checkpoint.safetensors_io import DataFile


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
