"""Blockwise int8 quantization of one rank's all-gather segment: the block layout, quantize, dequantize.

See design/quantized-all-gather.md. Pure tensor math, no communication. A rank's segment of the flat
buffer holds each parameter's padded shard (``sizes[i]`` values) back to back; every piece is split
into ``ceil(size / block_size)`` blocks, the last one zero-padded, so a block never straddles two
parameters and, since each rank quantizes only its own segment, never two ranks. Each block stores
int8 values ``q = round(x / s)`` with one float32 scale ``s = max|x| / 127`` (``s = 1`` where that is
0, e.g. an all-zero block, whose values quantize to 0): ``|x - q * s| <= s / 2``.

Packed segment (bytes, what one rank contributes to the all-gather)::

    [ int8 data: num_blocks * block_size | pad to 4 | float32 scales: num_blocks ]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

QMAX = 127  # symmetric int8: -127..127 (-128 is never produced)
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class BlockLayout:
    """Where the quantization blocks of one rank's segment lie and how the packed segment is laid out."""

    sizes: tuple[int, ...]  # values per rank of each tensor (``FlatLayout.sizes``)
    block_size: int

    @cached_property
    def blocks(self) -> tuple[int, ...]:
        """Blocks of each tensor's piece."""
        return tuple(-(-size // self.block_size) for size in self.sizes)

    @cached_property
    def num_blocks(self) -> int:
        return sum(self.blocks)

    @cached_property
    def blocked_numel(self) -> int:
        """Values of the segment once each piece is padded to whole blocks."""
        return self.num_blocks * self.block_size

    @cached_property
    def pieces(self) -> tuple[int, ...]:
        """The blocked segment as alternating (values, block padding) lengths: ``split_with_sizes``."""
        out: list[int] = []
        for size, blocks in zip(self.sizes, self.blocks):
            out += [size, blocks * self.block_size - size]
        return tuple(out)

    @cached_property
    def data_nbytes(self) -> int:
        """int8 bytes, rounded up to 4 so the scales that follow are float32-aligned."""
        return -(-self.blocked_numel // 4) * 4

    @cached_property
    def packed_nbytes(self) -> int:
        """Bytes one rank sends: int8 data + padding + scales."""
        return self.data_nbytes + self.num_blocks * SCALE_DTYPE.itemsize


def quantize(blocked: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocked`` (``num_blocks * block_size`` floats) -> (int8 values, float32 scale per block)."""
    x = blocked.to(SCALE_DTYPE).view(-1, block_size)
    scales = x.abs().amax(dim=1, keepdim=True) / QMAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero (or subnormal) block
    q = torch.round(x / scales).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(-1), scales.view(-1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_size: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 values ``(..., num_blocks * block_size)`` and scales ``(..., num_blocks)`` -> ``dtype``:
    ``q * s`` computed in float32, then rounded once to ``dtype``. ``out`` (same shape as ``q``)."""
    lead = q.shape[:-1]
    q3 = q.reshape(*lead, -1, block_size)
    s3 = scales.reshape(*lead, -1, 1)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    torch.mul(q3, s3, out=out.view(*lead, -1, block_size))
    return out


def pack(blocked: torch.Tensor, layout: BlockLayout, segment: torch.Tensor) -> None:
    """Quantize ``blocked`` into ``segment`` (``layout.packed_nbytes`` uint8)."""
    q, scales = quantize(blocked, layout.block_size)
    data_view(segment, layout).copy_(q)
    scales_view(segment, layout).copy_(scales)


def data_view(packed: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The int8 values of packed segment(s) ``(..., packed_nbytes)`` uint8."""
    return packed.narrow(-1, 0, layout.blocked_numel).view(torch.int8)


def scales_view(packed: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The float32 scales of packed segment(s) ``(..., packed_nbytes)`` uint8."""
    if not layout.num_blocks:  # only empty tensors: nothing to view as float32
        return packed.new_empty((*packed.shape[:-1], 0), dtype=SCALE_DTYPE)
    return packed.narrow(-1, layout.data_nbytes, layout.num_blocks * SCALE_DTYPE.itemsize).view(SCALE_DTYPE)
