"""Meta-device init: fully_shard on meta, then materialize only the local shards, initialize them
(non-persistent buffers included), never leave NaNs, and fail loudly when something is forgotten."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from fully_shard.core.init import default_init, materialize_meta_module, meta_tensor_names
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import Block, TinyGPT
from tests.policies.common import full, train_parity


class Rotary(nn.Module):
    """A rotary-embedding table as models write it: a non-persistent buffer computed in __init__."""

    def __init__(self, dim: int = 16, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", self.compute(), persistent=False)

    def compute(self, device: torch.device | None = None) -> torch.Tensor:
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device).float() / self.dim))


class RotaryGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = Rotary()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) + 0 * self.rotary.inv_freq.sum()


def gpt_init(m: nn.Module) -> None:
    """Everything TinyGPT needs beyond reset_parameters(); gates drawn at random on purpose (they are
    replicated: materialize_meta_module must make every rank agree)."""
    if isinstance(m, TinyGPT):
        nn.init.normal_(m.pos, std=0.02)
    elif isinstance(m, Block):
        m.gate.uniform_(0.5, 1.0)
    elif isinstance(m, Rotary):
        m.inv_freq.copy_(m.compute(m.inv_freq.device))
    else:
        assert default_init(m) == "reset_parameters", type(m)


def build_meta() -> RotaryGPT:
    with torch.device("meta"):
        model = RotaryGPT()
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    return model


@distributed(world_size=2)
def _forward_before_materialize() -> str:
    model = build_meta()
    assert all(p.is_meta for p in model.parameters())
    try:
        model(torch.zeros(2, 16, dtype=torch.long))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_forward_before_materialization_names_meta_fqns() -> None:
    for msg in _forward_before_materialize():
        assert "still on the meta device: pos, tok.weight, blocks.0.gate" in msg, msg
        assert "Fix: after fully_shard" in msg


@distributed(world_size=2)
def _forgotten() -> str:
    model = build_meta()
    try:
        materialize_meta_module(model, device="cpu")  # no init_fn: pos, gates, inv_freq are missed
    except ValueError as e:
        return str(e)
    return "no error"


def test_uninitialized_tensors_are_an_error_not_nans() -> None:
    for msg in _forgotten():
        assert "nothing initialized them" in msg, msg
        for fqn in ("pos (param, not written)", "blocks.0.gate (param, not written)",
                    "rotary.inv_freq (buffer, not written)"):
            assert fqn in msg, msg
        assert "tok.weight" not in msg and "blocks.0.up.weight" not in msg  # reset_parameters did those
        assert "Fix: pass init_fn=" in msg


@distributed(world_size=2)
def _materialize() -> dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_meta()
    before = {n: id(p) for n, p in model.named_parameters()}
    with CountCollectives() as counted:
        report = materialize_meta_module(model, init_fn=gpt_init, seed=11)  # device: the mesh's (cpu)
    out: dict[str, object] = {
        "meta_left": meta_tensor_names(model), "same_objects": before == {n: id(p) for n, p in
                                                                          model.named_parameters()},
        "collectives": dict(counted.counts), "local_bytes": report.local_bytes,
        "global_bytes": report.global_bytes, "initialized": report.initialized,
        "broadcast": sorted(report.broadcast),
        "finite": all(torch.isfinite(p.to_local()).all().item() for p in model.parameters()),
        "inv_freq_ok": torch.allclose(model.rotary.inv_freq, model.rotary.compute()),
        "gate": model.blocks[0].gate.to_local().item(),
        "tok_row0": model.tok.weight.to_local()[0].detach().clone(),
        "local_rows": model.tok.weight.to_local().shape[0],
    }
    # The materialized sharded model trains like an unsharded copy of its full weights.
    ref = RotaryGPT()
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            ref_params[n].copy_(full(p))
        ref.rotary.inv_freq.copy_(model.rotary.inv_freq)
    out.update(train_parity(model, ref, steps=3, batch=4))
    out["rank"], out["world"] = rank, world
    return out


def test_materialize_allocates_shards_only_and_initializes_everything() -> None:
    results = _materialize()
    for r in results:
        assert r["meta_left"] == [] and r["same_objects"] and r["finite"] and r["inv_freq_ok"], r
        # only broadcasts of replicated tensors: never an all-gather of a sharded weight
        assert set(r["collectives"]) <= {"broadcast"}, r["collectives"]
        assert r["local_bytes"] < 0.55 * r["global_bytes"], (r["local_bytes"], r["global_bytes"])
        assert r["local_rows"] in (498, 499)
        assert r["initialized"]["rotary"] == "init_fn" and r["initialized"]["blocks.0.up"] == "init_fn"
        assert {"blocks.0.gate", "blocks.2.gate", "rotary.inv_freq"} <= set(r["broadcast"]), r["broadcast"]
        assert not any(b.endswith("up.weight") for b in r["broadcast"])  # shards are never broadcast
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r
    # replicated tensors agree; the shards of one weight are not copies of each other
    assert results[0]["gate"] == results[1]["gate"]
    assert not torch.allclose(results[0]["tok_row0"], results[1]["tok_row0"])


def test_default_init_reports_what_it_did() -> None:
    lin = nn.Linear(3, 2)
    assert default_init(lin) == "reset_parameters"
    assert default_init(nn.ReLU()) == ""


def test_materialize_single_process_plain_module() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Rotary(8))
    with pytest.raises(ValueError, match=r"1\.inv_freq \(buffer, not written\)"):
        materialize_meta_module(model, device="cpu")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Rotary(8))
    real = nn.Linear(2, 2)
    model.append(real)
    kept = real.weight.detach().clone()
    materialize_meta_module(model, device="cpu", init_fn=lambda m: gpt_init(m))
    assert torch.equal(real.weight, kept)  # already-real tensors are left alone
    assert torch.allclose(model[1].inv_freq, model[1].compute())
    assert not any(isinstance(p, DTensor) for p in model.parameters())


@distributed(world_size=2)
def _to_empty_flow() -> dict[str, object]:
    """torch's own recipe, without the helper: to_empty() then reset_parameters() per module."""
    model = build_meta()
    model.to_empty(device="cpu")  # swaps DTensor params in place (no weakrefs may block it)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (TinyGPT, Block, Rotary)):
                gpt_init(m)
            else:
                default_init(m)
        for blk in model.blocks:  # replicated: make the ranks agree by hand here
            dist.broadcast(blk.gate.to_local(), src=0)
    local = sum(p.to_local().numel() for p in model.parameters())
    ref = RotaryGPT()
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            ref_params[n].copy_(full(p))
        ref.rotary.inv_freq.copy_(model.rotary.inv_freq)
    out: dict[str, object] = dict(train_parity(model, ref, steps=3, batch=4))
    out.update(local=local, total=sum(p.numel() for p in ref.parameters()))
    return out


def test_to_empty_then_reset_parameters() -> None:
    for r in _to_empty_flow():
        assert r["local"] < 0.55 * r["total"]
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r
