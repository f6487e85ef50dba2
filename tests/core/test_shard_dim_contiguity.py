"""shard_placement_fn with Shard(1): the unsharded parameters a forward-pre-hook sees and the
gradients are contiguous, as torch's fully_shard gives them; values match torch side by side."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from fully_shard import fully_shard
from tests.core.common import local_slice
from tests.distributed.harness import distributed


def _run(fs: Any, width: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 8))
    seen: dict[str, Any] = {"params": [], "grads": []}

    def pre_hook(module: nn.Module, _: Any) -> None:
        w = module.weight
        seen["params"].append((tuple(w.shape), w.is_contiguous(), w.stride()))
        w.register_hook(lambda g: seen["grads"].append((tuple(g.shape), g.is_contiguous())))

    for lin in (model[0], model[2]):
        lin.register_forward_pre_hook(pre_hook)
    fs(model, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    x = torch.randn(4, 8)
    loss = model(local_slice(x)).square().sum()
    loss.backward()
    seen["sharded_grads"] = {n: (p.grad.to_local().is_contiguous(), p.grad.full_tensor())
                             for n, p in model.named_parameters()}
    seen["loss"] = loss.item()
    return seen


@distributed(world_size=2)
def _side_by_side() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    return {"ours": _run(fully_shard, 16), "torch": _run(torch_fully_shard, 16),
            "uneven": _run(fully_shard, 15)}  # torch needs even Shard(1); ours shards unevenly


def test_shard_1_unsharded_params_and_grads_contiguous_like_torch() -> None:
    for r in _side_by_side():
        ours, ref = r["ours"], r["torch"]
        assert ours["params"] == ref["params"], (ours["params"], ref["params"])
        assert all(contig for _, contig, _ in ours["params"]), ours["params"]
        assert ours["grads"] == ref["grads"] and all(c for _, c in ours["grads"]), ours["grads"]
        assert abs(ours["loss"] - ref["loss"]) < 1e-6
        for name, (contig, grad) in ours["sharded_grads"].items():
            ref_contig, ref_grad = ref["sharded_grads"][name]
            assert contig == ref_contig
            torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
        uneven = r["uneven"]
        assert all(contig for _, contig, _ in uneven["params"]), uneven["params"]
        assert all(c for _, c in uneven["grads"]), uneven["grads"]
