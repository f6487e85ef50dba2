"""FSDP1's initialization paths: a meta-device model materialized by reset_parameters (the same values as
torch's FSDP1 on the same model), param_init_fn, and sync_module_states (rank 0's weights everywhere, also
when the other ranks built the model on the meta device: accelerate's low-RAM loading)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import FullyShardedDataParallel
from fully_shard.wrap import ModuleWrapPolicy
from tests.distributed.harness import distributed
from tests.wrap.common import full_state_dict, max_diff, torch_fsdp

FSDP = FullyShardedDataParallel


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 24), nn.Linear(24, 16))


@distributed(world_size=2)
def _meta_reset_parameters() -> dict[str, float]:
    policy = ModuleWrapPolicy({nn.Linear})
    out = {}
    for name, cls, kw in (("ours", FSDP, {}), ("torch", torch_fsdp(), {"device_id": torch.device("cpu")})):
        torch.manual_seed(3)
        with torch.device("meta"):
            model = _net()
        torch.manual_seed(5)  # reset_parameters draws from here, in FSDP1's order (units bottom-up, BFS)
        wrapped = cls(model, auto_wrap_policy=policy, **kw)
        out[name] = full_state_dict(wrapped)
    assert not any(t.is_meta for t in out["ours"].values())
    return {"diff": max_diff(out["ours"], out["torch"])}


def test_meta_model_materializes_like_torch() -> None:
    for r in _meta_reset_parameters():
        assert r["diff"] == 0.0, r


@distributed(world_size=2)
def _sync(meta: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(100)
    reference = _net()  # what rank 0 loads
    want = {k: v.detach().clone() for k, v in reference.state_dict().items()} if rank == 0 else None
    torch.manual_seed(100 + rank)  # every rank a different model...
    if meta and rank != 0:
        with torch.device("meta"):
            model = _net()
    else:
        model = _net() if rank else reference
    init = partial(nn.Module.to_empty, device=torch.device("cpu"), recurse=False) if meta else None
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), sync_module_states=True,
                   param_init_fn=init)
    got = full_state_dict(wrapped)
    objs: list[Any] = [want]
    dist.broadcast_object_list(objs, src=0)
    sharded = all(isinstance(p, DTensor) for p in wrapped.parameters())
    return {"diff": max_diff(got, objs[0]), "sharded": sharded}


def test_sync_module_states_gives_rank0_weights() -> None:
    for r in _sync(False):
        assert r["diff"] == 0.0 and r["sharded"], r


def test_sync_module_states_from_meta_with_param_init_fn() -> None:
    for r in _sync(True):
        assert r["diff"] == 0.0 and r["sharded"], r
