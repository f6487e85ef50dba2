"""torch.distributed.checkpoint (DCP) save/load through ``get_state_dict``/``set_state_dict``: a
model and AdamW state saved mid-training load exactly into a fresh model from another seed, which then
continues the uninterrupted run's losses; the same checkpoint also loads into torch's fully_shard
model side by side (DCP checkpoints do not depend on which FSDP2 wrote them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from tests.checkpoint.common import train_on
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches

DATA = batches(4, batch=4)


def _build(impl: str, seed: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fully_shard  # type: ignore[assignment]
    torch.manual_seed(seed)
    model = TinyGPT(n_blocks=2, zero_dim=False)  # torch's fully_shard refuses 0-dim parameters
    for blk in model.blocks:
        shard(blk)
    shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(sd: Any) -> Any:
    """The state with every DTensor gathered (a comparable snapshot, detached from the model)."""
    if isinstance(sd, dict):
        return {k: _full(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_full(v) for v in sd)
    if isinstance(sd, DTensor):
        return sd.full_tensor().clone()
    return sd.detach().clone() if isinstance(sd, torch.Tensor) else sd


def _assert_same(a: Any, b: Any, where: str) -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), (where, sorted(a), sorted(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    else:
        assert a == b, (where, a, b)


@distributed(world_size=2)
def _dcp_round_trip(path: str) -> dict[str, Any]:
    model, opt = _build("ours", seed=0)
    train_on(model, opt, DATA[:2])
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = _full((model_sd, optim_sd))
    uninterrupted = train_on(model, opt, DATA[2:])
    out: dict[str, Any] = {"uninterrupted": uninterrupted}
    for impl in ("ours", "torch"):
        fresh, fresh_opt = _build(impl, seed=1)
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = _full(get_state_dict(fresh, fresh_opt))
        _assert_same(loaded, saved, impl)  # exact: model and optimizer state
        assert all(isinstance(p, DTensor) for p in fresh.parameters())
        out[impl] = train_on(fresh, fresh_opt, DATA[2:])
    dist.barrier()
    return out


def test_dcp_get_state_dict_round_trip_and_torch_load(tmp_path: Path) -> None:
    out = _dcp_round_trip(str(tmp_path / "dcp"))[0]
    assert out["ours"] == out["uninterrupted"], out  # same library, same state: bit-identical steps
    diff = max(abs(a - b) for a, b in zip(out["torch"], out["uninterrupted"]))
    assert diff <= 1e-5, (out, diff)
