"""Property tests for the pure dim-0 layout: shards are disjoint, cover the tensor, and round-trip."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_shard.core.layout import DimZeroLayout, FlatLayout

shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
)
worlds = st.integers(1, 8)


@given(shapes, worlds)
def test_rows_follow_torch_chunk_and_cover_exactly_once(shape: tuple[int, ...], world: int) -> None:
    layout = DimZeroLayout(shape, world)
    if layout.replicated:
        assert all(layout.local_shape(r) == () for r in range(world))
        return
    t = torch.arange(layout.numel).reshape(shape)
    chunks = list(torch.chunk(t, world, dim=0)) if shape[0] else []
    covered: list[int] = []
    for rank in range(world):
        start, end = layout.row_range(rank)
        covered += range(start, end)
        expected = chunks[rank].shape if rank < len(chunks) else (0, *shape[1:])
        assert layout.local_shape(rank) == tuple(expected)
        assert layout.padding_numel(rank) == (layout.chunk_rows - layout.local_rows(rank)) * layout.row_numel
    assert covered == list(range(shape[0]))  # disjoint, ordered, complete


@given(shapes, worlds)
def test_pad_then_unpad_is_identity(shape: tuple[int, ...], world: int) -> None:
    layout = DimZeroLayout(shape, world)
    t = torch.randn(shape)
    if layout.replicated:
        assert layout.padded_numel == 1
        return
    # pad every rank's shard to chunk_rows rows, concatenate (what the all-gather produces), unpad
    segments = []
    for rank in range(world):
        start, end = layout.row_range(rank)
        local = t[start:end].reshape(-1)
        segments.append(torch.cat([local, torch.zeros(layout.padding_numel(rank))]))
        assert segments[-1].numel() == layout.padded_shard_numel
    gathered = torch.cat(segments)
    assert gathered.numel() == layout.padded_numel
    assert torch.equal(gathered[: layout.numel].view(shape), t)


@given(st.lists(shapes, min_size=1, max_size=5), worlds)
@settings(max_examples=60)
def test_flat_layout_round_trip(shape_list: list[tuple[int, ...]], world: int) -> None:
    layouts = tuple(DimZeroLayout(s, world) for s in shape_list)
    flat = FlatLayout(layouts)
    tensors = [torch.randn(s) for s in shape_list]
    # every rank's segment: padded shards at their offsets
    out = torch.full((world, flat.shard_numel), float("nan"))
    for rank in range(world):
        for t, lay, off in zip(tensors, layouts, flat.offsets):
            if lay.replicated:
                out[rank, off] = t
                continue
            start, end = lay.row_range(rank)
            local = t[start:end].reshape(-1)
            out[rank, off:off + local.numel()] = local
    # unpack like all_gather_copy_out: (world, size) blocks -> first numel elements
    for t, lay, off, size in zip(tensors, layouts, flat.offsets, flat.sizes):
        if lay.replicated:
            assert torch.equal(out[0, off], t)
            continue
        rebuilt = out[:, off:off + size].reshape(-1)[: lay.numel].view(lay.shape)
        assert torch.equal(rebuilt, t)
    assert flat.total_numel == world * sum(flat.sizes)


def test_bad_layout_arguments() -> None:
    import pytest

    with pytest.raises(ValueError, match="world must be >= 1"):
        DimZeroLayout((3,), 0)
    with pytest.raises(ValueError, match="rank must be in"):
        DimZeroLayout((3,), 2).row_range(2)
    with pytest.raises(ValueError, match="one world size"):
        FlatLayout((DimZeroLayout((3,), 2), DimZeroLayout((3,), 3)))
