"""FSDP x tensor parallel on a (dp=2, tp=2) mesh of 4 gloo ranks: 2-D DTensor parameters against torch's
fully_shard on the same TP model and data, and against one unsharded model on the global batch.

Each rank function runs several checks in one pass (a pool call costs more than a check)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor

from fully_shard import MixedPrecisionPolicy, clip_grad_norm_, fully_shard, materialize_meta_module
from tests.distributed.harness import distributed
from tests.parallel.tp_common import (
    DIM,
    SpmdMLP,
    TPModel,
    data,
    dp_slice,
    fresh_pair,
    full,
    global_loss,
    loss_fn,
    max_diff_to,
    mesh_2d,
    sequence_parallel,
    shard_2d,
    spmd_reference,
    spmd_reference_forward,
    tensor_parallel,
)
from tests.torch_ref import lacks_name

STEPS = 5
TIMEOUT_S = 300  # each rank function takes ~5-20 s on an idle machine; DTensor dispatch slows ~10x under load
TORCH_NO_DP_DIMS = lacks_name("torch.distributed.fsdp", "DataParallelMeshDims")


def _torch_fully_shard() -> Any:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard


def _layout(model: nn.Module) -> dict[str, tuple[tuple[Any, ...], tuple[int, ...]]]:
    return {n: (tuple(p.placements), tuple(p.shape)) for n, p in model.named_parameters()}


def _local_diff(a: nn.Module, b: nn.Module, grads: bool = False) -> float:
    other = dict(b.named_parameters())
    worst = 0.0
    for n, p in a.named_parameters():
        x, y = (p.grad, other[n].grad) if grads else (p, other[n])
        worst = max(worst, (x.to_local().float() - y.to_local().float()).abs().max().item())
    return worst


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, mesh: Any) -> float:
    loss = loss_fn(model(dp_slice(x, mesh)), dp_slice(y, mesh))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return global_loss(loss, mesh)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


# --- parity: torch's fully_shard and the unsharded reference ----------------------------------------
@distributed(world_size=4, timeout=TIMEOUT_S)
def _parity() -> dict[str, Any]:
    mesh = mesh_2d()
    base, ref = fresh_pair()
    ours = shard_2d(tensor_parallel(copy.deepcopy(base), mesh["tp"]), fully_shard, mesh["dp"])
    theirs = shard_2d(tensor_parallel(copy.deepcopy(base), mesh["tp"]), _torch_fully_shard(), mesh["dp"])
    out: dict[str, Any] = {"layout": _layout(ours), "torch_layout": _layout(theirs),
                           "init_local_diff": _local_diff(ours, theirs), "init_full_diff": max_diff_to(ours, base),
                           "repr": ours.fsdp_repr()}  # type: ignore[operator]
    opt_ours, opt_theirs, opt_ref = _adamw(ours), _adamw(theirs), _adamw(ref)
    paths: list[str] = []  # the local-shard step (optimizer.py) hands step() a stand-in optimizer
    opt_ours.register_step_pre_hook(lambda o, args, kw: paths.append("dtensor" if args[0] is o else "local"))
    sd = ours.state_dict()
    sd_local = {k: (v.to_local().data_ptr(), tuple(v.to_local().shape)) for k, v in sd.items()}
    losses = []
    for i, (x, y) in enumerate(data(STEPS)):
        l_ours = loss_fn(ours(dp_slice(x, mesh)), dp_slice(y, mesh))
        l_theirs = loss_fn(theirs(dp_slice(x, mesh)), dp_slice(y, mesh))
        l_ref = loss_fn(ref(x), y)
        for loss in (l_ours, l_theirs, l_ref):
            loss.backward()
        if i == 0:
            out["grad_placements"] = {n: tuple(p.grad.placements) for n, p in ours.named_parameters()}
            out["torch_grad_placements"] = {n: tuple(p.grad.placements) for n, p in theirs.named_parameters()}
            out["grad_local_diff"] = _local_diff(ours, theirs, grads=True)
            ref_grads = dict(ref.named_parameters())
            out["grad_ref_diff"] = max((full(p.grad) - ref_grads[n].grad).abs().max().item()
                                       for n, p in ours.named_parameters())
        for opt in (opt_ours, opt_theirs, opt_ref):
            opt.step()
            opt.zero_grad()
        losses.append((global_loss(l_ours, mesh), global_loss(l_theirs, mesh), l_ref.item()))
    out["losses"] = losses
    out["paths"] = paths
    out["final_local_diff"] = _local_diff(ours, theirs)
    out["final_ref_diff"] = max_diff_to(ours, ref)
    sd_after = ours.state_dict()
    out["sd_stable"] = all((v.to_local().data_ptr(), tuple(v.to_local().shape)) == sd_local[k]
                           for k, v in sd_after.items())
    out["sd_keys_equal_torch"] = sorted(sd_after) == sorted(theirs.state_dict())
    # load_state_dict into a fresh 2-D model: every local shard equal
    torch.manual_seed(5)
    fresh = shard_2d(tensor_parallel(TPModel(), mesh["tp"]), fully_shard, mesh["dp"])
    fresh.load_state_dict(sd_after)
    out["load_diff"] = _local_diff(fresh, ours)
    return out


def test_parity_with_torch_and_unsharded() -> None:
    for r in _parity():
        assert r["layout"] == r["torch_layout"]  # placements and global shapes, every parameter
        assert r["init_local_diff"] == 0.0 and r["init_full_diff"] == 0.0, r
        assert r["grad_placements"] == r["torch_grad_placements"]
        assert r["grad_placements"]["blocks.0.up.weight"][0].__class__.__name__ == "_StridedShard"
        assert r["grad_local_diff"] < 1e-6 and r["grad_ref_diff"] < 1e-5, r
        for ours, theirs, ref in r["losses"]:
            assert abs(ours - theirs) < 1e-5, r["losses"]
            assert abs(ours - ref) < 2e-5, r["losses"]
        assert r["losses"][-1][0] < r["losses"][0][0] - 0.1, r["losses"]  # it trains
        assert r["final_local_diff"] < 1e-5 and r["final_ref_diff"] < 1e-4, r
        assert r["paths"] == ["dtensor"] + ["local"] * (STEPS - 1), r["paths"]  # 2-D params step locally
        assert r["sd_stable"] and r["sd_keys_equal_torch"] and r["load_diff"] == 0.0, r
        assert "blocks.0.up.weight f32[42@shard/2@tp/2, 32] SHARDED (_StridedShard" in r["repr"], r["repr"]
        assert "blocks.0.down.bias f32[32@shard/2] SHARDED (Shard(dim=0), Replicate())" in r["repr"], r["repr"]


# --- mixed precision, reshard_after_forward=False, no-sync accumulation, clipping -------------------
@distributed(world_size=4, timeout=TIMEOUT_S)
def _variants() -> dict[str, Any]:
    mesh = mesh_2d()
    out: dict[str, Any] = {}
    batches = data(3)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name, kw in (("bf16", {"mp_policy": mp}), ("raf_false", {"reshard_after_forward": False})):
        base, _ = fresh_pair()
        ours = shard_2d(tensor_parallel(copy.deepcopy(base), mesh["tp"]), fully_shard, mesh["dp"], **kw)
        theirs = shard_2d(tensor_parallel(copy.deepcopy(base), mesh["tp"]), _torch_fully_shard(), mesh["dp"], **kw)
        o1, o2 = _adamw(ours), _adamw(theirs)
        out[name] = [(_step(ours, o1, x, y, mesh), _step(theirs, o2, x, y, mesh)) for x, y in batches]
        out[name + "_diff"] = _local_diff(ours, theirs)
    # sequence parallel: Replicate() LayerNorm weights with Partial gradients (all-reduced over tp first)
    base, ref = fresh_pair()
    ours = shard_2d(sequence_parallel(copy.deepcopy(base), mesh["tp"]), fully_shard, mesh["dp"])
    theirs = shard_2d(sequence_parallel(copy.deepcopy(base), mesh["tp"]), _torch_fully_shard(), mesh["dp"])
    out["sp_layout"], out["sp_torch_layout"] = _layout(ours), _layout(theirs)
    o1, o2, o3 = _adamw(ours), _adamw(theirs), _adamw(ref)
    out["sp"] = []
    for x, y in batches:
        loss_ref = loss_fn(ref(x), y)
        loss_ref.backward()
        o3.step()
        o3.zero_grad()
        out["sp"].append((_step(ours, o1, x, y, mesh), _step(theirs, o2, x, y, mesh), loss_ref.item()))
    out["sp_diff"] = _local_diff(ours, theirs)
    # no-sync: two micro-batches, the first without gradient sync, vs the unsharded model on both
    base, ref = fresh_pair()
    ours = shard_2d(tensor_parallel(copy.deepcopy(base), mesh["tp"]), fully_shard, mesh["dp"])
    (x1, y1), (x2, y2) = batches[:2]
    ours.set_requires_gradient_sync(False)  # type: ignore[operator]
    loss_fn(ours(dp_slice(x1, mesh)), dp_slice(y1, mesh)).backward()
    out["no_sync_grads"] = sum(p.grad is not None for p in ours.parameters())
    ours.set_requires_gradient_sync(True)  # type: ignore[operator]
    loss_fn(ours(dp_slice(x2, mesh)), dp_slice(y2, mesh)).backward()
    (loss_fn(ref(x1), y1) + loss_fn(ref(x2), y2)).backward()
    ref_params = dict(ref.named_parameters())
    out["no_sync_diff"] = max((full(p.grad) - ref_params[n].grad).abs().max().item()
                              for n, p in ours.named_parameters())
    # clip_grad_norm_: one total norm over dp x tp, equal to the unsharded model's
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    norm = clip_grad_norm_(ours.parameters(), max_norm=0.5)
    out["norm"], out["ref_norm"] = norm.item(), ref_norm.item()
    out["clipped_diff"] = max((full(p.grad) - ref_params[n].grad).abs().max().item()
                              for n, p in ours.named_parameters())
    return out


def test_mixed_precision_raf_no_sync_clip() -> None:
    for r in _variants():
        for name in ("bf16", "raf_false"):
            for ours, theirs in r[name]:
                assert abs(ours - theirs) < 1e-5, (name, r[name])
            assert r[name + "_diff"] < 1e-5, (name, r)
        assert r["sp_layout"] == r["sp_torch_layout"], r
        assert r["sp_layout"]["blocks.0.norm1.weight"][0] == (Shard(0), Replicate()), r["sp_layout"]
        for ours, theirs, ref in r["sp"]:
            assert abs(ours - theirs) < 1e-5 and abs(ours - ref) < 2e-5, r["sp"]
        assert r["sp_diff"] < 1e-5, r
        assert r["no_sync_grads"] == 0, r  # nothing reduced while sync is off
        assert r["no_sync_diff"] < 1e-5, r
        assert r["norm"] > 0.5 and abs(r["norm"] - r["ref_norm"]) < 1e-5, r
        assert r["clipped_diff"] < 1e-6, r


# --- meta-device init, DCP get_state_dict/set_state_dict ---------------------------------------------
@distributed(world_size=4, timeout=TIMEOUT_S)
def _meta_and_dcp(path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = mesh_2d()
    out: dict[str, Any] = {}
    with torch.device("meta"):
        meta = TPModel()
    model = shard_2d(tensor_parallel(meta, mesh["tp"]), fully_shard, mesh["dp"])
    out["meta_layout"] = _layout(model)
    report = materialize_meta_module(model)
    out["broadcast"] = sorted(report.broadcast)
    # the replicated-over-tp biases agree across tp ranks after init
    bias = model.blocks[0].down.bias.to_local()  # type: ignore[union-attr,index]
    every = [torch.empty_like(bias) for _ in range(2)]
    dist.all_gather(every, bias, group=mesh["tp"].get_group())
    out["tp_replicas_agree"] = torch.equal(every[0], every[1])
    # an unsharded copy of the materialized model trains identically
    ref = TPModel()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(full(dict(model.named_parameters())[n]))
    opt, opt_ref = _adamw(model), _adamw(ref)
    batches = data(4)
    out["meta_losses"] = []
    for x, y in batches[:2]:
        loss_ref = loss_fn(ref(x), y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        out["meta_losses"].append((_step(model, opt, x, y, mesh), loss_ref.item()))
    # module.to_empty() + reset_parameters(): the sharded parameters are re-read at lazy init
    with torch.device("meta"):
        meta = TPModel(n_blocks=1)
    empty = shard_2d(tensor_parallel(meta, mesh["tp"]), fully_shard, mesh["dp"]).to_empty(device="cpu")
    torch.manual_seed(1)  # the same stream on every rank: replicas agree
    for m in empty.modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            m.reset_parameters()
    empty_ref = TPModel(n_blocks=1)
    with torch.no_grad():
        for n, p in empty_ref.named_parameters():
            p.copy_(full(dict(empty.named_parameters())[n]))
    x, y = batches[0]
    out["to_empty"] = (_step(empty, _adamw(empty), x, y, mesh), loss_fn(empty_ref(x), y).item())
    # DCP round trip of model + optimizer, then resume: a fresh 2-D model continues the same losses
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    torch.manual_seed(3)
    other = shard_2d(tensor_parallel(TPModel(), mesh["tp"]), fully_shard, mesh["dp"])
    opt_other = _adamw(other)
    _step(other, opt_other, *batches[0], mesh)  # create optimizer state to load into
    msd2, osd2 = get_state_dict(other, opt_other)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(other, opt_other, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["dcp_param_diff"] = _local_diff(other, model)
    exp = [opt.state[p]["exp_avg"] for p in model.parameters()]
    exp_other = [opt_other.state[p]["exp_avg"] for p in other.parameters()]
    out["dcp_state_diff"] = max((a.to_local() - b.to_local()).abs().max().item() for a, b in zip(exp, exp_other))
    out["resume"] = [(_step(model, opt, x, y, mesh), _step(other, opt_other, x, y, mesh)) for x, y in batches[2:]]
    return out


def test_meta_init_and_dcp(tmp_path: Any) -> None:
    path = str(tmp_path / "dcp")
    results = _meta_and_dcp(path)
    base, _ = fresh_pair()
    for r in results:
        assert {n: pl for n, (pl, _) in r["meta_layout"].items()}  # laid out on meta already
        assert {"blocks.0.down.bias", "blocks.0.norm1.weight", "tok.weight"} <= set(r["broadcast"]), r
        assert "blocks.0.up.weight" not in r["broadcast"], r
        assert r["tp_replicas_agree"], r
        for ours, ref in r["meta_losses"]:
            assert abs(ours - ref) < 2e-5, r["meta_losses"]
        assert r["dcp_param_diff"] == 0.0 and r["dcp_state_diff"] == 0.0, r
        assert abs(r["to_empty"][0] - r["to_empty"][1]) < 2e-5, r["to_empty"]
        for a, b in r["resume"]:
            assert abs(a - b) < 2e-5, r["resume"]


# --- bad input: clear errors naming the parameter and the fix, on every rank -----------------------
def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@distributed(world_size=4, timeout=TIMEOUT_S)
def _bad_inputs() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = mesh_2d()
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    out = {}
    blk = tensor_parallel(TPModel(n_blocks=1), other["y"]).blocks[0]
    out["other_root"] = _error(lambda: fully_shard(blk, mesh=mesh["dp"]))
    blk = tensor_parallel(TPModel(n_blocks=1), mesh["tp"]).blocks[0]
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    out["overlap_1d"] = _error(lambda: fully_shard(blk, mesh=world))
    out["overlap_names"] = _error(lambda: fully_shard(blk, mesh=mesh))
    mesh41 = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp4", "tp1"))
    blk = tensor_parallel(TPModel(n_blocks=1), mesh41["tp1"]).blocks[0]
    out["raf_int"] = _error(lambda: fully_shard(blk, mesh=mesh41["dp4"], reshard_after_forward=2))
    # the two dp replicas tensor-parallelize 'up' differently: the same-call check sees the placements
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    style = ColwiseParallel() if mesh["dp"].get_local_rank() == 0 else RowwiseParallel()
    blk = TPModel(n_blocks=1).blocks[0]
    parallelize_module(blk, mesh["tp"], {"up": style})
    try:
        fully_shard(blk, mesh=mesh["dp"])
        out["plan_mismatch"] = "no error"
    except RuntimeError as e:
        out["plan_mismatch"] = str(e)
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh["tp"], [Partial()]))
    out["partial"] = _error(lambda: fully_shard(lin, mesh=mesh["dp"]))
    lin = nn.Linear(4, 4)
    out["spmd_plain"] = _error(lambda: fully_shard(lin, mesh=mesh, dp_mesh_dims=_dims(shard="dp")))
    out["spmd_name"] = _error(lambda: fully_shard(lin, mesh=mesh, dp_mesh_dims=_dims(shard="data")))
    lin.weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Replicate()]))
    out["spmd_not_replicate"] = _error(lambda: fully_shard(lin, mesh=mesh, dp_mesh_dims=_dims(shard="dp")))
    return out


def _dims(**kw: Any) -> Any:
    from fully_shard import DataParallelMeshDims

    return DataParallelMeshDims(**kw)


def test_bad_inputs_raise_on_every_rank() -> None:
    for r in _bad_inputs():
        assert "not a sub-mesh of the same root" in r["other_root"] and "'norm1" not in r["other_root"], r
        assert "'q.weight'" in r["other_root"] and "Fix:" in r["other_root"], r
        assert "overlap" in r["overlap_1d"] and "'q.weight'" in r["overlap_1d"] and "Fix:" in r["overlap_1d"], r
        assert "overlap" in r["overlap_names"] and "['tp']" in r["overlap_names"], r
        assert r["raf_int"].startswith("NotImplementedError") and "'q.weight'" in r["raf_int"], r["raf_int"]
        assert "called differently across ranks" in r["plan_mismatch"], r["plan_mismatch"]
        assert "up.weight" in r["plan_mismatch"] and "_StridedShard" in r["plan_mismatch"], r["plan_mismatch"]
        assert "Partial" in r["partial"] and "'weight'" in r["partial"] and "Fix:" in r["partial"], r
        assert "plain tensor" in r["spmd_plain"] and "'weight'" in r["spmd_plain"], r
        assert "'data'" in r["spmd_name"] and "Fix:" in r["spmd_name"], r
        assert "Replicate() there" in r["spmd_not_replicate"] and "'dp'" in r["spmd_not_replicate"], r


# --- dp_mesh_dims (parameters on the full mesh) and 0-dim TP parameters -----------------------------
@distributed(world_size=4, timeout=TIMEOUT_S)
def _spmd() -> dict[str, Any]:
    mesh = mesh_2d()
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g)) for _ in range(3)]
    # torch before 2.13 has no dp_mesh_dims: its side is a second copy of ours, compared only with ours
    ours, theirs, ref = SpmdMLP(mesh), SpmdMLP(mesh), spmd_reference()
    fully_shard(ours, mesh=mesh, dp_mesh_dims=_dims(shard="dp"))
    if TORCH_NO_DP_DIMS:
        fully_shard(theirs, mesh=mesh, dp_mesh_dims=_dims(shard="dp"))
    else:
        from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

        _torch_fully_shard()(theirs, mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
    out["layout"], out["torch_layout"] = _layout(ours), _layout(theirs)
    out["init_diff"] = _local_diff(ours, theirs)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, ref)]
    out["losses"] = []
    for x, y in batches:
        losses = [((ours(dp_slice(x, mesh)) - dp_slice(y, mesh)) ** 2).mean(),
                  ((theirs(dp_slice(x, mesh)) - dp_slice(y, mesh)) ** 2).mean(),
                  ((spmd_reference_forward(ref, x) - y) ** 2).mean()]
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
        out["losses"].append((global_loss(losses[0], mesh), global_loss(losses[1], mesh), losses[2].item()))
    out["final_diff"] = _local_diff(ours, theirs)
    # HSDP through dp_mesh_dims: replicate over 'dp', shard over 'tp' (no model parallel dim at all)
    hsdp = []
    theirs_hsdp = (fully_shard, _dims(shard="tp", replicate="dp")) if TORCH_NO_DP_DIMS else \
        (_torch_fully_shard(), TorchDims("tp", "dp"))
    for fs, dims in ((fully_shard, _dims(shard="tp", replicate="dp")), theirs_hsdp):
        torch.manual_seed(2)
        lin = distribute_module(nn.Linear(DIM, 6), mesh)  # every parameter Replicate() on both dims
        fs(lin, mesh=mesh, dp_mesh_dims=dims)
        hsdp.append(lin)
    ref_lin = nn.Linear(DIM, 6)
    with torch.no_grad():
        for p, q in zip(ref_lin.parameters(), hsdp[0].parameters()):
            p.copy_(q.full_tensor())
    out["hsdp_layout"], out["hsdp_torch_layout"] = _layout(hsdp[0]), _layout(hsdp[1])
    rank = dist.get_rank()
    out["hsdp_losses"] = []
    for x, y in batches[:2]:
        y6 = y[:, :6]
        losses = [((m(DTensor.from_local(x[2 * rank:2 * rank + 2], mesh, [Shard(0), Shard(0)])).to_local()
                    - y6[2 * rank:2 * rank + 2]) ** 2).mean() for m in hsdp]
        losses.append(((ref_lin(x) - y6) ** 2).mean())
        for loss, m in zip(losses, (*hsdp, ref_lin)):
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        mean = torch.stack([losses[0].detach(), losses[1].detach()])
        dist.all_reduce(mean)
        out["hsdp_losses"].append((*(mean / 4).tolist(), losses[2].item()))
    # torch's DataParallelMeshDims object is accepted as is
    other = SpmdMLP(mesh)
    fully_shard(other, mesh=mesh, dp_mesh_dims=_dims(shard="dp") if TORCH_NO_DP_DIMS else TorchDims(shard="dp"))
    out["torch_dims_layout"] = _layout(other)
    return out


@distributed(world_size=4, timeout=TIMEOUT_S)
def _zero_dim() -> dict[str, Any]:
    """A 0-dim Replicate() TP parameter next to the 2-D ones, against the unsharded model."""
    mesh = mesh_2d()
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    base = TPModel(gated=True)
    model = shard_2d(tensor_parallel(copy.deepcopy(base), mesh["tp"]), fully_shard, mesh["dp"])
    out["gate_placements"] = tuple(model.blocks[0].gate.placements)  # type: ignore[union-attr,index]
    opt, opt_ref = _adamw(model), _adamw(base)
    out["gate_losses"] = []
    for x, y in data(3):
        loss_ref = loss_fn(base(x), y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        out["gate_losses"].append((_step(model, opt, x, y, mesh), loss_ref.item()))
    out["gate_diff"] = max_diff_to(model, base)
    return out


def test_dp_mesh_dims_and_zero_dim_tp_params() -> None:
    for r, z in zip(_spmd(), _zero_dim()):
        r.update(z)
        assert r["layout"] == r["torch_layout"] == r["torch_dims_layout"], r
        assert r["layout"]["w2"][0] == (Shard(0), Shard(1)) and r["layout"]["b2"][0] == (Shard(0), Replicate())
        assert r["init_diff"] == 0.0, r
        for ours, theirs, ref in r["losses"]:
            assert abs(ours - theirs) < 1e-5 and abs(ours - ref) < 2e-5, r["losses"]
        assert r["final_diff"] < 1e-5, r
        assert r["gate_placements"] == (Replicate(), Replicate()), r
        assert r["hsdp_layout"] == r["hsdp_torch_layout"], r
        assert r["hsdp_layout"]["weight"][0] == (Replicate(), Shard(0)), r
        for ours, theirs, ref in r["hsdp_losses"]:
            assert abs(ours - theirs) < 1e-5 and abs(ours - ref) < 2e-5, r["hsdp_losses"]
        for ours, ref in r["gate_losses"]:
            assert abs(ours - ref) < 2e-5, r["gate_losses"]
        assert r["gate_diff"] < 1e-4, r
    if TORCH_NO_DP_DIMS:
        pytest.skip(TORCH_NO_DP_DIMS)
