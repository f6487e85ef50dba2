"""reshard_after_forward=k: after forward each unit stays sharded over k-rank subgroups, so backward
re-gathers inside the subgroup; parity, group sizes and the memory held between forward and backward."""

from __future__ import annotations

import copy

from fully_shard import fully_shard
from fully_shard.comm import trace
from fully_shard.comm.trace import EventKind, Phase
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.policies.common import local_slice, train_parity, unit_padded_numel


def shard_partial(model: TinyGPT, k: int) -> TinyGPT:
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=k)
    fully_shard(model)
    return model


@distributed(world_size=4)
def _partial_parity(k: int) -> dict[str, float]:
    ref = TinyGPT()
    return train_parity(shard_partial(copy.deepcopy(ref), k), ref, steps=10, batch=8)


def test_partial_reshard_k2_parity() -> None:
    for r in _partial_parity(2):
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r


@distributed(world_size=4)
def _partial_events(k: int) -> dict[str, object]:
    ref = TinyGPT()
    block_numel = [unit_padded_numel(blk.parameters(), 4) for blk in ref.blocks]
    model = shard_partial(copy.deepcopy(ref), k)
    x, y = batches(1, batch=8)[0]
    with trace.record() as fwd:
        loss = loss_fn(model(local_slice(x)), local_slice(y))
    between = []
    for blk in model.blocks:
        group = blk._fsdp.group
        between.append({"state": blk.fsdp_state_name,
                        "kept_bytes": group._partial_shard.numel() * group._partial_shard.element_size(),
                        "unsharded_alive": any(p.unsharded_allocated() for p in group.params)})
    with trace.record() as bwd:
        loss.backward()
    return {"block_bytes": [n * 4 for n in block_numel], "between": between,
            "fwd": [(e.kind, e.fqn, e.group_size, e.nbytes) for e in fwd],
            "bwd": [(e.kind, e.fqn, e.phase, e.group_size) for e in bwd],
            "after": [blk.fsdp_state_name for blk in model.blocks]}


def test_backward_gathers_in_k_rank_groups_and_keeps_k_sharded_memory() -> None:
    for r in _partial_events(2):
        for full_bytes, held in zip(r["block_bytes"], r["between"]):
            assert held["state"] == "PARTIALLY_SHARDED"
            assert not held["unsharded_alive"]
            assert held["kept_bytes"] == full_bytes // 2  # sharded over k=2 ranks, not 4 and not 1
        fwd_ag = [(fqn, size) for kind, fqn, size, _ in r["fwd"] if kind is EventKind.ALL_GATHER]
        assert sorted(fwd_ag) == sorted([("", 4)] + [(f"blocks.{i}", 4) for i in range(3)])
        reshards = {fqn: nbytes for kind, fqn, _, nbytes in r["fwd"] if kind is EventKind.RESHARD}
        assert [reshards[f"blocks.{i}"] for i in range(3)] == [b // 2 for b in r["block_bytes"]]
        bwd_ag = [(fqn, size) for kind, fqn, phase, size in r["bwd"]
                  if kind is EventKind.ALL_GATHER and phase is Phase.BACKWARD]
        assert sorted(bwd_ag) == [(f"blocks.{i}", 2) for i in range(3)], bwd_ag
        rs = [(fqn, size) for kind, fqn, _, size in r["bwd"] if kind is EventKind.REDUCE_SCATTER]
        assert len(rs) == 4 and all(size == 4 for _, size in rs)  # gradients still reduce over all 4
        assert r["after"] == ["SHARDED"] * 3
