"""Bad input to the policy layer: each raises a clear error naming the argument and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fully_shard import MixedPrecisionPolicy, ShardingStrategy, fully_shard
from fully_shard.optim.clip import clip_grad_norm_
from fully_shard.wrap import strategy_kwargs
from tests.distributed.harness import distributed
from tests.models import TinyGPT


def _message(fn: object, *args: object, **kwargs: object) -> str:
    try:
        fn(*args, **kwargs)  # type: ignore[operator]
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@distributed(world_size=4)
def _bad_meshes() -> dict[str, str]:
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (4,))
    wide = DeviceMesh("cpu", torch.arange(4).view(1, 4), mesh_dim_names=("replicate", "shard"))
    half = DeviceMesh("cpu", torch.arange(2))  # ranks 0-1 of a 4-rank world
    return {
        "full_shard_2d": _message(strategy_kwargs, ShardingStrategy.FULL_SHARD, mesh=hsdp),
        "grad_op_2d": _message(strategy_kwargs, ShardingStrategy.SHARD_GRAD_OP, mesh=hsdp),
        "hybrid_none": _message(strategy_kwargs, ShardingStrategy.HYBRID_SHARD),
        "hybrid_1d": _message(strategy_kwargs, ShardingStrategy.HYBRID_SHARD, mesh=flat),
        "hybrid_1x4": _message(strategy_kwargs, ShardingStrategy.HYBRID_SHARD, mesh=wide),
        "no_shard_2x2": _message(strategy_kwargs, ShardingStrategy.NO_SHARD, mesh=hsdp),
        "too_small": _message(strategy_kwargs, ShardingStrategy.FULL_SHARD, mesh=half),
        "k3_of_4": _message(fully_shard, TinyGPT().blocks[0], reshard_after_forward=3),
        "k3_hsdp": _message(fully_shard, TinyGPT().blocks[0], mesh=hsdp, reshard_after_forward=4),
    }


def test_bad_meshes_and_partial_reshard() -> None:
    for r in _bad_meshes():
        assert "ShardingStrategy.FULL_SHARD shards over a 1-D mesh, got a 2-D mesh of shape (2, 2)" in \
            r["full_shard_2d"] and "Fix: use ShardingStrategy.HYBRID_SHARD" in r["full_shard_2d"]
        assert "SHARD_GRAD_OP shards over a 1-D mesh" in r["grad_op_2d"]
        assert "HYBRID_SHARD needs a 2-D mesh ('replicate', 'shard'), got no mesh" in r["hybrid_none"]
        assert "got a 1-D mesh of shape (4,)" in r["hybrid_1d"] and "Fix: mesh=init_device_mesh" in r["hybrid_1d"]
        assert "mesh of shape (1, 4) is really FULL_SHARD" in r["hybrid_1x4"]
        assert "NO_SHARD replicates parameters, but the mesh of shape (2, 2) shards them over 2" in \
            r["no_shard_2x2"]
        assert "mesh of shape (2,) has 2 ranks and the world has 4" in r["too_small"], r["too_small"]
        assert "reshard_after_forward=3 must divide the shard group size 4" in r["k3_of_4"]
        assert "Fix: use one of [1, 2, 4]" in r["k3_of_4"]
        assert "reshard_after_forward=4 must divide the shard group size 2" in r["k3_hsdp"], r["k3_hsdp"]


@distributed(world_size=2)
def _mixed_dtypes() -> dict[str, str]:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4).to(torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).to(torch.bfloat16))

    bad = _message(fully_shard, Mixed())
    ok = fully_shard(Mixed(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out = ok(torch.ones(2, 4))
    return {"bad": bad, "ok_dtype": str(out.dtype), "rank": str(dist.get_rank())}


def test_mixed_dtypes_need_param_dtype() -> None:
    for r in _mixed_dtypes():
        assert "groups parameters of several dtypes" in r["bad"], r["bad"]
        assert "a.weight: torch.float32" in r["bad"] and "b.weight: torch.bfloat16" in r["bad"]
        assert "Fix: pass mp_policy=MixedPrecisionPolicy(param_dtype=...)" in r["bad"]
        assert r["ok_dtype"] == "torch.bfloat16"


def test_strategy_must_be_the_enum() -> None:
    with pytest.raises(TypeError, match=r"strategy must be a ShardingStrategy, got 'full_shard'"):
        strategy_kwargs("full_shard")  # type: ignore[arg-type]


def test_clip_max_norm_must_be_positive() -> None:
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"max_norm must be > 0, got -0.5"):
        clip_grad_norm_([p], -0.5)
    with pytest.raises(TypeError, match=r"max_norm must be a positive number, got 'big'"):
        clip_grad_norm_([p], "big")  # type: ignore[arg-type]
