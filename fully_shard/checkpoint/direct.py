"""Direct reads: byte ranges of a file into page-aligned memory past the page cache (O_DIRECT), else buffered.

A buffered read of a cold file costs the disk transfer into the page cache and then a copy from it
into the caller's memory; a direct read moves the bytes once, into the caller's memory. Direct I/O
needs the memory address, the file offset and the length in multiples of the logical block size:
ranges are widened to whole pages (``ALIGN``) and read into page-aligned anonymous mappings. The
direct descriptor is a second descriptor of the *same* open file (``/proc/self/fd``), so it reads the
file the checks were made on; where that or direct I/O is not available, reads are buffered.

``read_whole`` reads a whole file in blocks, several in flight, hashing them in file order (the file
images of image.py and the streams of stream.py). Their memory comes from ``POOL``: page-aligned
buffers kept from one load to the next, because first touch of fresh memory (the kernel zeroing and
mapping each page) costs about as much as reading the bytes from disk.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
import xxhash

ALIGN = 4096  # at least the logical block size of any disk; a page
BLOCK_BYTES = 8 << 20  # one read of read_whole; ``DEPTH`` of them are in flight at once
DEPTH = 4


_readers: tuple[int, ThreadPoolExecutor] | None = None  # (pid, threads) of read_whole
_readers_lock = threading.Lock()  # process-wide as _readers: one start of the reader threads per process


def readers() -> ThreadPoolExecutor:
    """``read_whole``'s ``DEPTH`` reader threads, started once per process (a forked child starts its own):
    starting threads for every file cost each load ~0.2 s of waiting on a busy machine (a new thread
    must be scheduled before ``Thread.start`` returns)."""
    global _readers
    with _readers_lock:
        if _readers is None or _readers[0] != os.getpid():
            _readers = (os.getpid(), ThreadPoolExecutor(max_workers=DEPTH, thread_name_prefix="checkpoint-read"))
        return _readers[1]


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


def as_tensor(buf: mmap.mmap | memoryview, start: int, nbytes: int, dtype: torch.dtype,
              shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes [start, start + nbytes) of ``buf`` as a tensor of ``dtype`` and ``shape`` (no copy)."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape)


def set_direct(fd: int, on: bool) -> bool:
    """Switch O_DIRECT on ``fd`` (Linux allows it on an open descriptor); False where it cannot be."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | flag if on else flags & ~flag)
    except OSError:
        return False
    return True


def read_block(fd: int, buf: memoryview, start: int, end: int, direct: bool,
               short: Callable[[str], Exception]) -> bool:
    """File bytes [start, end) into ``buf`` from its first byte (``buf``: page-aligned, at least ``end - start``
    rounded up to ``ALIGN`` long; ``start`` a multiple of ``ALIGN``). Direct while ``direct`` and aligned (the
    file's end reads short); a short read that leaves an unaligned offset is finished buffered, and a
    refused direct read (EINVAL: the file system does not take direct I/O) switches the descriptor to
    buffered reads. Returns whether reads are still direct."""
    done = start
    while done < end:
        at = done - start
        want = buf[at:at + round_up(end - done, ALIGN)] if direct and done % ALIGN == 0 else buf[at:end - start]
        try:
            got = os.preadv(fd, [want], done)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            set_direct(fd, False)
            direct = False
            continue
        if got <= 0:
            raise short(f"file ended at byte {done}, {end - done} bytes short")
        done += got
    return direct


def read_whole(fd: int, size: int, *, slot: Callable[[int], memoryview], digest: bool,
               on_block: Callable[[int, int, memoryview], None] | None = None, depth: int = DEPTH,
               short: Callable[[str], Exception] = EOFError) -> str | None:
    """Bytes [0, size) of the file open as ``fd``, in blocks of ``BLOCK_BYTES``: the block at byte ``start`` into
    ``slot(start)``, ``depth`` reads in flight, direct where the file system takes it. In file order, each
    block is hashed (``digest``) and then handed to ``on_block(start, end, buffer)``; the block ``depth``
    blocks later is read meanwhile, so a ring of ``depth + 1`` buffers suffices. Returns the xxh3_128 of
    the file (None without ``digest``). Every read has finished when this returns or raises."""
    block = BLOCK_BYTES
    starts = range(0, size, block)
    direct = [set_direct(fd, True)]
    h = xxhash.xxh3_128() if digest else None

    def read(i: int) -> None:
        direct[0] = read_block(fd, slot(starts[i]), starts[i], min(starts[i] + block, size), direct[0], short)

    pending: deque[Future[None]] = deque()
    try:
        pool = readers()
        pending.extend(pool.submit(read, i) for i in range(min(depth, len(starts))))
        for i, start in enumerate(starts):
            pending.popleft().result()
            if i + depth < len(starts):
                pending.append(pool.submit(read, i + depth))
            end = min(start + block, size)
            buf = slot(start)
            if h is not None:
                h.update(buf[:end - start])
            if on_block is not None:
                on_block(start, end, buf)
    finally:
        wait(pending)  # every read has finished: the caller may reuse or unmap the buffers
        set_direct(fd, False)
    return h.hexdigest() if h is not None else None


class BufferPool:
    """Page-aligned buffers kept between loads, so that a load reads into memory that is already mapped.

    First touch of fresh memory (the kernel zeroing and mapping each page) costs about as much as
    reading the bytes from a fast disk (benchmarks/README.md, checkpoint section). A load takes its
    buffers (a staged load's file images, an in-place load's ring of blocks) with ``take``. A buffer
    no tensor uses any more goes back with ``give``; one whose tensors live on (optimizer state that
    is a view of a file image) is ``lend``-ed with the memoryview those tensors were made from, and
    comes back by itself once the last of them is gone (a weak reference to that memoryview says so;
    the memoryview's export also keeps the mapping from being unmapped under them). Free buffers are
    marked ``MADV_FREE``: the kernel reclaims their pages whenever it needs memory (they then come
    back zeroed, which a read overwrites anyway), and until then the next load reuses them without a
    fault. ``settle`` at the end of a load unmaps the free buffers that load did not use, so the pool
    holds what the last load needed (and what the optimizer's state still uses)."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lent: list[tuple[mmap.mmap, weakref.ref[memoryview]]] = []
        self._used: set[int] = set()  # id() of buffers taken, or come back, since the last settle
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        """A buffer of at least ``nbytes`` (rounded up to a page): the smallest free one that fits, else a new one."""
        with self._lock:
            self._reclaim()
            fits = [b for b in self._free if len(b) >= nbytes]
            buf = min(fits, key=len) if fits else None
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            buf = aligned(nbytes)
        with self._lock:
            self._used.add(id(buf))
        return buf

    def give(self, buf: mmap.mmap) -> None:
        """Back to the pool now: no tensor of ``buf`` may be used after this call."""
        _reclaimable(buf)
        with self._lock:
            self._free.append(buf)

    def lend(self, buf: mmap.mmap, view: memoryview) -> None:
        """Back to the pool once every tensor made from ``view`` (a memoryview of ``buf``) is gone."""
        with self._lock:
            self._lent.append((buf, weakref.ref(view)))

    def _reclaim(self) -> None:
        """(Under the lock.) Lent buffers whose tensors are all gone become free."""
        back = [b for b, view in self._lent if view() is None]
        if back:
            self._lent = [(b, view) for b, view in self._lent if view() is not None]
            for b in back:
                _reclaimable(b)
                self._free.append(b)
                self._used.add(id(b))

    def settle(self) -> None:
        """Unmap the free buffers that no ``take`` used since the last settle (and that did not just come back)."""
        with self._lock:
            self._reclaim()
            stale = [b for b in self._free if id(b) not in self._used]
            self._free = [b for b in self._free if id(b) in self._used]
            self._used.clear()
        _close(stale)

    def clear(self) -> None:
        """Unmap every free buffer and forget the lent ones (the next load starts from fresh memory)."""
        with self._lock:
            stale, self._free, self._lent = self._free, [], []
            self._used.clear()
        _close(stale)

    @property
    def nbytes(self) -> int:
        """Bytes held by free buffers (lent ones that came back included)."""
        with self._lock:
            self._reclaim()
            return sum(len(b) for b in self._free)


def _reclaimable(buf: mmap.mmap) -> None:
    free = getattr(mmap, "MADV_FREE", None)
    if free is not None:
        buf.madvise(free)


def _close(buffers: list[mmap.mmap]) -> None:
    for b in buffers:
        with contextlib.suppress(BufferError):  # a view still exports it: the mapping goes with the last view
            b.close()


POOL = BufferPool()
