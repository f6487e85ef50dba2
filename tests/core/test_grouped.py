"""Grouped units ``fully_shard([norm, head])`` side by side with torch's fully_shard: per-member input
casts, members run on their own (chunked losses), unused members, several partial forwards."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

from fully_shard import MixedPrecisionPolicy
from tests.core.pairs import (
    DIM,
    LIBS,
    Decoder,
    ce_sum,
    decoder_pair,
    full,
    global_sum,
    grads,
    max_diff,
    rank_rows,
    reference_grads,
    tokens,
)
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.torch_ref import fails_before

TOL = 1e-6
# torch's own grouped units before 2.13: runs it fails (this library is still checked on them)
TORCH_NO_MEMBER_CAST = fails_before((2, 13), "to cast each grouped member's inputs (mat1 and mat2 dtypes differ)")
TORCH_NO_TITAN_CHUNKS = fails_before((2, 13), "torchtitan's chunked loss on a grouped unit (backward reads a "
                                               "freed parameter: 'data is not allocated yet')")
TORCH_NO_CHUNKED_ACCUMULATION = fails_before((2, 13), "accumulation over chunked partial forwards of a grouped "
                                                       "unit ('got mixed torch.Tensor and DTensor')")


def libs(torch_gap: str | None) -> dict[str, Any]:
    """``LIBS`` less torch's fully_shard where it cannot serve as the reference."""
    return {"ours": LIBS["ours"]} if torch_gap else LIBS


# --- cast_forward_inputs on every member -----------------------------------------------------------
class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float())  # an fp32 tensor between the two members


@distributed(world_size=2)
def _cast_each_member() -> dict[str, Any]:
    torch.manual_seed(0)
    base = TwoStage()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    full_x = torch.randn(4, 3, DIM)
    x = rank_rows(full_x)
    seen: dict[str, list[torch.dtype]] = {}
    got = {}
    for lib, make in libs(TORCH_NO_MEMBER_CAST).items():
        model = copy.deepcopy(base)
        make()([model.a, model.b], mp_policy=policy)
        make()(model, mp_policy=policy)
        seen[lib] = []
        for m in (model.a, model.b):  # registered after fully_shard's: they see the cast inputs
            m.register_forward_pre_hook(lambda _m, args, lib=lib: seen[lib].append(args[0].dtype))
        out = model(x)
        out.float().pow(2).mean().backward()
        got[lib] = grads(model)
        seen[lib].append(out.dtype)
    assert seen["ours"] == [torch.bfloat16] * 3, seen
    # the unsharded fp32 model: within bf16's precision
    want = reference_grads(base, base(full_x).pow(2).sum() / out.numel())
    scale = max(g.abs().max().item() for g in want.values() if g is not None)
    ref_diff = max_diff(got["ours"], want) / scale
    assert ref_diff < 2e-2, ref_diff
    if "torch" not in got:
        return {"ref_rel_diff": ref_diff}
    assert seen["torch"] == seen["ours"], seen
    diff = max_diff(got["ours"], got["torch"])
    assert diff < TOL, diff
    return {"grad_diff": diff, "ref_rel_diff": ref_diff}


def test_cast_forward_inputs_applies_to_each_member() -> None:
    _cast_each_member()
    if TORCH_NO_MEMBER_CAST:
        pytest.skip(TORCH_NO_MEMBER_CAST)


# --- a model forward that skips the head, then the head on its own per chunk ------------------------
def _rel(a: float, b: float) -> float:
    """|a - b| relative to |b| (a summed-over-ranks loss differs from the one-process loss in the
    last float bits; the gradients are compared absolutely)."""
    return abs(a - b) / max(1.0, abs(b))


def _chunks_of(h: torch.Tensor, y: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(h.chunk(n, dim=1), y.chunk(n, dim=1)))


def chunked_head_loss(model: Decoder, h: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    """The head called on its own once per sequence chunk, one graph: mean token loss."""
    return torch.stack([ce_sum(model.head(hc), yc) for hc, yc in _chunks_of(h, y, n)]).sum() / y.numel()


@distributed(world_size=2)
def _partial_then_chunks(group_raf: bool, steps: int = 3) -> dict[str, float]:
    ref, pair = decoder_pair(group_raf=group_raf)
    opts = {lib: torch.optim.SGD(m.parameters(), lr=0.5) for lib, m in pair.items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    worst = {"ref": 0.0, "torch": 0.0, "loss": 0.0, "loss_ref": 0.0}
    for step in range(steps):
        x, y = tokens(4, seed=step)
        got, losses = {}, {}
        for lib, model in pair.items():
            loss = chunked_head_loss(model, model(rank_rows(x), skip_head=True), rank_rows(y), 4)
            loss.backward()
            got[lib], losses[lib] = grads(model), global_sum(loss)
            opts[lib].step()
            opts[lib].zero_grad()
        ref_loss = ce_sum(ref(x), y) / rank_rows(y).numel()
        want = reference_grads(ref, ref_loss)
        ref_opt.step()
        worst["ref"] = max(worst["ref"], max_diff(got["ours"], want))
        worst["torch"] = max(worst["torch"], max_diff(got["ours"], got["torch"]))
        worst["loss"] = max(worst["loss"], abs(losses["ours"] - losses["torch"]))
        worst["loss_ref"] = max(worst["loss_ref"], _rel(losses["ours"], ref_loss.item()))
    assert max(worst.values()) < TOL, worst
    return worst


@pytest.mark.parametrize("group_raf", [True, False])
def test_member_runs_alone_after_partial_forward(group_raf: bool) -> None:
    _partial_then_chunks(group_raf)


# --- torchtitan's chunked loss: explicit unshard, no reshard, sync on the last chunk ----------------
def titan_chunked_loss(model: Decoder, x: torch.Tensor, y: torch.Tensor, n_chunks: int,
                       group_raf: bool) -> torch.Tensor:
    """torchtitan's ``ChunkedLossWrapper`` flow (components/loss.py), in miniature."""
    h = model(x, skip_head=True)
    head: Any = model.head
    chunks = [(hc.detach().requires_grad_(), yc) for hc, yc in _chunks_of(h, y, n_chunks)]
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    head.unshard()
    total = torch.zeros(())
    for i, (hc, yc) in enumerate(chunks):
        if i == n_chunks - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        loss = ce_sum(head(hc), yc) / y.numel()
        total = total + loss.detach()
        loss.backward()
    head.set_reshard_after_forward(group_raf)
    head.set_reshard_after_backward(True)
    head.reshard()
    h.backward(torch.cat([hc.grad for hc, _ in chunks if hc.grad is not None], dim=1))
    return total


@distributed(world_size=2)
def _titan_chunked(group_raf: bool, steps: int = 4) -> dict[str, Any]:
    ref, pair = decoder_pair(group_raf=group_raf, libs=libs(TORCH_NO_TITAN_CHUNKS))
    opts = {lib: torch.optim.AdamW(m.parameters(), lr=1e-2) for lib, m in pair.items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = {"ref": 0.0, "loss_ref": 0.0} if TORCH_NO_TITAN_CHUNKS else {"ref": 0.0, "torch": 0.0, "loss": 0.0,
                                                                         "loss_ref": 0.0}
    counts: dict[str, list[dict[str, int]]] = {lib: [] for lib in pair}
    for step in range(steps):
        x, y = tokens(4, seed=10 + step)
        got, losses = {}, {}
        for lib, model in pair.items():
            with CountCollectives() as c:
                loss = titan_chunked_loss(model, rank_rows(x), rank_rows(y), 4, group_raf)
            counts[lib].append(dict(c.counts))
            got[lib], losses[lib] = grads(model), global_sum(loss)
            opts[lib].step()
            opts[lib].zero_grad()
        ref_loss = ce_sum(ref(x), y) / rank_rows(y).numel()  # the unchunked loss
        want = reference_grads(ref, ref_loss)
        ref_opt.step()
        worst["ref"] = max(worst["ref"], max_diff(got["ours"], want))
        worst["loss_ref"] = max(worst["loss_ref"], _rel(losses["ours"], ref_loss.item()))
        if "torch" in pair:
            worst["torch"] = max(worst["torch"], max_diff(got["ours"], got["torch"]))
            worst["loss"] = max(worst["loss"], abs(losses["ours"] - losses["torch"]))
    assert max(worst.values()) < TOL, worst
    if "torch" not in pair:
        return {**worst, "counts": counts["ours"][-1]}
    # From step 2 on (step 1 carries the lazy-init checks), the same collectives as torch.
    assert counts["ours"][1:] == counts["torch"][1:], counts
    return {**worst, "counts": counts["ours"][-1]}


@pytest.mark.parametrize("group_raf", [True, False])
def test_torchtitan_chunked_loss_matches_unchunked(group_raf: bool) -> None:
    _titan_chunked(group_raf)
    if TORCH_NO_TITAN_CHUNKS:
        pytest.skip(TORCH_NO_TITAN_CHUNKS)


# --- a member no rank runs keeps grad None; two partial forwards; accumulation over chunks ----------

def _within_tol(got: dict[str, Any], want: dict[str, Any]) -> dict[str, float]:
    """Our grads against the unsharded reference's and torch's (where it ran); within TOL."""
    diffs = {"ref": max_diff(got["ours"], want)}
    if "torch" in got:
        diffs["torch"] = max_diff(got["ours"], got["torch"])
    assert max(diffs.values()) < TOL, diffs
    return diffs

@distributed(world_size=2)
def _unused_member() -> dict[str, float]:
    ref, pair = decoder_pair()
    x, _ = tokens(4, seed=3)
    got = {}
    for lib, model in pair.items():
        model(rank_rows(x), skip_head=True).pow(2).mean().backward()
        got[lib] = grads(model)
    want = reference_grads(ref, ref(x, skip_head=True).pow(2).mean() * 2)  # the sum of the rank means
    assert got["ours"]["head.weight"] is None and got["torch"]["head.weight"] is None
    assert want["head.weight"] is None
    return _within_tol(got, want)


def test_member_unused_on_every_rank_keeps_grad_none() -> None:
    _unused_member()


@distributed(world_size=2)
def _double_partial_forward() -> dict[str, float]:
    ref, pair = decoder_pair()
    (x1, _), (x2, _) = tokens(4, seed=4), tokens(4, seed=5)
    got = {}

    def loss_of(model: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (model(a, skip_head=True) * model(b, skip_head=True)).sum() / a.numel()

    for lib, model in pair.items():
        loss_of(model, rank_rows(x1), rank_rows(x2)).backward()
        got[lib] = grads(model)
    want = reference_grads(ref, loss_of(ref, x1, x2) * 2)  # the global numel is W x the local one
    assert got["ours"]["head.weight"] is None and got["torch"]["head.weight"] is None
    return _within_tol(got, want)


def test_double_partial_forward_then_backward() -> None:
    _double_partial_forward()


@distributed(world_size=2)
def _accumulate_chunked(n_micro: int = 3, n_chunks: int = 2) -> dict[str, float]:
    ref, pair = decoder_pair(libs=libs(TORCH_NO_CHUNKED_ACCUMULATION))
    micro = [tokens(4, seed=20 + i) for i in range(n_micro)]
    got = {}
    for lib, model in pair.items():
        for i, (x, y) in enumerate(micro):
            last = i == n_micro - 1
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
            model.set_is_last_backward(last)  # type: ignore[operator]
            loss = chunked_head_loss(model, model(rank_rows(x), skip_head=True), rank_rows(y), n_chunks)
            loss.backward()
        got[lib] = grads(model)
    ref_loss = torch.stack([ce_sum(ref(x), y) for x, y in micro]).sum() / rank_rows(micro[0][1]).numel()
    want = reference_grads(ref, ref_loss)
    return _within_tol(got, want)


def test_gradient_accumulation_over_chunked_partial_forwards() -> None:
    _accumulate_chunked()
    if TORCH_NO_CHUNKED_ACCUMULATION:
        pytest.skip(TORCH_NO_CHUNKED_ACCUMULATION)


# --- a fine-tuned head over a frozen trunk: each chunk its own backward, the step right after -------
@distributed(world_size=2)
def _frozen_trunk_chunks(steps: int = 3) -> dict[str, float]:
    ref, pair = decoder_pair(libs=libs(TORCH_NO_TITAN_CHUNKS))
    models = {"ref": ref, **pair}
    for model in models.values():
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(("norm", "head")))
    opts = {lib: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for lib, m in models.items()}
    world = torch.distributed.get_world_size()
    worst = {"ref": 0.0, "torch": 0.0}
    for step in range(steps):
        x, y = tokens(4, seed=step)
        for lib, model in models.items():
            rows, labels, scale = (x, y, world) if lib == "ref" else (rank_rows(x), rank_rows(y), 1)
            h = model(rows, skip_head=True).detach()
            for hc, yc in _chunks_of(h, labels, 4):  # torchtitan's chunks: leaves requiring grad
                loss = ce_sum(model.head(hc.detach().requires_grad_()), yc) / y.numel() / scale
                loss.backward()  # each backward ends in the head's unit, inside its open pass
            opts[lib].step()
            opts[lib].zero_grad()
        params = {lib: {n: full(p.detach()) for n, p in m.named_parameters()} for lib, m in models.items()}
        for other in ("ref", "torch"):
            if other in params:
                worst[other] = max(worst[other], max((params["ours"][n] - params[other][n]).abs().max().item()
                                                     for n in params["ours"]))
    return worst


def test_every_backward_leaves_complete_gradients_when_it_ends_in_a_grouped_member() -> None:
    for r in _frozen_trunk_chunks():  # against the unsharded model, and torch's fully_shard where it can
        assert r["ref"] < TOL and r["torch"] < TOL, r
    if TORCH_NO_TITAN_CHUNKS:
        pytest.skip(TORCH_NO_TITAN_CHUNKS)
