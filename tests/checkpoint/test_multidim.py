"""Checkpoints of multi-dim DTensors: Shard(d>0), 2-D/3-D meshes, torch's FSDP+TP placements.

Pure box math property-tested against DTensor's own split rules (``Placement._split_tensor`` and
``_compute_local_shape_and_global_offset``, private torch names used in this test only); then real
saves and loads on 4 gloo ranks: ``shard_placement_fn`` Shard(1) across world sizes, hand-built
DTensors on 1-D/2-D/3-D meshes, and a (dp=2, tp=2) model (torch's fully_shard + parallelize_module)
loaded into dp=4 without TP, into (dp=2, tp=2), into dp=1 and into a plain module in this process.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from fully_shard import checkpoint
from fully_shard.checkpoint import boxes
from tests.checkpoint import common as C

SETTINGS = settings(max_examples=200, deadline=None)
TOL = 2e-5


# ---------------------------------------------------------------------------------------------------------
# Pure box math against torch's split rules
# ---------------------------------------------------------------------------------------------------------

def _plain(p: Any) -> boxes.Placement:
    if isinstance(p, _StridedShard):
        return boxes.strided(p.dim, int(p.split_factor))
    if isinstance(p, Shard):
        return boxes.shard(p.dim)
    return boxes.replicate()


@st.composite
def dtensor_layouts(draw: Any, ndim: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    """(shape, mesh shape, placements): Shard(d) and Replicate() on 1-3 mesh axes, any dims, uneven sizes."""
    k = draw(st.integers(0, 3)) if ndim is None else ndim
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=k, max_size=k)))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    placements = [Shard(draw(st.integers(0, k - 1))) if k and draw(st.booleans()) else Replicate() for _ in mesh]
    return shape, mesh, placements


@st.composite
def fsdp_tp_layouts(draw: Any, ndim: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...], list[Any],
                                                                  list[Any], int]:
    """A layout built the way FSDP over TP builds it: TP placements (Shard(d)/Replicate()) on the later axes,
    then one FSDP axis sharding dim ``fd`` of the TP-local tensor, after optional HSDP Replicate() axes.

    Returns (shape, mesh, the DTensor placements torch labels it with, the TP placements, the FSDP axis)."""
    k = draw(st.integers(1, 3)) if ndim is None else ndim
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=k, max_size=k)))
    hsdp = draw(st.integers(0, 1))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=hsdp + 1 + 1, max_size=hsdp + 1 + 2)))
    tp = [Shard(draw(st.integers(0, k - 1))) if draw(st.booleans()) else Replicate() for _ in mesh[hsdp + 1:]]
    fd = draw(st.integers(0, k - 1))
    sf = math.prod(n for n, p in zip(mesh[hsdp + 1:], tp) if isinstance(p, Shard) and p.dim == fd)
    label = _StridedShard(fd, split_factor=sf) if sf > 1 else Shard(fd)
    return shape, mesh, [Replicate()] * hsdp + [label, *tp], tp, hsdp


def _fsdp_tp_local(full: torch.Tensor, mesh: tuple[int, ...], coord: tuple[int, ...], tp: list[Any], fsdp_axis: int,
                   fsdp_dim: int) -> torch.Tensor:
    """What FSDP holds: the TP-local tensor (DTensor's split on the TP axes), torch.chunk-ed by the FSDP axis."""
    t = full
    for size, c, p in zip(mesh[fsdp_axis + 1:], coord[fsdp_axis + 1:], tp):
        if isinstance(p, Shard):
            t = p._split_tensor(t, size, with_padding=False, contiguous=True)[0][c]
    parts = list(torch.chunk(t, mesh[fsdp_axis], dim=fsdp_dim)) if t.shape[fsdp_dim] else []
    parts += [t.narrow(fsdp_dim, 0, 0)] * (mesh[fsdp_axis] - len(parts))
    return parts[coord[fsdp_axis]]


def _dtensor_local(full: torch.Tensor, mesh: tuple[int, ...], coord: tuple[int, ...],
                   placements: list[Any]) -> torch.Tensor:
    """This coordinate's local tensor as DTensor defines it: each placement splits the previous result in turn."""
    t = full
    for size, c, p in zip(mesh, coord, placements):
        if not isinstance(p, Replicate):
            t = p._split_tensor(t, size, with_padding=False, contiguous=True)[0][c]
    return t


def _coords(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in c) for c in np.ndindex(*mesh)]


def _check_box(full: torch.Tensor, box: boxes.Box, local: torch.Tensor, what: Any) -> None:
    assert box.sizes == tuple(local.shape), (what, box, local.shape)
    assert torch.equal(full[box.slices()], local), (what, box)


@SETTINGS
@given(dtensor_layouts())
def test_held_box_is_dtensors_local_shard(layout: tuple[tuple[int, ...], tuple[int, ...], list[Any]]) -> None:
    """Shard(d) (any d, several axes on one dim) and Replicate(): the block DTensor gives every coordinate."""
    shape, mesh, placements = layout
    full = torch.arange(math.prod(shape)).reshape(shape)
    for coord in _coords(mesh):
        box = boxes.held_box(shape, mesh, coord, [_plain(p) for p in placements])
        _check_box(full, box, _dtensor_local(full, mesh, coord, placements), (coord, placements))
        if box.numel:
            t_shape, t_offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
            assert (tuple(t_shape), tuple(t_offset)) == (box.sizes, box.offsets)


@SETTINGS
@given(fsdp_tp_layouts())
def test_held_box_is_what_fsdp_over_tp_holds(layout: Any) -> None:
    """(…, _StridedShard(d, sf), TP placements): the block FSDP keeps of the TP-local tensor, uneven sizes too;
    and, when every split is even, exactly DTensor's own local shard for those placements."""
    shape, mesh, placements, tp, axis = layout
    full = torch.arange(math.prod(shape)).reshape(shape)
    fd = placements[axis].dim
    for coord in _coords(mesh):
        box = boxes.held_box(shape, mesh, coord, [_plain(p) for p in placements])
        _check_box(full, box, _fsdp_tp_local(full, mesh, coord, tp, axis, fd), (coord, placements))
        splits = {d: math.prod(n for n, p in zip(mesh, placements) if isinstance(p, (Shard, _StridedShard))
                               and p.dim == d) for d in range(len(shape))}
        if all(shape[d] % n == 0 for d, n in splits.items()):
            _check_box(full, box, _dtensor_local(full, mesh, coord, placements), ("even", coord, placements))


@SETTINGS
@given(st.integers(0, 40), st.integers(1, 4), st.integers(1, 4), st.integers(0, 5))
def test_strided_dp_over_tp_is_tp_chunk_then_dp_chunk(rows: int, dp: int, tp: int, cols: int) -> None:
    """(_StridedShard(0, sf=tp), Shard(0)) on (dp, tp): chunk by tp first, then that chunk by dp (uneven too)."""
    for i, j in _coords((dp, tp)):
        box = boxes.held_box((rows, cols), (dp, tp), (i, j), [boxes.strided(0, tp), boxes.shard(0)])
        ts, te = boxes.chunk_range(rows, tp, j)
        ds, de = boxes.chunk_range(te - ts, dp, i)
        assert box.sizes == (de - ds, cols) and (de == ds or box.offsets == (ts + ds, 0))


def test_a_split_factor_no_axes_make_up_is_refused() -> None:
    with pytest.raises(boxes.NotABox, match="sf=3"):
        boxes.held_box((12,), (2, 2), (0, 0), [boxes.strided(0, 3), boxes.shard(0)])


def _layouts(ndim: int | None = None) -> Any:
    return st.one_of(dtensor_layouts(ndim), fsdp_tp_layouts(ndim).map(lambda t: t[:3]))


@SETTINGS
@given(_layouts(), st.data())
def test_overlap_reads_rebuild_any_layout_from_any_layout(saved: Any, data: Any) -> None:
    """Save under one layout (replicas splitting their block), load under another: every target block is
    rebuilt exactly from the runs read, and no rank reads an element it does not need."""
    shape, s_mesh, s_pl = saved
    _, l_mesh, l_pl = data.draw(_layouts(len(shape) or 1) if shape else dtensor_layouts(0))
    full = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    chunks = []
    for i, coord in enumerate(_coords(s_mesh)):
        box = boxes.write_box(shape, s_mesh, coord, [_plain(p) for p in s_pl])
        if box is not None:
            chunks.append(_Stored(i, box, full[box.slices()].reshape(-1).copy()))
    wants = [boxes.held_box(shape, l_mesh, c, [_plain(p) for p in l_pl]) for c in _coords(l_mesh)]
    assert boxes.coverage_problem(shape, [c.box for c in chunks]) is None
    for want in wants:
        target = np.full(want.sizes, -1, dtype=np.int64)
        read = 0
        for chunk, part in boxes.overlaps(chunks, want):
            run, starts = boxes.runs(chunk.box.sizes, part.relative_to(chunk.box))
            got = np.concatenate([chunk.data[s:s + run] for s in starts]) if starts else np.zeros(0, np.int64)
            read += got.size
            target[part.slices(want)] = got.reshape(part.sizes)
        np.testing.assert_array_equal(target, full[want.slices()])
        assert read == want.numel


class _Stored:
    def __init__(self, rank: int, box: boxes.Box, data: np.ndarray) -> None:
        self.rank, self.box, self.data = rank, box, data


@SETTINGS
@given(st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple), st.data())
def test_coverage_problem_is_exact_cover(shape: tuple[int, ...], data: Any) -> None:
    """Against brute force: every element covered exactly once by non-empty in-bounds boxes."""
    n = data.draw(st.integers(0, 6))
    dim = st.tuples(st.integers(0, 4), st.integers(0, 4))
    raw = [data.draw(st.lists(dim, min_size=len(shape), max_size=len(shape))) for _ in range(n)]
    if data.draw(st.booleans()) and math.prod(shape):  # also real tilings: a grid cut of the tensor
        cuts = [sorted({0, s, *data.draw(st.lists(st.integers(0, s), max_size=2))}) for s in shape]
        raw = [list(zip(lo, [b - a for a, b in zip(lo, hi)])) for lo, hi in
               zip(*(np.array(list(np.ndindex(*[len(c) - 1 for c in cuts]))).T.tolist() and
                     _grid(cuts),))] if False else [[(c[i], c[i + 1] - c[i]) for c, i in zip(cuts, idx)]
                                                   for idx in np.ndindex(*[len(c) - 1 for c in cuts])]
        if raw and data.draw(st.booleans()):
            raw.pop(data.draw(st.integers(0, len(raw) - 1)))
    bxs = [boxes.Box(tuple(o for o, _ in b), tuple(s for _, s in b)) for b in raw]
    ok = all(all(o >= 0 and s >= 1 and o + s <= m for o, s, m in zip(b.offsets, b.sizes, shape)) for b in bxs)
    if ok:
        count = np.zeros(shape, dtype=np.int64)
        for b in bxs:
            count[b.slices()] += 1
        ok = bool((count == 1).all()) if math.prod(shape) else not bxs
    assert (boxes.coverage_problem(shape, bxs) is None) == ok, (shape, bxs)


def _grid(cuts: list[list[int]]) -> list[Any]:  # pragma: no cover - placeholder for the comprehension above
    return []


# ---------------------------------------------------------------------------------------------------------
# Real saves and loads
# ---------------------------------------------------------------------------------------------------------

DATA = Path(__file__).parent / "data"


def test_a_version_2_checkpoint_still_loads(tmp_path: Path) -> None:
    """Written by the format-2 code (dim-0 row chunks, a 0-dim AdamW step): loads and consolidates exactly."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    extra = checkpoint.load(DATA / "v2-linear", model, opt)
    expected = load_file(DATA / "v2-linear-expected.safetensors")
    names = {id(p): n for n, p in model.named_parameters()}
    got = {f"model/{k}": v for k, v in model.state_dict().items()}
    got.update({f"optim/{names[id(p)]}/{k}": v for p, s in opt.state.items() for k, v in s.items()})
    C.assert_same(got, expected, "v2 checkpoint")
    assert extra == {"step": 1}
    out = load_file(checkpoint.consolidate(DATA / "v2-linear", tmp_path / "hf")[0])
    C.assert_same(out, {k[len("model/"):]: v for k, v in expected.items() if k.startswith("model/")}, "consolidated")
