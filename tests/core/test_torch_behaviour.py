"""Behaviours torch's FSDP2 users depend on, side by side with torch's fully_shard: post-accumulate-
grad hooks (optimizer-in-backward), activation-checkpoint recompute under mixed precision, and
torch.func transforms through a unit."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fully_shard import MixedPrecisionPolicy
from tests.core.pairs import (
    LIBS,
    Decoder,
    ce_sum,
    full,
    global_sum,
    grads,
    max_diff,
    rank_rows,
    reference_grads,
    shard_decoder,
    tokens,
)
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.torch_ref import fails_before

TOL = 1e-6
# torch's fully_shard before 2.13: runs it fails (this library is still checked on them)
TORCH_NO_RECOMPUTE_CAST = fails_before((2, 13), "non-reentrant checkpoint recompute under mp_policy (the "
                                                 "recompute's inputs are not cast: mat1 and mat2 dtypes differ)")
TORCH_NO_FUNCTORCH = fails_before((2, 13), "torch.func transforms through a unit ('Cannot access storage of "
                                            "TensorWrapper')")


# --- register_post_accumulate_grad_hook: optimizer-in-backward ---------------------------------------
def _optimizer_in_backward(model: nn.Module, calls: Counter[str]) -> None:
    """One AdamW per parameter, stepped (and its grad freed) in the parameter's hook."""
    names = {id(p): n for n, p in model.named_parameters()}
    optims = {id(p): torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}

    def hook(p: torch.Tensor) -> None:
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, p.grad  # type: ignore[attr-defined]
        calls[names[id(p)]] += 1
        optims[id(p)].step()
        optims[id(p)].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


@distributed(world_size=2)
def _post_accumulate_grad_hooks(steps: int = 5) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Decoder()
    models = {lib: shard_decoder(copy.deepcopy(base), make()) for lib, make in LIBS.items()}
    models["ours_step"] = shard_decoder(copy.deepcopy(base), LIBS["ours"]())  # optimizer.step() after backward
    step_opt = torch.optim.AdamW(models["ours_step"].parameters(), lr=1e-2)
    calls: dict[str, Counter[str]] = {lib: Counter() for lib in LIBS}
    for lib in LIBS:
        _optimizer_in_backward(models[lib], calls[lib])
    worst = {"loss_torch": 0.0, "loss_step": 0.0}
    counts = {}
    for step in range(steps):
        x, y = tokens(4, seed=30 + step)
        losses = {}
        for lib, model in models.items():
            with CountCollectives() as c:
                loss = ce_sum(model(rank_rows(x)), rank_rows(y)) / rank_rows(y).numel()
                loss.backward()
            counts[lib] = dict(c.counts)
            losses[lib] = global_sum(loss)
            if lib in calls:  # every parameter stepped exactly once in this backward
                assert set(calls[lib].values()) == {step + 1}, calls[lib]
                assert all(p.grad is None for p in model.parameters())
        step_opt.step()
        step_opt.zero_grad()
        worst["loss_torch"] = max(worst["loss_torch"], abs(losses["ours"] - losses["torch"]))
        worst["loss_step"] = max(worst["loss_step"], abs(losses["ours"] - losses["ours_step"]))
    assert len(calls["ours"]) == len(list(base.parameters()))
    params: dict[str, dict[str, torch.Tensor | None]] = {
        lib: {n: full(p).detach() for n, p in m.named_parameters()} for lib, m in models.items()}
    worst["param_torch"] = max_diff(params["ours"], params["torch"])
    worst["param_step"] = max_diff(params["ours"], params["ours_step"])
    assert max(worst.values()) < TOL, worst
    assert counts["ours"] == counts["torch"], counts
    return worst


def test_post_accumulate_grad_hooks_run_optimizer_in_backward() -> None:
    _post_accumulate_grad_hooks()


# --- activation checkpointing under mixed precision --------------------------------------------------
class CheckpointedDecoder(Decoder):
    """Each block runs under torch.utils.checkpoint; ``seen`` logs what the block's first Linear
    receives and what the block returns, tagged with the phase. The recompute runs once the block's
    own backward starts (its unit is then in PRE_BACKWARD); without early stop it runs to the end of
    the block, through the unit's post-forward (the output_dtype cast)."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.seen: list[tuple[str, str, torch.dtype]] = []
        self._in_backward = False

    def forward(self, idx: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.tok(idx)
        for blk in self.blocks:
            h = h + checkpoint(blk, h, use_reentrant=self.use_reentrant)
        return self.head(self.norm(h))

    def watch(self) -> None:
        phase = lambda: "recompute" if self._in_backward else "forward"  # noqa: E731
        for i, blk in enumerate(self.blocks):
            blk[0].register_forward_pre_hook(  # type: ignore[index]
                lambda _m, args, i=i: self.seen.append((phase(), f"blocks.{i}.in", args[0].dtype)))
            blk.register_forward_hook(  # after fully_shard's own post-forward hook: the cast output
                lambda _m, _a, out, i=i: self.seen.append((phase(), f"blocks.{i}.out", out.dtype)))


@distributed(world_size=2)
def _checkpoint_dtypes(use_reentrant: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    base = CheckpointedDecoder(use_reentrant)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32)
    x, y = tokens(4, seed=40)
    got, seen, losses = {}, {}, {}
    skip_torch = TORCH_NO_RECOMPUTE_CAST and not use_reentrant
    for lib, make in LIBS.items() if not skip_torch else [("ours", LIBS["ours"])]:
        model = copy.deepcopy(base)
        for blk in model.blocks:
            make()(blk, mp_policy=policy)
        make()(model)
        model.watch()
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            loss = ce_sum(model(rank_rows(x)), rank_rows(y)) / rank_rows(y).numel()
            model._in_backward = True
            loss.backward()
        got[lib], seen[lib], losses[lib] = grads(model), model.seen, global_sum(loss)
    forward = [(name, dt) for phase, name, dt in seen["ours"] if phase == "forward"]
    recompute = [(name, dt) for phase, name, dt in seen["ours"] if phase == "recompute"]
    assert forward == [(f"blocks.{i}.{k}", torch.bfloat16 if k == "in" else torch.float32)
                       for i in range(2) for k in ("in", "out")], forward
    assert recompute == forward[2:] + forward[:2], (forward, recompute)  # the same dtypes, blocks reversed
    if skip_torch:  # the same sharded model without checkpointing: the same bf16 computation
        model = Decoder()
        model.load_state_dict(base.state_dict())
        for blk in model.blocks:
            LIBS["ours"]()(blk, mp_policy=policy)
        LIBS["ours"]()(model)
        (ce_sum(model(rank_rows(x)), rank_rows(y)) / rank_rows(y).numel()).backward()
        diffs = {"grad_vs_no_checkpoint": max_diff(got["ours"], grads(model))}
        assert max(diffs.values()) < TOL, diffs
        return diffs
    assert seen["ours"] == seen["torch"], seen
    diffs = {"grad": max_diff(got["ours"], got["torch"]), "loss": abs(losses["ours"] - losses["torch"])}
    assert max(diffs.values()) < TOL, diffs
    return diffs


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_sees_forward_dtypes(use_reentrant: bool) -> None:
    _checkpoint_dtypes(use_reentrant)
    if TORCH_NO_RECOMPUTE_CAST and not use_reentrant:
        pytest.skip(TORCH_NO_RECOMPUTE_CAST)


# --- torch.func transforms through units -------------------------------------------------------------
def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def _transforms(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
    out, tangent = torch.func.jvp(model, (x,), (t,))  # type: ignore[misc]
    return {
        "jvp.out": out, "jvp.tangent": tangent,
        "jacfwd": torch.func.jacfwd(model)(x[0]),
        "vmap": torch.func.vmap(model)(x.unsqueeze(1)).squeeze(1),
        "functional_call": torch.func.functional_call(model, dict(model.named_parameters()), (x,)),
        "grad": torch.func.grad(lambda z: model(z).sum())(x),
    }


@distributed(world_size=2)
def _functorch(raf: bool, bf16: bool) -> dict[str, float]:
    torch.manual_seed(0)
    base = _mlp()
    kwargs: dict[str, Any] = {"reshard_after_forward": raf}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    x, t = torch.randn(3, 8), torch.randn(3, 8)
    results, train_grads = {}, {}
    for lib, make in LIBS.items() if not TORCH_NO_FUNCTORCH else [("ours", LIBS["ours"])]:
        model = copy.deepcopy(base)
        make()(model[0], **kwargs)
        make()(model[2], **kwargs)
        make()(model, **kwargs)
        before = _transforms(model, x, t)
        model(rank_rows(x)).float().pow(2).sum().backward()  # training still works after a transform
        train_grads[lib] = grads(model)
        results[lib] = {**before, **{f"{k}.after": v for k, v in _transforms(model, x, t).items()}}
    if not bf16:  # the unsharded model's own transforms (fp32: exact up to reduction order)
        plain = _transforms(base, x, t)
        for name, want in plain.items():
            assert torch.allclose(results["ours"][name], want, atol=1e-5), name
    if TORCH_NO_FUNCTORCH:  # the training step after the transforms against the unsharded model
        ref = copy.deepcopy(base).to(torch.bfloat16 if bf16 else torch.float32)  # param_dtype's computation
        rows = x[:2]  # the rows rank_rows hands the 2 ranks (one each)
        want = reference_grads(ref, ref(rows.to(ref[0].weight.dtype)).float().pow(2).sum())
        scale = max(g.abs().max().item() for g in want.values() if g is not None)
        grad_diff = max_diff(train_grads["ours"], want) / scale  # relative: bf16 reduces in bf16
        assert grad_diff < (2e-2 if bf16 else TOL), grad_diff
        return {"grad_vs_ref": grad_diff}
    worst = max(max_diff({k: v.float()}, {k: results["torch"][k].float()}) for k, v in results["ours"].items())
    grad_diff = max_diff(train_grads["ours"], train_grads["torch"])
    assert worst < TOL and grad_diff < TOL, (worst, grad_diff)
    return {"transforms": worst, "grad": grad_diff}


@pytest.mark.parametrize(("raf", "bf16"), [(False, False), (False, True), (True, False)])
def test_functorch_transforms_through_units(raf: bool, bf16: bool) -> None:
    _functorch(raf, bf16)
    if TORCH_NO_FUNCTORCH:
        pytest.skip(TORCH_NO_FUNCTORCH)
