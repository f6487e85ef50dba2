"""model.to(dtype) after fully_shard: the sharded parameters are converted and the next all-gather
moves the new dtype (side by side with torch's fully_shard); a unit left with mixed dtypes is named
by its FQN."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fully_shard import fully_shard
from tests.core.common import global_mean, local_slice
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn


def _train(fs: Any, *, again: bool) -> dict[str, Any]:
    """3 SGD steps; ``model.to(float64)`` before the first forward and, with ``again``, back to
    float32 before the third (after the root kept its parameters gathered). ``fs`` None: the
    unsharded reference on the global batch."""
    torch.manual_seed(0)
    model = TinyGPT(n_blocks=2, zero_dim=False)
    if fs is not None:
        for blk in model.blocks:
            fs(blk)
        fs(model)
    part = local_slice if fs is not None else (lambda t: t)
    out: dict[str, Any] = {"losses": []}
    for step, (x, y) in enumerate(batches(3, batch=4)):
        if step == 0 or (again and step == 2):
            model.to(torch.float64 if step == 0 else torch.float32)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        logits = model(part(x))
        loss = loss_fn(logits, part(y))
        loss.backward()
        out[f"dtypes{step}"] = sorted({str(p.dtype) for p in model.parameters()} | {str(logits.dtype)})
        out[f"grads{step}"] = {n: p.grad.full_tensor() if fs is not None else p.grad
                               for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(global_mean(loss) if fs is not None else loss.item())
    return out


@distributed(world_size=2)
def _side_by_side() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    return {"ours": _train(fully_shard, again=False), "torch": _train(torch_fully_shard, again=False),
            "ours_again": _train(fully_shard, again=True),  # torch's copy-out fails on the second .to()
            "ref_again": _train(None, again=True)}


def _same(ours: dict[str, Any], ref: dict[str, Any], atol: float) -> None:
    for a, b in zip(ours["losses"], ref["losses"]):
        assert abs(a - b) < atol, (ours["losses"], ref["losses"])
    for step in range(3):
        assert ours[f"dtypes{step}"] == ref[f"dtypes{step}"], (ours[f"dtypes{step}"], ref[f"dtypes{step}"])
        for name, g in ours[f"grads{step}"].items():
            t = ref[f"grads{step}"][name]
            assert g.dtype == t.dtype, (name, g.dtype, t.dtype)
            torch.testing.assert_close(g, t, atol=atol, rtol=0)


def test_to_float64_after_fully_shard_trains_like_torch() -> None:
    for r in _side_by_side():
        assert r["ours"]["dtypes0"] == ["torch.float64"]
        _same(r["ours"], r["torch"], 1e-6)
        assert r["ours_again"]["dtypes2"] == ["torch.float32"]
        _same(r["ours_again"], r["ref_again"], 1e-5)  # sharded vs global batch: summation order


@distributed(world_size=2)
def _mixed_after_fully_shard() -> str:
    model = TinyGPT(n_blocks=2, zero_dim=False)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    model.blocks[0].up.to(torch.float64)  # a plain submodule of unit blocks.0, converted alone
    x, _ = batches(1, batch=4)[0]
    with pytest.raises(ValueError) as err:
        model(local_slice(x))
    return str(err.value)


def test_mixed_dtype_error_names_the_unit_fqn() -> None:
    for msg in _mixed_after_fully_shard():
        assert "fully_shard unit 'blocks.0' groups parameters of several dtypes" in msg, msg
        assert "blocks.0.up.weight: torch.float64" in msg and "blocks.0.down.weight: torch.float32" in msg, msg
        assert "<root>" not in msg and "Fix: pass mp_policy=MixedPrecisionPolicy(param_dtype=...)" in msg, msg
