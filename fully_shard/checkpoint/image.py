"""A data file's image in memory: read whole once (direct I/O, blocks in parallel), hashed as it arrives, read as views.

``checkpoint.load`` in its staged mode reads each file of its digest share (design/checkpoint-format.md
section 7) this way instead of hashing it through a small buffer and reading its tensors again with
``pread``: the bytes cross from the disk once, into one page-aligned buffer (``O_DIRECT`` where the
file system allows it, so the page cache is neither filled nor copied from; buffered reads
otherwise), the digest is taken from that buffer while later blocks are still being read (direct.
read_whole), optimizer state and ``extra`` tensors that are whole chunks may become views of the
buffer (no second copy), and the model's blocks are copied out of it once every check has passed.

An image that hands out no view (``pooled=True``) lives in the buffer pool's memory (direct.POOL),
which the previous load already faulted in, and goes back to the pool on ``release``; one that hands
out views is fresh memory, of which ``release`` returns every page no view uses to the system.
"""

from __future__ import annotations

import mmap

import torch

from .codec import ST_TO_TORCH
from .direct import POOL, aligned, as_tensor, read_whole, round_up
from .safetensors_io import DataFile

_PAGE = mmap.PAGESIZE


class FileImage:
    """All bytes of one opened data file in a page-aligned anonymous mapping, and their digest."""

    def __init__(self, f: DataFile, *, digest: bool, pooled: bool = False, threads: int = 4) -> None:
        self.file = f
        self.size = f.size
        self.pooled = pooled
        self.map: mmap.mmap | None = POOL.take(self.size) if pooled else aligned(self.size)
        self.kept: list[tuple[int, int]] = []  # byte ranges that views handed out still use
        view = memoryview(self.map)
        try:
            self.digest = read_whole(f.fd, self.size, slot=lambda start: view[start:], digest=digest,
                                     depth=threads, short=f.bad)
        except BaseException:
            view.release()
            self.release()
            raise
        view.release()

    def tensor(self, key: str) -> torch.Tensor:
        """Stored tensor ``key`` as a view of the image (its own storage, sharing the image's memory)."""
        assert self.map is not None
        dtype, shape, begin, end = self.file.header().tensors[key]
        return as_tensor(self.map, begin, end - begin, ST_TO_TORCH[dtype], shape)

    def keep(self, key: str) -> torch.Tensor:
        """``tensor(key)``, to outlive the load: its pages are not released (never from a pooled image)."""
        assert not self.pooled, "a pooled image goes back to the pool: it hands out no view to keep"
        _, _, begin, end = self.file.header().tensors[key]
        self.kept.append((begin, end))
        return self.tensor(key)

    def release(self) -> None:
        """A pooled image goes back to the pool (no view of it may be used after this); otherwise every
        page that no kept view touches is given back, and the mapping goes with its last view."""
        if self.map is None:
            return
        if self.pooled:
            POOL.give(self.map)
            self.map = None
            return
        pos = 0
        for begin, end in sorted(self.kept) + [(len(self.map), len(self.map))]:
            lo, hi = round_up(pos, _PAGE), begin // _PAGE * _PAGE
            if hi > lo:
                self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            pos = max(pos, end)
        self.map = None
