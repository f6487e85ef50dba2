"""A data file's image in memory: read whole once (direct I/O, blocks in parallel), hashed as it arrives, read as views.

``checkpoint.load`` in its staged mode reads each file of its digest share (design/checkpoint-format.md
section 7) this way instead of hashing it through a small buffer and reading its tensors again with
``pread``: the bytes cross from the disk once, into one page-aligned buffer (``O_DIRECT`` where the
file system allows it, so the page cache is neither filled nor copied from; buffered reads
otherwise), the digest is taken from that buffer while later blocks are still being read (direct.
read_whole), optimizer state and ``extra`` tensors that are whole chunks may become views of the
buffer (no second copy), and the model's blocks are copied out of it once every check has passed.

An image lives in a buffer of the pool (direct.POOL): memory an earlier load already faulted in, where
there is one. On ``release`` every page that no kept view uses is returned to the system, and the
buffer goes back to the pool once no tensor of the image is left: at once for an image the model's
blocks were copied out of, when the optimizer drops that state for an image its state is a view of.
"""

from __future__ import annotations

import mmap

import torch

from .codec import ST_TO_TORCH
from .direct import POOL, as_tensor, read_whole, round_up
from .safetensors_io import DataFile

_PAGE = mmap.PAGESIZE


class FileImage:
    """All bytes of one opened data file in a page-aligned buffer of the pool, and their digest."""

    def __init__(self, f: DataFile, *, digest: bool, threads: int = 4) -> None:
        self.file = f
        self.size = f.size
        self.map: mmap.mmap | None = POOL.take(self.size)
        self.view: memoryview | None = memoryview(self.map)  # every tensor of the image is made from it
        self.kept: list[tuple[int, int]] = []  # byte ranges that views handed out still use
        try:
            self.digest = read_whole(f.fd, self.size, slot=lambda start: self.view[start:],  # type: ignore[index]
                                     digest=digest, depth=threads, short=f.bad)
        except BaseException:
            self.release()
            raise

    def tensor(self, key: str) -> torch.Tensor:
        """Stored tensor ``key`` as a view of the image (its own storage, sharing the image's memory)."""
        assert self.view is not None
        dtype, shape, begin, end = self.file.header().tensors[key]
        return as_tensor(self.view, begin, end - begin, ST_TO_TORCH[dtype], shape)

    def keep(self, key: str) -> torch.Tensor:
        """``tensor(key)``, to outlive the load: its pages are not released."""
        _, _, begin, end = self.file.header().tensors[key]
        self.kept.append((begin, end))
        return self.tensor(key)

    def release(self) -> None:
        """Give back every page that no kept view touches; the buffer returns to the pool once no tensor of the
        image is left (at once when none was kept)."""
        if self.map is None or self.view is None:
            return
        if self.kept:
            pos = 0
            for begin, end in sorted(self.kept) + [(len(self.map), len(self.map))]:
                lo, hi = round_up(pos, _PAGE), begin // _PAGE * _PAGE
                if hi > lo:
                    self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                pos = max(pos, end)
        POOL.lend(self.map, self.view)
        self.map = self.view = None
