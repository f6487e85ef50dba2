"""The delta encoding: the elements of a part that changed since the last send, and applying them.

A record of one part (its box in a yielded tensor) lists the changed elements by position in the box
(C order) either as int32/int64 indices or as a bitmap (one bit per element, little-endian within a
byte), whichever is smaller, followed by their new values in the wire dtype. "Changed" is bitwise, so
NaN payloads and -0.0 are sent like any other value, and applying every record to the previous values
gives exactly the values a full send would. See design/weights.md "The delta format".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    values: torch.Tensor  # uint8
    index: torch.Tensor  # int64 positions (kept to update the snapshot)
    new: torch.Tensor  # the changed values, wire dtype

    @property
    def nbytes(self) -> int:
        return self.where.numel() + self.values.numel()


def bits(values: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (a view): equal integers = equal bits."""
    size = values.element_size()
    if size in _INT:
        return values.view(_INT[size])
    return values.view(torch.int64).view(-1, size // 8)


def changed(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Positions (int64) where the two flat tensors differ bitwise."""
    diff = bits(current) != bits(previous)
    if diff.dim() > 1:
        diff = diff.any(dim=1)
    return diff.nonzero().flatten()


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def encode(current: torch.Tensor, previous: torch.Tensor) -> Encoded | None:
    """The record of ``current`` vs ``previous`` (flat, wire dtype), or None when nothing changed."""
    index = changed(current, previous)
    count = index.numel()
    if count == 0:
        return None
    numel = current.numel()
    new = current[index]
    values = new.contiguous().view(torch.uint8).reshape(-1)
    idx_dtype = index_dtype(numel)
    if count * idx_dtype.itemsize <= math.ceil(numel / 8):
        where = index.to(idx_dtype).view(torch.uint8).reshape(-1)
        return Encoded(INDEX, count, where, values, index, new)
    mask = torch.zeros(math.ceil(numel / 8) * 8, dtype=torch.bool, device=current.device)
    mask[index] = True
    packed = (mask.view(-1, 8).to(torch.uint8) * _BIT.to(current.device)).sum(dim=1, dtype=torch.uint8)
    return Encoded(BITMAP, count, packed, values, index, new)


def record_size(kind: str, count: int, numel: int, itemsize: int) -> tuple[int, int]:
    """(bytes of ``where``, bytes of the values) of a record, from its header fields. In the payload the
    values start at ``where`` rounded up to 16 bytes (aligned for any dtype)."""
    if kind not in (INDEX, BITMAP) or count < 0 or count > numel:
        raise ValueError(f"a record of kind {kind!r} with {count} of {numel} elements")
    where = count * index_dtype(numel).itemsize if kind == INDEX else math.ceil(numel / 8)
    return where, count * itemsize


def positions(kind: str, where: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """The int64 positions a record lists (bounds checked: ValueError naming what is wrong)."""
    if kind == INDEX:
        index = where.view(index_dtype(numel)).to(torch.int64)
        if count and (int(index.min()) < 0 or int(index.max()) >= numel):
            raise ValueError(f"an index lies outside the part's {numel} elements")
        return index
    if kind != BITMAP:
        raise ValueError(f"unknown record kind {kind!r}")
    unpacked = (where.view(-1, 1) & _BIT.to(where.device)).ne(0).reshape(-1)
    if bool(unpacked[numel:].any()):
        raise ValueError("bits set past the part's last element")
    index = unpacked[:numel].nonzero().flatten()
    if index.numel() != count:
        raise ValueError(f"the bitmap lists {index.numel()} elements, the record says {count}")
    return index
