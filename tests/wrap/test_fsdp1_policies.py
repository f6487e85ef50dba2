"""auto_wrap_policy: torch's callables and policy objects, this library's, and FSDP1's MixedPrecision rules.

The wrappers each policy creates are the ones torch's FSDP1 creates for the same policy on the same model
(torch's own ``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy``, ``lambda_auto_wrap_policy``,
``always_wrap_policy``, ``ModuleWrapPolicy``, ``CustomPolicy`` and ours); a ``CustomPolicy`` dict overrides
that unit's arguments; BatchNorm runs in full precision in its own unit under MixedPrecision and
``buffer_dtype`` keeps buffers low-precision in forward and full in FULL state dicts, both with torch's
losses; ignored modules stay plain parameters as in torch's."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fully_shard import FullyShardedDataParallel, ShardingStrategy
from fully_shard import wrap as ours
from fully_shard.core.state import get_state
from tests.distributed.harness import distributed
from tests.wrap.common import full_state_dict, rel_diffs, torch_fsdp
from tests.wrap.note import TransformerBlock, build_model, loss_of, train

FSDP = FullyShardedDataParallel


def _policies(lib: Any) -> dict[str, Any]:
    """The same policies from ``lib`` (torch.distributed.fsdp.wrap or fully_shard.wrap)."""
    return {
        "transformer": partial(lib.transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock}),
        "size": partial(lib.size_based_auto_wrap_policy, min_num_params=5000),
        "lambda": partial(lib.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
        "always": lib.always_wrap_policy,
        "module": lib.ModuleWrapPolicy({TransformerBlock, nn.Embedding}),
        "custom": lib.CustomPolicy(lambda m: {"sharding_strategy": _SGO[lib.__name__]} if isinstance(m, nn.Embedding)
                                   else isinstance(m, TransformerBlock)),
    }


_SGO: dict[str, Any] = {"fully_shard.wrap": ShardingStrategy.SHARD_GRAD_OP}


def _wrapped(model: nn.Module) -> list[str]:
    return [n.replace("_fsdp_wrapped_module.", "").rstrip(".") for n, m in model.named_modules()
            if isinstance(m, (FSDP, torch_fsdp()))]


@distributed(world_size=2)
def _same_wrappers(name: str) -> dict[str, Any]:
    import torch.distributed.fsdp.wrap as torch_wrap
    from torch.distributed.fsdp import ShardingStrategy as TSS

    _SGO[torch_wrap.__name__] = TSS.SHARD_GRAD_OP
    theirs = torch_fsdp()(build_model(), auto_wrap_policy=_policies(torch_wrap)[name], device_id=torch.device("cpu"))
    runs = {}
    for label, policy in (("ours", _policies(ours)[name]), ("torch_policy", _policies(torch_wrap)[name])):
        model = FSDP(build_model(), auto_wrap_policy=policy)
        runs[label] = _wrapped(model)
        if name == "custom":  # the dict overrides that unit's strategy: SHARD_GRAD_OP keeps params after forward
            state = get_state(model.tok)
            assert state is not None and state.reshard_after_forward is False, state
            assert get_state(model.blocks[0]).reshard_after_forward is True  # type: ignore[union-attr]
        if name in ("transformer", "size", "custom"):
            runs[label + "_losses"] = train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(2))[0]
    if name in ("transformer", "size", "custom"):
        runs["torch_losses"] = train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2), range(2))[0]
    return {"torch": _wrapped(theirs), **runs}


@pytest.mark.parametrize("name", ["transformer", "size", "lambda", "always", "module", "custom"])
def test_policy_wraps_what_torch_wraps(name: str) -> None:
    r = _same_wrappers(name)[0]
    assert r["ours"] == r["torch_policy"] == r["torch"], r
    assert len(r["torch"]) > 1
    if "torch_losses" in r:
        assert rel_diffs(r["ours_losses"], r["torch_losses"]) <= 1e-6, r
        assert r["ours_losses"] == r["torch_policy_losses"]


class NormNet(nn.Module):
    """Blocks with a BatchNorm (FSDP1 runs it in float32 in its own unit) and a float buffer in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.GELU()) for _ in range(2))
        self.out = nn.Linear(32, 4)
        self.register_buffer("scale", torch.full((32,), 0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) * self.scale
        for blk in self.blocks:
            x = blk(x)
        return self.out(x)


def _norm_net() -> NormNet:
    torch.manual_seed(0)
    return NormNet()


def _norm_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


@distributed(world_size=2)
def _mixed_precision_rules() -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecision as TMP

    out: dict[str, Any] = {}
    policy = partial(ours.transformer_auto_wrap_policy, transformer_layer_cls={nn.Sequential})
    mp = TMP(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    for name, cls, kw in (("ours", FSDP, {}), ("torch", torch_fsdp(), {"device_id": torch.device("cpu")})):
        model = cls(_norm_net(), auto_wrap_policy=policy, mixed_precision=mp, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x, y = _norm_data(step)
            out_ = model(x)
            loss = F.cross_entropy(out_.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = losses
        out[name + "_units"] = _wrapped(model)
        sd = full_state_dict(model)
        out[name + "_dtypes"] = {k: str(v.dtype) for k, v in sd.items()}
        if name == "ours":
            bn = model.module.blocks[0].module[1]
            out["bn_in_unit"] = isinstance(bn, FSDP) and bn.module.weight.dtype == torch.float32
            out["scale_dtype"] = str(model.module.scale.dtype)
    return out


def test_batchnorm_full_precision_and_buffer_dtype_like_torch() -> None:
    r = _mixed_precision_rules()[0]
    assert r["ours_units"] == r["torch_units"] and "blocks.0.1" in r["ours_units"], r
    assert r["bn_in_unit"] and r["scale_dtype"] == "torch.bfloat16", r  # buffers at buffer_dtype in forward
    assert r["ours_dtypes"] == r["torch_dtypes"] and r["ours_dtypes"]["scale"] == "torch.float32", r
    assert rel_diffs(r["ours"], r["torch"]) <= 1e-2, r  # bf16: the same casts


@distributed(world_size=2)
def _ignored() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cls, kw in (("ours", FSDP, {}), ("torch", torch_fsdp(), {"device_id": torch.device("cpu")})):
        model = build_model()
        wrapped = cls(model, ignored_modules=[model.head], **kw)
        out[name] = train(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), range(3), clip=None)[0]
        if name == "ours":
            out["plain"] = type(model.head.weight) is nn.Parameter and isinstance(model.tok.weight, DTensor)
    local = loss_of(wrapped, 0)  # each rank's own head: as torch, ignored parameters are not synchronized
    return {**out, "local": local.item()}


def test_ignored_modules_stay_plain_like_torch() -> None:
    for r in _ignored():
        assert r["plain"] and rel_diffs(r["ours"], r["torch"]) <= 1e-6, r
