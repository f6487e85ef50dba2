"""A data file's image in memory: read whole once (direct I/O, blocks in parallel), hashed as it arrives, read as views.

``checkpoint.load`` reads each file of its digest share (design/checkpoint-format.md section 7) this
way instead of hashing it through a small buffer and reading its tensors again with ``pread``: the
bytes cross from the disk once, into one page-aligned buffer (``O_DIRECT`` where the file system
allows it, so the page cache is neither filled nor copied from; buffered reads otherwise), the digest
is taken from that buffer while later blocks are still being read, optimizer state and ``extra``
tensors that are whole chunks become views of the buffer (no second copy, no fresh memory to fault
in) and the model's blocks are copied out of it once every check has passed. ``release`` then returns
every page no view uses to the system.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from .codec import ST_TO_TORCH
from .direct import ALIGN as _ALIGN
from .direct import aligned, as_tensor
from .direct import round_up as _round_up
from .safetensors_io import DataFile

BLOCK_BYTES = 8 << 20  # one read of the image; the reads of several blocks are in flight at once
_PAGE = mmap.PAGESIZE


def _set_direct(fd: int, on: bool) -> bool:
    """Switch O_DIRECT on ``fd`` (Linux allows it on an open descriptor); False where it cannot be."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct if on else flags & ~direct)
    except OSError:
        return False
    return True


class FileImage:
    """All bytes of one opened data file in an anonymous page-aligned mapping, and their digest."""

    def __init__(self, f: DataFile, *, digest: bool, threads: int = 4) -> None:
        self.file = f
        self.size = f.size
        self.map: mmap.mmap | None = aligned(self.size)
        self.kept: list[tuple[int, int]] = []  # byte ranges that views handed out still use
        self.digest = self._read(digest, threads)

    def _read(self, digest: bool, threads: int) -> str | None:
        assert self.map is not None
        view = memoryview(self.map)
        starts = range(0, self.size, BLOCK_BYTES)
        direct = _set_direct(self.file.fd, True)
        try:
            h = xxhash.xxh3_128() if digest else None
            with ThreadPoolExecutor(max_workers=max(1, min(threads, len(starts))),
                                    thread_name_prefix="checkpoint-read") as pool:
                futures = [pool.submit(self._read_block, view, start, direct) for start in starts]
                for start, future in zip(starts, futures):
                    future.result()
                    if h is not None:
                        h.update(view[start:min(start + BLOCK_BYTES, self.size)])
            return h.hexdigest() if h is not None else None
        finally:
            view.release()
            if direct:
                _set_direct(self.file.fd, False)

    def _read_block(self, view: memoryview, start: int, direct: bool) -> None:
        """Bytes [start, start + BLOCK_BYTES) of the file (fewer at its end) into the same place of ``view``."""
        end = min(start + BLOCK_BYTES, self.size)
        done = start
        while done < end:
            if direct and done % _ALIGN == 0:  # a whole number of blocks; the file's end reads short
                want = view[done:done + _round_up(end - done, _ALIGN)]
            else:  # a short read left an unaligned offset: finish the block buffered
                want = view[done:end]
            try:
                got = os.preadv(self.file.fd, [want], done)
            except OSError as e:
                if not direct or e.errno != errno.EINVAL:
                    raise
                _set_direct(self.file.fd, False)  # the file system refused direct I/O: buffered from here on
                direct = False
                continue
            if got <= 0:
                raise self.file.bad(f"file ended at byte {done}, {end - done} bytes short")
            done += got

    def tensor(self, key: str) -> torch.Tensor:
        """Stored tensor ``key`` as a view of the image (its own storage, sharing the image's memory)."""
        assert self.map is not None
        dtype, shape, begin, end = self.file.header().tensors[key]
        return as_tensor(self.map, begin, end - begin, ST_TO_TORCH[dtype], shape)

    def keep(self, key: str) -> torch.Tensor:
        """``tensor(key)``, to outlive the load: its pages are not released."""
        _, _, begin, end = self.file.header().tensors[key]
        self.kept.append((begin, end))
        return self.tensor(key)

    def release(self) -> None:
        """Give back every page that no kept view touches; the mapping itself goes with its last view."""
        if self.map is None:
            return
        pos = 0
        for begin, end in sorted(self.kept) + [(len(self.map), len(self.map))]:
            lo, hi = _round_up(pos, _PAGE), begin // _PAGE * _PAGE
            if hi > lo:
                self.map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            pos = max(pos, end)
        self.map = None
