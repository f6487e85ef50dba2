"""fully_shard units inside torch's composable replicate(): replicate() leaves their parameters to
fully_shard (as with torch's own units), also when the user unshards them with async_op=True first;
losses, gradients and collective counts match torch's fully_shard side by side."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from tests.core.common import local_slice
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


def _run(fs: Any, async_unshard: bool) -> dict[str, Any]:
    from torch.distributed._composable.replicate import replicate
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2, zero_dim=False)
    for blk in model.blocks:
        fs(blk)
    replicate(model)  # DDP for the root's parameters, fully_shard for the blocks'
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "counts": []}
    for step, (x, y) in enumerate(batches(3, batch=4)):
        with CountCollectives() as counted:
            if async_unshard:
                handles = [blk.unshard(async_op=True) for blk in model.blocks]
                for handle in handles:
                    handle.wait()
            loss = loss_fn(model(local_slice(x)), local_slice(y))
            loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                            for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["counts"].append(dict(counted.counts))
    return out


@distributed(world_size=2)
def _side_by_side() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    return {f"{name} async={a}": _run(fs, a) for a in (False, True)
            for name, fs in (("ours", fully_shard), ("torch", torch_fully_shard))}


def test_units_inside_replicate_train_like_torch() -> None:
    for r in _side_by_side():
        for a in (False, True):
            ours, ref = r[f"ours async={a}"], r[f"torch async={a}"]
            assert max(abs(x - y) for x, y in zip(ours["losses"], ref["losses"])) < 1e-6, (ours, ref)
            assert ours["counts"] == ref["counts"], (ours["counts"], ref["counts"])
            for name, g in ours["grads"].items():
                torch.testing.assert_close(g, ref["grads"][name], atol=1e-6, rtol=0)


@distributed(world_size=2)
def _fully_shard_on_replicated() -> str:
    from torch.distributed._composable.replicate import replicate
    model = replicate(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError) as err:
        fully_shard(model)
    return f"{err.value} rank={dist.get_rank()}"


def test_fully_shard_on_a_replicated_module_is_refused() -> None:
    for msg in _fully_shard_on_replicated():
        assert "torch's replicate() was already applied" in msg and "Fix: call fully_shard on the submodules" in msg
