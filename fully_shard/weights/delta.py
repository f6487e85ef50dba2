"""The delta encoding: the elements of a part that changed since the last send, and applying them.

A record of one part (its box in a yielded tensor) lists the changed elements by position in the box
(C order) either as int32/int64 indices or as a bitmap (one bit per element, little-endian within a
byte), whichever is smaller, followed by their new values in the wire dtype. "Changed" is bitwise, so
NaN payloads and -0.0 are sent like any other value, and applying every record to the previous values
gives exactly the values a full send would. See design/weights.md "The delta format".

Each step is a few whole-array passes over the part: on CPU through numpy (one compare into a reused
mask, a count, then either the positions or the packed bits, and the values), whose kernels for these
passes are several times faster than torch's CPU ones (``nonzero``, ``sum`` of a bool tensor); on an
accelerator through torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

INDEX, BITMAP = "index", "bitmap"

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@dataclass
class Encoded:
    """One part's changes: ``where`` (indices or bitmap, as bytes) then ``values`` (as bytes)."""

    kind: str
    count: int
    where: torch.Tensor  # uint8
    values: torch.Tensor  # uint8 (the changed values in the wire dtype, as bytes)

    @property
    def nbytes(self) -> int:
        return self.where.numel() + self.values.numel()


def bits(values: torch.Tensor) -> torch.Tensor:
    """The flat tensor's elements as integers (a view): equal integers = equal bits. Elements wider than 8
    bytes are rows of int64 (compare each row whole)."""
    size = values.element_size()
    if size in _INT:
        return values.view(_INT[size])
    return values.view(torch.int64).view(-1, size // 8)


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _index_smaller(count: int, numel: int) -> bool:
    return count * index_dtype(numel).itemsize <= math.ceil(numel / 8)


class Encoder:
    """Encodes parts (flat tensors in the wire dtype) against their previous values; keeps one mask buffer
    (CPU) for the compare, reused for every part."""

    def __init__(self) -> None:
        self._mask = np.empty(0, dtype=np.bool_)

    def _mask_of(self, current: np.ndarray, previous: np.ndarray) -> np.ndarray:
        n = current.shape[0]
        if self._mask.shape[0] < n:
            self._mask = np.empty(n, dtype=np.bool_)
        mask = self._mask[:n]
        if current.ndim == 1:
            np.not_equal(current, previous, out=mask)
        else:  # wide elements: any differing word
            np.any(current != previous, axis=1, out=mask)
        return mask

    def encode(self, current: torch.Tensor, previous: torch.Tensor) -> Encoded | None:
        """The record of ``current`` vs ``previous`` (flat, same wire dtype, same device), or None when nothing
        changed."""
        if current.device.type != "cpu":
            return _encode_torch(current, previous)
        numel = current.numel()
        cur, prev = bits(current).numpy(), bits(previous).numpy()
        mask = self._mask_of(cur, prev)
        count = int(np.count_nonzero(mask))
        if count == 0:
            return None
        if _index_smaller(count, numel):
            index = np.flatnonzero(mask)
            where = torch.from_numpy(index.astype(np.int32 if numel < 2**31 else np.int64)).view(torch.uint8)
            new = cur[index]
            kind = INDEX
        else:
            where = torch.from_numpy(np.packbits(mask, bitorder="little"))
            new = cur[mask]
            kind = BITMAP
        return Encoded(kind, count, where.reshape(-1), torch.from_numpy(new).view(torch.uint8).reshape(-1))


def _encode_torch(current: torch.Tensor, previous: torch.Tensor) -> Encoded | None:
    diff = bits(current) != bits(previous)
    if diff.dim() > 1:
        diff = diff.any(dim=1)
    index = diff.nonzero().flatten()
    count = index.numel()
    if count == 0:
        return None
    numel = current.numel()
    values = current[index].contiguous().view(torch.uint8).reshape(-1)
    if _index_smaller(count, numel):
        return Encoded(INDEX, count, index.to(index_dtype(numel)).view(torch.uint8).reshape(-1), values)
    mask = torch.zeros(math.ceil(numel / 8) * 8, dtype=torch.bool, device=current.device)
    mask[index] = True
    packed = (mask.view(-1, 8).to(torch.uint8) * _BIT.to(current.device)).sum(dim=1, dtype=torch.uint8)
    return Encoded(BITMAP, count, packed, values)


def record_size(kind: str, count: int, numel: int, itemsize: int) -> tuple[int, int]:
    """(bytes of ``where``, bytes of the values) of a record, from its header fields. In the payload the
    values start at ``where`` rounded up to 16 bytes (aligned for any dtype)."""
    if kind not in (INDEX, BITMAP) or count < 0 or count > numel:
        raise ValueError(f"a record of kind {kind!r} with {count} of {numel} elements")
    where = count * index_dtype(numel).itemsize if kind == INDEX else math.ceil(numel / 8)
    return where, count * itemsize


def positions(kind: str, where: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """The positions a record lists (an integer tensor: the record's own int32/int64 indices, or, from a
    bitmap, ascending int64), bounds checked: ValueError naming what is wrong."""
    if kind == INDEX:
        index = where.view(index_dtype(numel))
        if count and (int(index.min()) < 0 or int(index.max()) >= numel):
            raise ValueError(f"an index lies outside the part's {numel} elements")
        return index
    if kind != BITMAP:
        raise ValueError(f"unknown record kind {kind!r}")
    if where.device.type == "cpu":
        unpacked_np = np.unpackbits(where.numpy(), bitorder="little")
        if unpacked_np[numel:].any():
            raise ValueError("bits set past the part's last element")
        index = torch.from_numpy(np.flatnonzero(unpacked_np[:numel]))
    else:
        unpacked = (where.view(-1, 1) & _BIT.to(where.device)).ne(0).reshape(-1)
        if bool(unpacked[numel:].any()):
            raise ValueError("bits set past the part's last element")
        index = unpacked[:numel].nonzero().flatten()
    if index.numel() != count:
        raise ValueError(f"the bitmap lists {index.numel()} elements, the record says {count}")
    return index


def write(dest: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``dest`` (a box of a tensor, any strides, at least 1-D) at positions ``index`` (C order) := ``values``
    (cast to ``dest``'s dtype): the receiver's apply and the sender's snapshot update. On CPU one numpy
    ``put`` (int32 positions as they are), elsewhere ``index_copy_``/``index_put_``."""
    values = values.to(device=dest.device, dtype=dest.dtype)
    if dest.device.type == "cpu" and dest.element_size() in _INT:
        np.put(bits(dest).numpy(), index.numpy(), bits(values).numpy())  # (writes through any strides)
        return
    index = index.to(device=dest.device, dtype=torch.int64)
    if dest.is_contiguous():
        dest.view(-1).index_copy_(0, index, values)
    else:
        dest.index_put_(torch.unravel_index(index, dest.shape), values)


def apply(snapshot: torch.Tensor, enc: Encoded) -> None:
    """Write a record's values into ``snapshot`` (the flat previous values it was encoded against)."""
    index = positions(enc.kind, enc.where, enc.count, snapshot.numel())
    write(snapshot, index, enc.values.view(snapshot.dtype))
