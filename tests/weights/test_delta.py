"""The delta encoding alone (no processes): the CPU (numpy) encoder against the torch one and against the truth,
for every element width, both record kinds, bitwise changes (NaN payloads, -0.0), and ``write`` into boxes
of any strides (what the receiver applies and the sender's snapshot update uses)."""

from __future__ import annotations

import math

import pytest
import torch

from fully_shard.weights import delta


def _changed(dtype: torch.dtype, numel: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        previous = torch.randn(numel, generator=g, dtype=dtype)
    elif dtype.is_floating_point:
        previous = torch.randn(numel, generator=g).to(dtype)
    elif dtype == torch.bool:
        previous = torch.rand(numel, generator=g) < 0.5
    else:
        previous = torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)
    current = previous.clone()
    index = torch.randperm(numel, generator=g)[: max(1, int(numel * fraction))]
    if dtype == torch.bool:
        current[index] = ~current[index]
    else:
        current[index] = current[index] + 1
    return current, previous


def _truth(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    a, b = delta.bits(current), delta.bits(previous)
    diff = a != b
    return (diff.any(dim=1) if diff.dim() > 1 else diff).nonzero().flatten()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.complex128, torch.int64,
                                   torch.uint8, torch.bool])
@pytest.mark.parametrize("fraction", [0.001, 0.03, 0.5])
def test_encode_lists_exactly_the_changed_elements(dtype: torch.dtype, fraction: float) -> None:
    numel = 10_007  # (not a multiple of 8: the bitmap's last byte is partial)
    current, previous = _changed(dtype, numel, fraction, seed=int(fraction * 1000))
    enc = delta.Encoder().encode(current, previous)
    want = _truth(current, previous)
    assert enc is not None and enc.count == want.numel()
    index_bytes = want.numel() * 4
    assert enc.kind == (delta.INDEX if index_bytes <= math.ceil(numel / 8) else delta.BITMAP), (enc.kind, fraction)
    got = delta.positions(enc.kind, enc.where, enc.count, numel)
    assert torch.equal(got.to(torch.int64), want)
    assert torch.equal(enc.values, current[want].contiguous().view(torch.uint8).reshape(-1))
    # the torch encoder (accelerators) gives the same record
    ref = delta._encode_torch(current, previous)
    assert ref is not None and (ref.kind, ref.count) == (enc.kind, enc.count)
    assert torch.equal(ref.where, enc.where) and torch.equal(ref.values, enc.values)
    # the snapshot update makes the previous values equal the current ones, bit for bit
    delta.apply(previous, enc)
    assert torch.equal(delta.bits(previous), delta.bits(current))


def test_bitwise_changes_count_and_nothing_changed_is_none() -> None:
    previous = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0])
    current = previous.clone()
    current[0] = -0.0  # == 0.0, other bits
    current.view(torch.int32)[2] += 1  # another NaN payload
    enc = delta.Encoder().encode(current, previous)
    assert enc is not None and enc.count == 2
    assert delta.positions(enc.kind, enc.where, enc.count, 5).tolist() == [0, 2]
    assert delta.Encoder().encode(current, current.clone()) is None


def test_the_mask_buffer_is_reused_across_parts_of_any_size() -> None:
    encoder = delta.Encoder()
    for numel in (1000, 10, 5000, 3):
        current, previous = _changed(torch.float32, numel, 0.2, seed=numel)
        enc = encoder.encode(current, previous)
        assert enc is not None
        assert torch.equal(delta.positions(enc.kind, enc.where, enc.count, numel).to(torch.int64),
                           _truth(current, previous))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128])
def test_write_into_strided_and_contiguous_boxes(dtype: torch.dtype) -> None:
    target = torch.zeros(6, 8, dtype=dtype)
    want = target.clone()
    for box in ((slice(1, 4), slice(2, 7)), (slice(2, 5), slice(0, 8))):  # columns cut (strided), whole rows
        view = target[box]
        index = torch.tensor([0, 3, 7, view.numel() - 1], dtype=torch.int32)
        values = torch.arange(1, 5).to(dtype)
        delta.write(view, index, values)
        want_view = want[box]
        for k, i in enumerate(index.tolist()):
            want_view[i // view.shape[1], i % view.shape[1]] = values[k]
    assert torch.equal(target, want)


def test_malformed_positions_are_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        delta.positions(delta.INDEX, torch.tensor([0, 12], dtype=torch.int32).view(torch.uint8), 2, 10)
    bitmap = torch.tensor([0b1, 0b100], dtype=torch.uint8)  # bit 10 set, 10 elements
    with pytest.raises(ValueError, match="past"):
        delta.positions(delta.BITMAP, bitmap, 2, 10)
    with pytest.raises(ValueError, match="lists 1 elements"):
        delta.positions(delta.BITMAP, torch.tensor([0b1, 0], dtype=torch.uint8), 2, 10)
