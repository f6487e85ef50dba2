"""A data file streamed once through a ring of reused blocks: hashed in file order, its bytes copied where they go.

An in-place load (``LoadMode.IN_PLACE``, design/checkpoint-format.md section 7) reads each file of
its digest share this way: the file is read whole in ``direct.BLOCK_BYTES`` blocks, ``direct.DEPTH``
in flight (``O_DIRECT`` where the file system takes it), into ``DEPTH + 1`` page-aligned buffers taken
from the buffer pool (memory already mapped: no fresh page is faulted in), and as each block arrives,
in file order, it is hashed and every part of it that a planned read wants is copied into that read's
destination, a view of the live parameter or optimizer state. So the bytes cross from the disk once
and are copied once, the copy overlapping the next blocks' reads, and the digest is known when the
last block has been copied: a failed digest is found after its file's bytes were written (the
in-place trade), and the ledger records what was written.

The part of a block a read wants is the intersection of the read's box with the block's flat element
range of the stored tensor, a handful of boxes (boxes.flat_boxes), each copied by one strided copy;
so a column block (one run per row) costs a few copies per block, not one per row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import direct
from . import format as fmt
from .boxes import flat_boxes
from .codec import ST_TO_TORCH
from .direct import POOL, read_whole
from .ledger import Ledger, Read
from .safetensors_io import DataFile


@dataclass
class _Target:
    """A read placed in its file: the stored chunk's layout, and the file bytes its box spans."""

    read: Read
    dtype: torch.dtype
    item: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    begin: int  # file byte of the chunk's element 0
    lo: int  # file bytes [lo, hi) hold every element of the read's box
    hi: int


def _flat(offsets: tuple[int, ...], strides: tuple[int, ...]) -> int:
    return sum(o * s for o, s in zip(offsets, strides))


def streamable(f: DataFile, r: Read) -> bool:
    """Whether ``stream`` can copy ``r``: its stored tensor starts at a multiple of its element size (this
    library's writer aligns every tensor; a file that does not is read with ``DataFile.read_box``)."""
    dtype, _, begin, _ = f.header().tensors[r.key]
    return begin % fmt.DTYPE_SIZES[dtype] == 0


def _target(f: DataFile, r: Read) -> _Target:
    dtype, shape, begin, _ = f.header().tensors[r.key]
    torch_dtype = ST_TO_TORCH[dtype]
    item = fmt.DTYPE_SIZES[dtype]
    strides = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    first = _flat(r.src.offsets, strides)
    last = _flat(tuple(o + s - 1 for o, s in zip(r.src.offsets, r.src.sizes)), strides)
    return _Target(r, torch_dtype, item, tuple(shape), strides, begin, begin + first * item, begin + (last + 1) * item)


def stream(f: DataFile, reads: Sequence[Read], ledger: Ledger, *, digest: bool) -> str | None:
    """Read file ``f`` whole, copying each read's box into its ``dst`` as the blocks arrive (every ``dst`` a
    CPU or device tensor of ``read.src.sizes``, every read ``streamable``); returns the file's xxh3_128
    (None without ``digest``)."""
    targets = sorted((_target(f, r) for r in reads if r.src.numel), key=lambda t: t.lo)
    blocks_in_file = -(-f.size // direct.BLOCK_BYTES)
    ring = [POOL.take(min(direct.BLOCK_BYTES, f.size)) for _ in range(min(direct.DEPTH + 1, blocks_in_file))]
    views = [memoryview(b) for b in ring]
    blocks = [torch.frombuffer(b, dtype=torch.uint8) for b in ring]
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def copy_out(start: int, end: int, buf: memoryview) -> None:
        slot = start // direct.BLOCK_BYTES % len(views)
        for t in targets:
            if t.lo >= end or t.hi <= start:
                continue
            lo, hi = max(t.lo, start), min(t.hi, end)
            block = typed.get((slot, t.dtype))
            if block is None:
                block = typed[(slot, t.dtype)] = blocks[slot].view(t.dtype)
            src_box = t.read.src
            for piece in flat_boxes(t.shape, (lo - t.begin) // t.item, (hi - t.begin) // t.item):
                part = piece.intersect(src_box)
                if part is None:
                    continue
                at = (t.begin - start) // t.item + _flat(part.offsets, t.strides)
                source = block.as_strided(part.sizes, t.strides, at)
                ledger.begin(t.read)
                t.read.dst[part.relative_to(src_box).slices()].copy_(source)
                ledger.wrote(t.read, part.numel)

    try:
        return read_whole(f.fd, f.size, slot=lambda start: views[start // direct.BLOCK_BYTES % len(views)],
                          digest=digest, on_block=copy_out, short=f.bad)
    finally:
        typed.clear()
        blocks.clear()
        for v in views:
            v.release()
        for b in ring:
            POOL.give(b)
