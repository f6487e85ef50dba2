"""A DTensor made from a local tensor keeps it where it lives: CPU offload's host shards on an accelerator mesh.

``DTensor.from_local`` copies a local tensor of another device type than the mesh's to the mesh's
device; on a GPU machine CPU offload's shards, a CPU state dict and loaded shards went back to the GPU
(benchmarks/results/gpu_check.txt, 2026-12-04: ``attempting to assign a gradient with device type 'cpu' to a
tensor with device type 'cuda'``). Here the mesh says ``cuda`` while the tensors live on the CPU (this
CPU build cannot copy to CUDA, so a move would raise): every construction must keep them in place.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from tests.distributed.harness import distributed


@distributed(world_size=1)
def _devices_on_a_cuda_mesh() -> dict[str, Any]:
    from fully_shard import CPUOffloadPolicy, fully_shard
    from fully_shard.checkpoint.state_dict import offload_to_cpu
    from fully_shard.checkpoint.views import shard_like
    from fully_shard.parallel import local_dtensor

    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # the mesh's device index (no CUDA in this build)
    try:
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
        full = {k: v.clone() for k, v in model.state_dict().items()}
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        out: dict[str, Any] = {}
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor)
            out[f"param {name}"] = (str(p.to_local().device), p.device_mesh.device_type,
                                    torch.equal(p.to_local(), full[name]))
            out[f"offload_to_cpu {name}"] = str(offload_to_cpu(p).to_local().device)
            out[f"shard_like {name}"] = str(shard_like(p, full[name]).to_local().device)
        out["state_dict"] = sorted({str(v.to_local().device) for v in model.state_dict().values()})
        local_dtensor._direct = None  # the first-call check too, made on a tensor of another device type
        model0 = model[0].weight
        grad = local_dtensor.like(torch.zeros_like(model0.to_local()), model0)
        out["like"] = (str(grad.to_local().device), grad.placements == (Shard(0),), local_dtensor._direct)
        return out
    finally:
        torch.cuda.current_device = current_device


def test_local_tensors_stay_on_the_host_on_a_cuda_mesh() -> None:
    for out in _devices_on_a_cuda_mesh():
        for key, value in out.items():
            if key.startswith("param"):
                assert value == ("cpu", "cuda", True), key
            elif key == "state_dict":
                assert value == ["cpu"]
            elif key == "like":
                assert value == ("cpu", True, True)
            else:
                assert value == "cpu", key
