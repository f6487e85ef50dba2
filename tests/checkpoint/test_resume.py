"""Multi-rank checkpoint tests with real fully_shard: loss continuity across world sizes, HSDP <-> 1-D,
full state dicts, consolidation, optimizer state equality."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import Replicate, Shard

from fully_shard import checkpoint
from tests.checkpoint import common as C
from tests.distributed.harness import distributed

LR = 1e-2
TOL = 2e-5


def _fresh(seed: int = 7, mesh: object = None, sharded: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model built from a *different* seed, so that only the checkpoint can make it right."""
    model = C.make_gpt(seed=seed)
    if sharded:
        C.shard(model, mesh)  # type: ignore[arg-type]
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


@distributed(world_size=2)
def _train_and_save(path: str) -> dict:
    model, opt = _fresh(seed=0)
    uninterrupted = C.train(model, opt, 0, 6)
    model, opt = _fresh(seed=0)
    first = C.train(model, opt, 0, 3)
    checkpoint.save(path, model, opt, extra={"step": 3, "rng": torch.get_rng_state(), "sched": {"lr": (LR, 0.5)}})
    cont = C.train(model, opt, 3, 3)  # the same run, continued in the same processes
    return {"uninterrupted": uninterrupted, "first": first, "continued": cont}


@distributed(world_size=3)
def _resume_w3(path: str) -> dict:
    model, opt = _fresh()
    extra = C.load_both(path, model, opt)
    assert extra["step"] == 3 and extra["sched"] == {"lr": (LR, 0.5)}, extra
    assert torch.equal(extra["rng"], torch.get_rng_state()) or extra["rng"].dtype == torch.uint8
    return {"losses": C.train(model, opt, 3, 3)}


@distributed(world_size=1)
def _resume_w1(path: str) -> dict:
    model, opt = _fresh()
    C.load_both(path, model, opt)
    return {"losses": C.train(model, opt, 3, 3)}


def _resume_plain_here(path: str) -> list[float]:
    """In the pytest process itself: no process group at all, an unwrapped nn.Module."""
    assert not torch.distributed.is_initialized()
    model, opt = _fresh(sharded=False)
    C.load_both(path, model, opt)
    return C.train(model, opt, 3, 3)


def test_loss_continuity_2_to_3_and_to_1(tmp_path: Path) -> None:
    """Train 6 on 2 ranks vs train 3 + save, then load in fresh processes on 3 ranks / 1 process + train 3."""
    path = str(tmp_path / "ckpt")
    saved = _train_and_save(path)[0]
    ref = saved["uninterrupted"][3:]
    runs = {"same processes": saved["continued"], "3 ranks": _resume_w3(path)[0]["losses"],
            "1 rank (fully_shard)": _resume_w1(path)[0]["losses"],
            "1 process (plain module, no process group)": _resume_plain_here(path)}
    assert saved["first"] == saved["uninterrupted"][:3]
    report = {name: max(abs(a - b) for a, b in zip(losses, ref)) for name, losses in runs.items()}
    print(f"\nloss continuity (steps 4-6, ref {ref}): max |diff| {report}")
    for name, diff in report.items():
        assert diff < TOL, (name, runs[name], ref)


@distributed(world_size=2)
def _full_state_dict_round_trip(tmp: str) -> dict:
    model, opt = _fresh(seed=0)
    C.train(model, opt, 0, 2)
    truth, truth_opt = C.full_state(model), C.full_optim(model, opt)
    full = checkpoint.get_model_state_dict(model, full=True, cpu_offload=True, rank0_only=True)
    osd = checkpoint.get_optimizer_state_dict(model, opt, full=True, cpu_offload=True, rank0_only=True)
    rank = torch.distributed.get_rank()
    if rank == 0:
        save_file(full, os.path.join(tmp, "full.safetensors"))
        plain = C.make_gpt(seed=3)
        plain.load_state_dict(load_file(os.path.join(tmp, "full.safetensors")))
        C.assert_same(C.full_state(plain), truth, "plain model from save_file")
        assert all(not hasattr(v, "placements") for v in full.values())
    else:
        assert full == {} and osd == {}
    # Full dicts given on rank 0 only are broadcast and sharded into a fresh wrapped model/optimizer.
    fresh, fresh_opt = _fresh()
    checkpoint.set_model_state_dict(fresh, full if rank == 0 else {}, full=True)
    checkpoint.set_optimizer_state_dict(fresh, fresh_opt, osd if rank == 0 else {}, full=True)
    C.assert_same(C.full_state(fresh), truth, "set_model_state_dict(full=True)")
    C.assert_same(C.full_optim(fresh, fresh_opt), truth_opt, "set_optimizer_state_dict(full=True)")
    # Sharded dicts: DTensors, keyed by FQN, round trip with no communication.
    sharded = checkpoint.get_model_state_dict(model)
    sharded_osd = checkpoint.get_optimizer_state_dict(model, opt)
    assert all(k.startswith(("tok", "pos", "blocks", "norm", "head")) for k in sharded_osd["state"])
    again, again_opt = _fresh()
    checkpoint.set_model_state_dict(again, sharded)
    checkpoint.set_optimizer_state_dict(again, again_opt, sharded_osd)
    C.assert_same(C.full_state(again), truth, "sharded model state dict")
    C.assert_same(C.full_optim(again, again_opt), truth_opt, "sharded optimizer state dict")
    # Both continue training identically.
    return {"a": C.train(model, opt, 2, 2), "b": C.train(fresh, fresh_opt, 2, 2), "c": C.train(again, again_opt, 2, 2)}


def test_full_state_dict_round_trip(tmp_path: Path) -> None:
    out = _full_state_dict_round_trip(str(tmp_path))[0]
    assert out["a"] == out["b"] == out["c"], out


@distributed(world_size=2)
def _save_trained(path: str) -> dict:
    model, opt = _fresh(seed=0)
    C.train(model, opt, 0, 2)
    checkpoint.save(path, model, opt)
    return {"state": C.full_state(model)}


def test_consolidate_equals_trained_weights(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    truth = _save_trained(path)[0]["state"]
    out = checkpoint.consolidate(path, tmp_path / "hf")
    assert [os.path.basename(p) for p in out] == ["model.safetensors"]
    C.assert_same(load_file(out[0]), truth, "consolidated model.safetensors")
    from safetensors import safe_open

    with safe_open(out[0], "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers requires
    # Several output files + the Hugging Face index; at most max_shard_bytes per file.
    limit = 200_000
    out = checkpoint.consolidate(path, tmp_path / "hf", max_shard_bytes=limit)
    names = [os.path.basename(p) for p in out]
    assert names[-1] == "model.safetensors.index.json" and len(names) > 3
    assert "model.safetensors" not in os.listdir(tmp_path / "hf")  # the single-file output was replaced
    index = json.loads(Path(out[-1]).read_text())
    merged: dict[str, torch.Tensor] = {}
    for shard in out[:-1]:
        part = load_file(shard)
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= limit
        merged.update(part)
        assert all(index["weight_map"][k] == os.path.basename(shard) for k in part)
    C.assert_same(merged, truth, "sharded consolidation")
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in truth.values())


@distributed(world_size=4)
def _hsdp_round_trip(tmp: str) -> dict:
    hsdp = C.hsdp_mesh(2, 2)
    model, opt = _fresh(seed=0, mesh=hsdp)
    assert tuple(next(iter(model.parameters())).placements) == (Replicate(), Shard(0))  # type: ignore[attr-defined]
    C.train(model, opt, 0, 2)
    truth, truth_opt = C.full_state(model), C.full_optim(model, opt)
    checkpoint.save(os.path.join(tmp, "hsdp"), model, opt, extra={"step": 2})
    flat, flat_opt = _fresh()  # 1-D mesh over the 4 ranks
    assert C.load_both(os.path.join(tmp, "hsdp"), flat, flat_opt) == {"step": 2}
    C.assert_same(C.full_state(flat), truth, "HSDP -> 1-D model")
    C.assert_same(C.full_optim(flat, flat_opt), truth_opt, "HSDP -> 1-D optimizer")
    checkpoint.save(os.path.join(tmp, "flat"), flat, flat_opt)
    back, back_opt = _fresh(mesh=hsdp)
    C.load_both(os.path.join(tmp, "flat"), back, back_opt)
    C.assert_same(C.full_state(back), truth, "1-D -> HSDP model")
    C.assert_same(C.full_optim(back, back_opt), truth_opt, "1-D -> HSDP optimizer")
    losses = [C.train(m, o, 2, 2) for m, o in ((model, opt), (flat, flat_opt), (back, back_opt))]
    return {"losses": losses}


def test_hsdp_to_1d_and_back(tmp_path: Path) -> None:
    out = _hsdp_round_trip(str(tmp_path))[0]
    a, b, c = out["losses"]
    assert max(abs(x - y) for x, y in zip(a + a, b + c)) < TOL, out
    # Replicas are written once: the stored bytes are the logical bytes (plus headers), on every rank.
    for name in ("hsdp", "flat"):
        index = json.loads((tmp_path / name / "index.json").read_text())
        logical = 0
        for entry in index["model"].values():
            n = 4
            for s in entry["shape"]:
                n *= s
            logical += n
        stored = sum(f["size"] for k, f in index["files"].items() if k.startswith("model-"))
        assert logical <= stored < logical + 4 * 64 * 1024, (name, logical, stored)
        ranks = {f["rank"] for f in index["files"].values()}
        assert ranks == {0, 1, 2, 3}, ranks  # every rank shares the writing, replicas included


@distributed(world_size=2)
def _left_unsharded(tmp: str) -> None:
    """reshard_after_forward=False leaves plain unsharded params registered after a forward: still sharded I/O."""
    from fully_shard import fully_shard

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = C.make_gpt(seed=seed)
        for blk in model.blocks:
            fully_shard(blk, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    model, opt = build(0)
    C.train(model, opt, 0, 1)
    truth, truth_opt = C.full_state(model), C.full_optim(model, opt)
    with torch.no_grad():
        model(torch.zeros(2, 16, dtype=torch.long))  # leaves the units unsharded
    checkpoint.save(os.path.join(tmp, "c"), model, opt)
    assert all(hasattr(v, "placements") for k, v in checkpoint.get_model_state_dict(model).items() if k != "calib")
    fresh, fresh_opt = build(5)
    with torch.no_grad():
        fresh(torch.zeros(2, 16, dtype=torch.long))
    C.load_both(os.path.join(tmp, "c"), fresh, fresh_opt)
    C.assert_same(C.full_state(fresh), truth, "model")
    C.assert_same(C.full_optim(fresh, fresh_opt), truth_opt, "optimizer")
    index = json.loads(Path(tmp, "c", "index.json").read_text())
    assert len(index["model"]["tok.weight"]["chunks"]) == 2  # saved sharded, not as replicated full tensors


def test_save_and_load_while_units_are_unsharded(tmp_path: Path) -> None:
    _left_unsharded(str(tmp_path))
