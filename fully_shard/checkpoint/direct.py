"""Direct reads: byte ranges of a file into page-aligned memory past the page cache (O_DIRECT), else buffered.

A buffered read of a cold file costs the disk transfer into the page cache and then a copy from it
into the caller's memory; a direct read moves the bytes once, into the caller's memory. Direct I/O
needs the memory address, the file offset and the length in multiples of the logical block size:
ranges are widened to whole pages (``ALIGN``) and read into page-aligned anonymous mappings. The
direct descriptor is a second descriptor of the *same* open file (``/proc/self/fd``), so it reads the
file the checks were made on; where that or direct I/O is not available, reads are buffered.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable

import torch

ALIGN = 4096  # at least the logical block size of any disk; a page


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def open_direct(fd: int) -> int | None:
    """A second, O_DIRECT descriptor of the file open as ``fd``; None where direct I/O is not available."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    if os.fstat(direct).st_ino != os.fstat(fd).st_ino:  # pragma: no cover - /proc names the open file
        os.close(direct)
        return None
    return direct


def aligned(nbytes: int) -> mmap.mmap:
    """``nbytes`` (rounded up to a page) of page-aligned anonymous private memory."""
    return mmap.mmap(-1, max(round_up(nbytes, ALIGN), ALIGN), flags=mmap.MAP_PRIVATE)


class AlignedArena(threading.local):
    """Each thread's page-aligned read buffer, reused from read to read (grows to the largest)."""

    buf: mmap.mmap | None = None

    def get(self, nbytes: int) -> mmap.mmap:
        if self.buf is None or len(self.buf) < nbytes:
            self.buf = aligned(nbytes)
        return self.buf


def read_range(fd: int, direct_fd: int | None, begin: int, end: int, arena: AlignedArena,
               short: Callable[[str], Exception] = EOFError) -> tuple[mmap.mmap, int]:
    """File bytes [begin, end) in the arena's buffer; returns (buffer, where ``begin`` lies in it).

    Direct when ``direct_fd`` is given (the range widened to whole pages; a refused read falls back to
    a buffered one of the exact range). ``short(problem)``: the error raised when the file ends early."""
    if direct_fd is not None:
        lo = begin // ALIGN * ALIGN
        buf = arena.get(round_up(end, ALIGN) - lo)
        view = memoryview(buf)
        try:
            done = lo
            while done < end:
                got = os.preadv(direct_fd, [view[done - lo:round_up(end, ALIGN) - lo]], done)
                if got <= 0:
                    raise short(f"file ended at byte {done}, {end - done} bytes short")
                done += got
                if done % ALIGN and done < end:  # a short read left an unaligned offset: finish buffered
                    _read_exact(fd, view[done - lo:end - lo], done, short)
                    done = end
            return buf, begin - lo
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        finally:
            view.release()
    buf = arena.get(end - begin)
    view = memoryview(buf)
    try:
        _read_exact(fd, view[:end - begin], begin, short)
    finally:
        view.release()
    return buf, 0


def _read_exact(fd: int, view: memoryview, offset: int, short: Callable[[str], Exception]) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise short(f"file ended at byte {offset + done}, {len(view) - done} bytes short")
        done += got


def as_tensor(buf: mmap.mmap, start: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes [start, start + nbytes) of ``buf`` as a tensor of ``dtype`` and ``shape`` (no copy)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape)
