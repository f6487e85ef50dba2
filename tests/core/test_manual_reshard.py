"""Manual ``reshard()`` of units built with ``reshard_after_forward=False``, side by side with torch's fully_shard.

torch's own ``test_manual_reshard_with_reshard_after_forward_false`` (test_fully_shard_comm.py): after the
forward, ``reshard()`` on every unit frees the gathered parameters, and the backward gathers each unit
again (one all-gather per unit) and reduce-scatters each once. Counted here at the dispatcher with
``CountCollectives`` (design/data-path.md: on gloo this library issues a unit's reduce-scatter as an
in-place all-reduce of its own input, so torch's test, which counts ``_reduce_scatter_base_`` with
``CommDebugMode``, reads 0 there; ``counts`` names it a reduce-scatter, ``issued`` keeps what went to gloo)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import FSDPModule, fully_shard
from fully_shard.core.state import get_state
from tests.core.common import local_slice
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


def _units(model: nn.Module, module_type: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, module_type)]


def _run(shard: Callable[..., Any], module_type: type) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2, zero_dim=False)  # torch's fully_shard shards no 0-dim parameter
    for blk in model.blocks:
        shard(blk, reshard_after_forward=False)
    shard(model, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {"steps": []}
    for x, y in batches(2, batch=4):
        with CountCollectives() as fwd:
            loss = loss_fn(model(local_slice(x)), local_slice(y))
        gathered = sum(not isinstance(p, DTensor) for p in model.parameters())  # raf=False: all still gathered
        for unit in _units(model, module_type):
            unit.reshard()
        registered_sharded = all(isinstance(p, DTensor) for p in model.parameters())
        freed = None
        if shard is fully_shard:  # ours: every unsharded storage given back
            freed = all(not p.unsharded_allocated() for u in _units(model, module_type)
                        for g in get_state(u).groups for p in g.params)  # type: ignore[union-attr]
        with CountCollectives() as bwd:
            loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["steps"].append({"fwd": dict(fwd.counts), "bwd": dict(bwd.counts), "bwd_issued": dict(bwd.issued),
                             "loss": loss.detach(), "grads": grads, "gathered": gathered,
                             "registered_sharded": registered_sharded, "freed": freed})
    out["units"] = len(_units(model, module_type))
    return out


@distributed(world_size=2)
def _side_by_side() -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return {"ours": _run(fully_shard, FSDPModule), "torch": _run(torch_fully_shard, TorchFSDPModule)}


def test_manual_reshard_after_forward_false_regathers_in_backward_as_torch() -> None:
    for rank, out in enumerate(_side_by_side()):
        ours, ref = out["ours"], out["torch"]
        units = ours["units"]
        assert units == ref["units"] == 3, (ours["units"], ref["units"])
        for step, (mine, theirs) in enumerate(zip(ours["steps"], ref["steps"])):
            where = (rank, step)
            assert mine["fwd"] == theirs["fwd"] == {"all_gather": units}, (where, mine["fwd"], theirs["fwd"])
            assert mine["gathered"] == theirs["gathered"] > 0, (where, mine["gathered"], theirs["gathered"])
            assert mine["registered_sharded"] and theirs["registered_sharded"], where
            assert mine["freed"], where  # the memory the user asked back
            # one all-gather per unit again in backward (torch's test), one reduce-scatter per unit
            assert mine["bwd"] == theirs["bwd"] == {"all_gather": units, "reduce_scatter": units}, \
                (where, mine["bwd"], theirs["bwd"])
            assert mine["bwd_issued"] == {"all_gather": units, "all_reduce": units}, (where, mine["bwd_issued"])
            assert torch.equal(mine["loss"], theirs["loss"]), (where, mine["loss"], theirs["loss"])
            for name, grad in theirs["grads"].items():
                assert torch.equal(mine["grads"][name], grad), (where, name)
