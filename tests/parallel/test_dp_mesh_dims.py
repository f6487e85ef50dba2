"""``dp_mesh_dims`` with several shard dims (flattened into one shard axis; FSDP and HSDP), several
replicate dims, and replicate only (DDP-like), on 4 gloo ranks: against torch's fully_shard side by side (the sharded
parameter's mesh, placements and local tensor, the gradients, AdamW losses) and an unsharded model.

Each mesh is created once per rank process (tp_common's rule: value-equal meshes share DTensor specs)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

from fully_shard import DataParallelMeshDims, compat, fully_shard
from fully_shard.parallel.mesh import _check_dp_names
from tests.distributed.harness import distributed
from tests.parallel.tp_common import DIM, SpmdMLP, dp_slice, global_loss, spmd_reference, spmd_reference_forward
from tests.torch_ref import fails_before, lacks_name

STEPS = 3
TIMEOUT_S = 300
_MESHES: dict[tuple[str, ...], DeviceMesh] = {}
TORCH_NO_DP_DIMS = lacks_name("torch.distributed.fsdp", "DataParallelMeshDims")
TORCH_NO_FLAT_SHARD = fails_before((2, 13), "dp_mesh_dims with several shard dims (2.12 keeps a Shard per dim; "
                                            "2.13, as ours, flattens them into one shard axis)")


def _mesh(*names: str, shape: tuple[int, ...] = (2, 2)) -> DeviceMesh:
    if names not in _MESHES:
        _MESHES[names] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[names]


def _torch() -> tuple[Any, Any]:
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard, TorchDims


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch of 8 rows, seen every step (so the loss must fall)."""
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, DIM, generator=g), torch.randn(8, DIM, generator=g))] * n


def _layout(model: nn.Module) -> dict[str, Any]:
    return {n: (p.device_mesh, tuple(p.placements), tuple(p.shape)) for n, p in model.named_parameters()}


def _diff(a: nn.Module, b: nn.Module, grads: bool = False) -> float:
    other = dict(b.named_parameters())
    worst = 0.0
    for n, p in a.named_parameters():
        x, y = (p.grad, other[n].grad) if grads else (p, other[n])
        assert x.placements == y.placements and x.device_mesh == y.device_mesh, (n, x.placements, y.placements)
        worst = max(worst, (x.to_local() - y.to_local()).abs().max().item())
    return worst


def _side_by_side(make: Callable[[], nn.Module], kind: str, dims: dict[str, Any],
                  loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, float]],
                  ref: nn.Module, ref_forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                  mesh: DeviceMesh) -> dict[str, Any]:
    ours = make()
    fully_shard(ours, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(**dims))
    out: dict[str, Any] = {"kind": kind, "views": [_mesh_info_view(compat.fully_shard.state(ours))],
                           "layout": {n: (_mesh_str(m), p) for n, (m, p, _) in _layout(ours).items()}, "losses": []}
    theirs = None
    if not (TORCH_NO_DP_DIMS or (TORCH_NO_FLAT_SHARD and isinstance(dims.get("shard"), tuple))):
        torch_fully_shard, TorchDims = _torch()
        theirs = make()
        torch_fully_shard(theirs, mesh=mesh, dp_mesh_dims=TorchDims(**dims))
        out["views"].append(_mesh_info_view(torch_fully_shard.state(theirs)))
        out.update(same_layout=_layout(ours) == _layout(theirs), init_diff=_diff(ours, theirs))
    models = [m for m in (ours, theirs, ref) if m is not None]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in models]
    for step, (x, y) in enumerate(_batches()):
        l_ours, v_ours = loss(ours, x, y)
        l_theirs, v_theirs = loss(theirs, x, y) if theirs is not None else (None, None)
        l_ref = ((ref_forward(ref, x) - y) ** 2).mean()
        for item in (l_ours, l_theirs, l_ref):
            if item is not None:
                item.backward()
        if step == 0:
            if theirs is not None:
                out["grad_diff"] = _diff(ours, theirs, grads=True)
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            out["ref_grad_diff"] = max((p.grad.full_tensor() - ref_grads[n]).abs().max().item()
                                       for n, p in ours.named_parameters())
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["losses"].append((v_ours, v_theirs, l_ref.item()))
    if theirs is not None:
        out["final_diff"] = _diff(ours, theirs)
    return out


def _mesh_str(mesh: DeviceMesh) -> str:
    """The mesh's names, sizes and ranks (``str(mesh)`` differs across torch versions)."""
    dims = ", ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names or (), mesh.mesh.shape))
    return f"({dims}) ranks {mesh.mesh.flatten().tolist()}"


def _mesh_info_view(state: Any) -> tuple[Any, ...]:
    """What torch code reads of a unit's mesh info (compat's view of ours, torch's own)."""
    info = state._fsdp_param_group.mesh_info
    sizes = [getattr(info, f, None) for f in ("shard_mesh_size", "replicate_mesh_size")]
    # (torch's DDPMeshInfo has no shard size, its FSDPMeshInfo no replicate size)
    shard_size = None if info.shard_mesh_dim is None else sizes[0]
    replicate_size = None if info.replicate_mesh_dim is None else sizes[1]
    return info.shard_mesh_dim, info.replicate_mesh_dim, shard_size, replicate_size


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(DIM, 24), nn.Tanh(), nn.Linear(24, DIM))


def _batch_sharded_loss(mesh: DeviceMesh) -> Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[Any, float]]:
    """The batch sharded over every mesh dim (rank r holds rows 2r, 2r+1); each rank backpropagates the
    mean over its rows (FSDP averages over dp: the global mean's gradient); the value is the global mean.
    (A loss made global in DTensor, ``.full_tensor()``, would be averaged once more: gradients / 4, in
    torch's fully_shard as in this one.)"""

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        rows = slice(2 * mesh.get_rank(), 2 * mesh.get_rank() + 2)
        out = m(DTensor.from_local(x[rows], mesh, [Shard(0)] * mesh.ndim)).to_local()
        value = ((out - y[rows]) ** 2).mean()
        total = value.detach().clone()
        dist.all_reduce(total)
        return value, total.item() / dist.get_world_size()

    return loss


@distributed(world_size=4, timeout=TIMEOUT_S)
def _cases() -> list[dict[str, Any]]:
    results = []
    mesh = _mesh("dp_shard", "cp")  # FSDP over the two dims flattened into one 4-rank shard axis
    for kind, dims in (("shard2", {"shard": ("dp_shard", "cp")}), ("replicate2", {"replicate": ("dp_shard", "cp")})):
        base = _mlp()
        results.append(_side_by_side(lambda b=base: distribute_module(copy.deepcopy(b), mesh), kind, dims,
                                     _batch_sharded_loss(mesh), copy.deepcopy(base),
                                     lambda r, x: r(x), mesh))
    # HSDP with two shard dims: replicate over 'dp_replicate', shard over ('dp_shard', 'cp') flattened
    mesh = _mesh("dp_replicate", "dp_shard", "cp", shape=(2, 1, 2))
    base = _mlp()
    results.append(_side_by_side(lambda: distribute_module(copy.deepcopy(base), mesh), "hsdp_shard2",
                                 {"shard": ("dp_shard", "cp"), "replicate": "dp_replicate"},
                                 _batch_sharded_loss(mesh), copy.deepcopy(base), lambda r, x: r(x), mesh))
    # DDP-like: replicate over 'dp_replicate' only; 'tp' shards w1/w2 (SpmdMLP), the batch is split over dp
    mesh = _mesh("dp_replicate", "tp")

    def spmd_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
        value = ((m(dp_slice(x, mesh, "dp_replicate")) - dp_slice(y, mesh, "dp_replicate")) ** 2).mean()
        return value, global_loss(value, mesh, "dp_replicate")

    results.append(_side_by_side(lambda: SpmdMLP(mesh), "ddp", {"replicate": "dp_replicate"}, spmd_loss,
                                 spmd_reference(), spmd_reference_forward, mesh))
    return results


def test_flattened_and_replicate_only_dp_mesh_dims_match_torch() -> None:
    for rank_results in _cases():
        by_kind = {r["kind"]: r for r in rank_results}
        assert set(by_kind) == {"shard2", "replicate2", "hsdp_shard2", "ddp"}
        for r in rank_results:
            assert r["ref_grad_diff"] < 1e-6, r  # the gradient of the global mean loss (no extra averaging)
            for ours, _, ref in r["losses"]:
                assert abs(ours - ref) < 2e-5, r["losses"]
            assert r["losses"][-1][0] < r["losses"][0][0], r["losses"]  # it trains
            if "grad_diff" not in r:  # torch's side did not run
                continue
            assert r["same_layout"], r
            assert r["views"][0] == r["views"][1], r["views"]
            assert r["init_diff"] == 0.0 and r["grad_diff"] < 1e-6 and r["final_diff"] < 1e-5, r
            for ours, theirs, _ in r["losses"]:
                assert abs(ours - theirs) < 1e-5, r["losses"]
        shard2 = by_kind["shard2"]["layout"]
        assert shard2["0.weight"] == ("(dp_shard_cp=4) ranks [0, 1, 2, 3]", (Shard(0),)), shard2
        hsdp = by_kind["hsdp_shard2"]["layout"]["0.weight"]
        assert hsdp == ("(dp_replicate=2, dp_shard_cp=2) ranks [0, 1, 2, 3]", (Replicate(), Shard(0))), hsdp
        assert by_kind["ddp"]["views"][0] == (None, 0, None, 2), by_kind["ddp"]["views"]
        ddp = by_kind["ddp"]["layout"]  # parameters keep their full-mesh placements: nothing is sharded by FSDP
        assert {n: p for n, (_, p) in ddp.items()} == {"w1": (Replicate(), Shard(0)), "w2": (Replicate(), Shard(1)),
                                                       "b2": (Replicate(), Replicate())}, ddp
        assert all(p == (Replicate(), Replicate()) for _, p in by_kind["replicate2"]["layout"].values())
    if TORCH_NO_DP_DIMS or TORCH_NO_FLAT_SHARD:
        pytest.skip(TORCH_NO_DP_DIMS or TORCH_NO_FLAT_SHARD)


def _names(*names: str) -> Any:
    return SimpleNamespace(mesh_dim_names=names, shape=(2,) * len(names))


@pytest.mark.parametrize(("dims", "message"), [
    (DataParallelMeshDims(shard=("cp", "dp_shard")), "not in the mesh's order"),
    (DataParallelMeshDims(shard="cp", replicate="cp"), "more than once"),
    (DataParallelMeshDims(shard=("cp", "cp")), "more than once"),
    (DataParallelMeshDims(shard=("dp_replicate", "cp")), "not adjacent"),
    (DataParallelMeshDims(shard="data"), "'data'"),
])
def test_combinations_torch_refuses_are_refused_with_the_fix(dims: DataParallelMeshDims, message: str) -> None:
    with pytest.raises(ValueError, match="Fix:") as info:
        _check_dp_names(_names("dp_replicate", "dp_shard", "cp"), dims)  # type: ignore[arg-type]
    assert message in str(info.value), str(info.value)
