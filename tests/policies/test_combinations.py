"""Policies together on 4 ranks: bf16 compute + fp32 reduce with no-sync accumulation, under HSDP,
CPU offload and partial reshard; gradients equal the emulated unsharded reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.policies.common import Emulator, local_slice, max_grad_diff, rank_slice


@distributed(world_size=4)
def _combo(offload: bool, hsdp: bool, raf: bool | int | None) -> float:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp \
        else init_device_mesh("cpu", (4,))
    root_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)
    block_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    master = TinyGPT()
    model = copy.deepcopy(master)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=block_policy, offload_policy=offload_policy,
                    reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, mp_policy=root_policy, offload_policy=offload_policy)
    micro = batches(3, batch=8, seed=9)
    for i, (x, y) in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
    policies = {"": root_policy, **{f"blocks.{i}": block_policy for i in range(3)}}
    per_rank = [[(rank_slice(x, r, world), rank_slice(y, r, world)) for x, y in micro] for r in range(world)]
    return max_grad_diff(model, Emulator(master, policies).grads(per_rank))


@pytest.mark.parametrize(("offload", "hsdp", "raf"), [(False, True, None), (True, True, True),
                                                      (True, False, 2), (False, False, 2)])
def test_policies_compose(offload: bool, hsdp: bool, raf: bool | int | None) -> None:
    for diff in _combo(offload, hsdp, raf):
        assert diff < 1e-7, diff
