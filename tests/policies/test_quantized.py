"""QuantizedAllGather: the block math against a per-block reference (property tests), gathered params
equal to the reference dequantization of every rank's shard, training close to the unquantized run,
the bytes on the wire, one all-gather per unit, and the combinations it refuses."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from fully_shard import MixedPrecisionPolicy, QuantizedAllGather, fully_shard, profile
from fully_shard.comm import trace
from fully_shard.comm.trace import EventKind
from fully_shard.core.policy import check_all_gather_policy
from fully_shard.core.quantize import BlockLayout, data_view, dequantize, pack, quantize, scales_view
from fully_shard.core.state import states_under
from tests.core.common import local_slice, shard_gpt, step_pair, train_pair
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# --- reference: one block at a time, scalar by scalar where it matters ------------------------------
def reference_quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: s = max|x| / 127 (1 if that is 0), q = round-half-even(x / s) clamped to +-127."""
    qs, scales = [x.new_empty(0, dtype=torch.int8)], [x.new_empty(0, dtype=torch.float32)]
    for start in range(0, x.numel(), block):
        chunk = x[start:start + block].float()
        s = chunk.abs().max() / 127
        s = s if s.item() > 0 else torch.ones((), dtype=torch.float32)
        qs.append(torch.round(chunk / s).clamp(-127, 127).to(torch.int8))
        scales.append(s.reshape(1))
    return torch.cat(qs), torch.cat(scales)


def reference_dequantized_piece(piece: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """One parameter's padded shard on one rank, as the receivers see it after the gather."""
    pad = -piece.numel() % block
    q, s = reference_quantize(torch.cat([piece.float(), piece.new_zeros(pad, dtype=torch.float32)]), block)
    values = (q.view(-1, block).float() * s.view(-1, 1)).to(dtype).view(-1)
    return values[:piece.numel()]


sizes_st = st.lists(st.integers(0, 700), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, block=st.integers(1, 300))
def test_block_layout_blocks_stay_inside_each_piece(sizes: list[int], block: int) -> None:
    layout = BlockLayout(tuple(sizes), block)
    assert sum(layout.pieces) == layout.blocked_numel == layout.num_blocks * block
    start = 0
    for size, pad, blocks in zip(layout.pieces[0::2], layout.pieces[1::2], layout.blocks):
        assert start % block == 0  # every piece starts on a block boundary: no block straddles two
        assert 0 <= pad < block and size + pad == blocks * block
        start += size + pad
    assert layout.data_nbytes % 4 == 0 and layout.data_nbytes - layout.blocked_numel < 4
    assert layout.packed_nbytes == layout.data_nbytes + 4 * layout.num_blocks


@settings(max_examples=60, deadline=None)
@given(n_blocks=st.integers(1, 6), block=st.integers(1, 300), scale=st.floats(1e-6, 1e4),
       zero_block=st.booleans(), seed=st.integers(0, 2**16))
def test_quantize_matches_reference_and_bounds_the_error(n_blocks: int, block: int, scale: float,
                                                         zero_block: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks * block, generator=g) * scale
    if zero_block:
        x[:block] = 0
    q, s = quantize(x, block)
    ref_q, ref_s = reference_quantize(x, block)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)
    back = dequantize(q, s, block, torch.float32)
    bound = s.repeat_interleave(block) / 2 * (1 + 1e-5)
    assert bool(((back - x).abs() <= bound).all()), (back - x).abs().max()
    amax = x.view(-1, block).abs().amax(1)
    assert torch.allclose(s, torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
    if zero_block:
        assert bool((back[:block] == 0).all())


@settings(max_examples=40, deadline=None)
@given(sizes=sizes_st, block=st.integers(1, 130), world=st.integers(1, 4), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_pack_then_dequantize_every_segment_equals_the_reference(sizes: list[int], block: int, world: int,
                                                                 seed: int, dtype: torch.dtype) -> None:
    """Each rank packs its own segment; the gathered rows dequantize to each rank's reference."""
    layout = BlockLayout(tuple(sizes), block)
    g = torch.Generator().manual_seed(seed)
    gathered = torch.empty(world, layout.packed_nbytes, dtype=torch.uint8)
    segments = [[torch.randn(size, generator=g) * 0.1 for size in sizes] for _ in range(world)]
    for rank, pieces in enumerate(segments):
        parts = [t for piece, pad in zip(pieces, layout.pieces[1::2]) for t in (piece, torch.zeros(pad))]
        pack(torch.cat(parts), layout, gathered[rank])
    values = dequantize(data_view(gathered, layout), scales_view(gathered, layout), block, dtype)
    for rank, pieces in enumerate(segments):
        start = 0
        for piece, pad in zip(pieces, layout.pieces[1::2]):
            got = values[rank, start:start + piece.numel()]
            assert torch.equal(got, reference_dequantized_piece(piece, block, dtype))
            start += piece.numel() + pad


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match=r"block_size=0.*positive int"):
        QuantizedAllGather(block_size=0)
    with pytest.raises(TypeError, match=r"all_gather_policy must be an AllGatherPolicy.*QuantizedAllGather"):
        check_all_gather_policy("int8", None, 2)
    with pytest.raises(ValueError, match=r"reshard_after_forward=2.*Fix: reshard_after_forward=True or False"):
        check_all_gather_policy(QuantizedAllGather(), 2, 4)
    check_all_gather_policy(QuantizedAllGather(), 4, 4)  # k = world is a full reshard
    check_all_gather_policy(QuantizedAllGather(), True, 4)


# --- distributed -----------------------------------------------------------------------------------
def padded_rows(full: torch.Tensor, world: int, dim: int) -> list[torch.Tensor]:
    """Each rank's padded shard (shard dim first, flattened), as the flat buffer holds it."""
    moved = full.movedim(dim, 0) if full.dim() else full.reshape(1)
    per = math.ceil(moved.shape[0] / world)
    out = []
    for rank in range(world):
        rows = moved[rank * per:(rank + 1) * per].reshape(-1)
        pad = per * (moved[0].numel() if full.dim() else 1) - rows.numel()
        out.append(torch.cat([rows, rows.new_zeros(max(pad, 0))]))
    return out


@distributed(world_size=2)
def _gathered_equal_reference(block: int, bf16: bool) -> None:
    torch.manual_seed(0)
    world = dist.get_world_size()
    model = TinyGPT()
    mp = BF16 if bf16 else MixedPrecisionPolicy()
    policy = QuantizedAllGather(block_size=block)

    def placement(p: nn.Parameter) -> Shard | None:  # one Shard(1) parameter per block
        return Shard(1) if p.shape == (60, 157) else None

    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp, all_gather_policy=policy, shard_placement_fn=placement)
    fully_shard(model, mp_policy=mp, all_gather_policy=policy)
    dtype = torch.bfloat16 if bf16 else torch.float32
    masters = {n: (p.full_tensor(), p.placements[-1]) for n, p in model.named_parameters()}
    loss_fn(model(local_slice(batches(1)[0][0])), local_slice(batches(1)[0][1])).backward()  # lazy init
    for unit in [*model.blocks, model]:
        unit.unshard()
    gathered = dict(model.named_parameters())
    for name, (master, placement_) in masters.items():
        dim = placement_.dim if isinstance(placement_, Shard) else 0
        pieces = [reference_dequantized_piece(r, block, dtype) for r in padded_rows(master, world, dim)]
        if master.dim() == 0:  # replicated: rank 0's slot
            expected = pieces[0].reshape(())
        else:
            moved_shape = master.movedim(dim, 0).shape
            expected = torch.cat(pieces)[:master.numel()].view(moved_shape).movedim(0, dim)
        got = gathered[name].detach()
        assert got.dtype == dtype, (name, got.dtype)
        assert torch.equal(got, expected), (name, (got.float() - expected.float()).abs().max())
    for unit in [*model.blocks, model]:
        unit.reshard()


@pytest.mark.parametrize("block,bf16", [(64, True), (256, False), (7, True)])
def test_gathered_params_equal_reference_dequantization(block: int, bf16: bool) -> None:
    _gathered_equal_reference(block, bf16)


@distributed(world_size=2)
def _training_and_bytes() -> dict[str, float]:
    def shard(policy: QuantizedAllGather | None) -> object:
        extra = {"all_gather_policy": policy} if policy is not None else {}
        return lambda m: shard_gpt(m, mp_policy=BF16, **extra)

    out: dict[str, float] = {}
    plain, ref_losses, _ = train_pair(TinyGPT, shard(None), steps=12)  # type: ignore[arg-type]
    quant, _, _ = train_pair(TinyGPT, shard(QuantizedAllGather()), steps=12)  # type: ignore[arg-type]
    assert quant[-1] < quant[0] - 0.1, quant  # it trains (random tokens: slowly)
    gap = max(abs(a - b) / b for a, b in zip(quant, plain))
    assert gap < 0.01, (gap, quant, plain)
    out["loss_gap"] = gap
    # bytes: the profiler's counts per step, int8 + scales vs bf16; gradients unchanged (fp32 reduce).
    # dim 128: at dim 60 the 30-value norm shards would each pad a 256-value block (blocks never span
    # two parameters, design/quantized-all-gather.md); here padding + scales cost ~3.4%.
    summaries = {}
    for name, policy in (("bf16", None), ("int8", QuantizedAllGather())):
        torch.manual_seed(0)
        model = shard(policy)(TinyGPT(dim=128, hidden=384))  # type: ignore[operator]
        x, y = batches(1)[0]
        with CountCollectives() as count, profile(model) as prof:
            loss_fn(model(local_slice(x)), local_slice(y)).backward()
            prof.step()
        # one per unit (the same-call check ran at fully_shard() time)
        assert count.counts["all_gather"] == 4 + 3, count.counts
        summaries[name] = prof.summary()
    ratio = summaries["int8"]["all_gather_bytes"] / summaries["bf16"]["all_gather_bytes"]
    assert ratio <= 0.53, ratio
    assert summaries["int8"]["reduce_scatter_bytes"] == summaries["bf16"]["reduce_scatter_bytes"]
    out["ratio"] = ratio
    return out


def test_training_tracks_bf16_and_moves_at_most_053x_the_bytes() -> None:
    _training_and_bytes()


@distributed(world_size=2)
def _grads_are_reduced_in_reduce_dtype() -> None:
    """Master shards stay fp32 and the reduce-scatter moves fp32 gradients, as without the policy."""
    torch.manual_seed(0)
    ref = TinyGPT()
    model = shard_gpt(copy.deepcopy(ref), mp_policy=BF16, all_gather_policy=QuantizedAllGather(block_size=32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1)[0]
    with trace.record() as events:
        step_pair(model, ref, opt, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    rs = {e.fqn: e.nbytes for e in events if e.kind is EventKind.REDUCE_SCATTER}
    units = {fqn: state.group for fqn, state in states_under(model)}
    assert rs == {fqn: g.flat.total_numel * 4 for fqn, g in units.items()}, rs  # fp32 on the wire
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad is None
        assert p.to_local().dtype == torch.float32


def test_master_weights_and_gradients_keep_their_dtypes() -> None:
    _grads_are_reduced_in_reduce_dtype()


@distributed(world_size=2)
def _integer_params_refused() -> None:
    m = nn.Linear(4, 4)
    m.register_parameter("steps", nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False))
    with pytest.raises(ValueError, match=r"QuantizedAllGather.*steps: torch.int64.*ignored_params"):
        fully_shard(m, mp_policy=BF16, all_gather_policy=QuantizedAllGather())


def test_integer_parameters_are_refused() -> None:
    _integer_params_refused()
