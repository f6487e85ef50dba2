"""Ranks that wrap the same model into different units (or build it differently) fail at the first
differing fully_shard() call with the same error on every rank: a diff naming the units' FQNs and
the fix; no abort, no hang (design/hooks.md, structure check)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import fully_shard
from tests.distributed import harness
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


def _message(fn) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="called differently across ranks") as err:
        fn()
    return str(err.value)


@distributed(world_size=2, timeout=60)
def _different_units() -> dict[str, str]:
    rank = dist.get_rank()

    def root_only_on_rank_1() -> None:  # rank 0 wraps per block, rank 1 only the root
        model = TinyGPT(n_blocks=2)
        if rank == 0:
            for blk in model.blocks:
                fully_shard(blk)
        fully_shard(model)

    def other_blocks() -> None:  # rank 0 wraps blocks 0 and 1, rank 1 blocks 0 and 2: the root differs
        model = TinyGPT(n_blocks=3)
        for i in (0, 1) if rank == 0 else (0, 2):
            fully_shard(model.blocks[i])
        fully_shard(model)

    out = {"root_only": _message(root_only_on_rank_1), "other_blocks": _message(other_blocks)}
    model = TinyGPT(n_blocks=2)  # afterwards the ranks still train together: nothing left half-done
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    x, y = batches(1, batch=2)[0]
    loss_fn(model(x[rank:rank + 1]), y[rank:rank + 1]).backward()
    return out


def test_same_model_wrapped_differently_fails_on_every_rank() -> None:
    results = _different_units()
    assert results[0] == results[1]  # the same message on every rank
    r = results[0]
    assert "-fully_shard(Block)" in r["root_only"] and "+fully_shard(TinyGPT)" in r["root_only"], r["root_only"]
    assert "+blocks.0.attn.in_proj_weight" in r["root_only"] or "+blocks.0." in r["root_only"], r["root_only"]
    diff = r["other_blocks"]
    assert "-blocks.1.up.weight: (157, 60) torch.float32 unit=blocks.1 Shard(0)" in diff, diff
    assert "+blocks.1.up.weight: (157, 60) torch.float32 unit=<this call> Shard(0)" in diff, diff
    assert "+blocks.2.up.weight: (157, 60) torch.float32 unit=blocks.2 Shard(0)" in diff, diff
    assert "Fix: build and wrap the model identically on every rank" in diff


@distributed(world_size=4, timeout=60)
def _hsdp_one_rank_differs() -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = TinyGPT(n_blocks=2, hidden=157 if dist.get_rank() != 3 else 158)  # only rank 3 (replicate 1, shard 1)
    return _message(lambda: fully_shard(model, mesh=mesh))


def test_hsdp_mismatch_on_one_rank_raises_on_all_four() -> None:
    try:
        messages = _hsdp_one_rank_differs()  # rank 3's peers see the diff; rank 0 learns it from rank 1's verdict
    finally:  # a later 4-rank test in this pool hung in DTensor.full_tensor (not root-caused): fresh pool
        pool = harness._POOLS.pop((4, "gloo"), None)
        if pool is not None:
            pool.close()
    assert "shard group rank 1 vs rank 0" in messages[2] and "+blocks.0.up.weight: (158, 60)" in messages[2]
    assert "replicate group rank 1 vs rank 0" in messages[1] and "+blocks.0.up.weight: (158, 60)" in messages[1]
    assert "in another group of this mesh" in messages[0], messages[0]
