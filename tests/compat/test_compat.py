"""``fully_shard.compat.patch_torch()``: code written against torch's FSDP2 names (imports from
``torch.distributed.fsdp``) runs on this library, side by side with torch's own fully_shard (read
from its implementation module, which patching leaves alone) and an unsharded reference; every
rebound name goes back on ``unpatch_torch()``."""

from __future__ import annotations

import copy
import importlib
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

import fully_shard as ours
from fully_shard import compat
from tests.core.pairs import Decoder, ce_sum, global_sum, grads, max_diff, rank_rows, reference_grads, tokens
from tests.core.test_grouped import TORCH_NO_TITAN_CHUNKS, titan_chunked_loss
from tests.distributed.harness import distributed
from tests.torch_ref import lacks_name

TOL = 1e-6
TORCH_NO_PLACEMENT_RESULT = lacks_name("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult")
TORCH_NO_DP_DIMS = lacks_name("torch.distributed.fsdp", "DataParallelMeshDims")


def _torch_fully_shard() -> Any:
    """torch's own fully_shard, whatever ``torch.distributed.fsdp`` is bound to right now."""
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard

    return torch_fully_shard


def _snapshot() -> dict[tuple[str, str], object]:
    found = {}
    for modname, names in compat.TARGETS:
        importlib.import_module(modname)
        for name in names:
            if name in vars(sys.modules[modname]):
                found[(modname, name)] = vars(sys.modules[modname])[name]
    return found


# --- patch / unpatch bookkeeping (one process, no ranks) -------------------------------------------
def _torch_fsdp_objects() -> dict[int, str]:
    """id -> name of every object torch's FSDP2 package exports (its public names and policies)."""
    import torch.distributed.fsdp._fully_shard as package

    return {id(v): n for n, v in vars(package).items() if not n.startswith("_") and not isinstance(v, type(sys))}


# Bound by torch's modules but left to torch on purpose (design/compat.md, "Left alone"): plain records
# torch's fully_shard reads, and the memory tracker that wraps torch's own param groups.
_LEFT_ALONE = {("torch.distributed.fsdp", "DataParallelMeshDims"),
               ("torch.distributed.fsdp._fully_shard", "DataParallelMeshDims")}


def test_rebinding_table_is_exactly_what_this_torch_binds() -> None:
    """compat's table for the running torch (``compat.TARGETS``) names every FSDP2 object torch's modules
    bind, on this torch, and nothing they do not: e.g. pipelining's stage binds ``fully_shard`` before
    torch 2.15 and ``GradientReductionHandle`` from 2.15."""
    objects = _torch_fsdp_objects()
    bound = set()
    for modname, _ in compat.TARGETS:
        mod = importlib.import_module(modname)
        bound |= {(modname, n) for n, v in vars(mod).items() if id(v) in objects and not n.startswith("_")}
    table = {(modname, n) for modname, names in compat.TARGETS for n in names}
    assert table == bound - _LEFT_ALONE, {"missing": sorted(bound - _LEFT_ALONE - table),
                                          "extra": sorted(table - bound)}
    stage = "torch.distributed.pipelining.stage"
    if compat.TORCH_VERSION >= (2, 15):
        assert (stage, "fully_shard") not in table and (stage, "GradientReductionHandle") in table
        assert ("torch.distributed.fsdp", "GradientReductionHandle") in table
    else:
        assert (stage, "fully_shard") in table and not any(n == "GradientReductionHandle" for _, n in table)
    # the table's rows per version: 2.13's and 2.15's
    for version, count in (((2, 13), 30), ((2, 15), 32)):
        assert sum(len(names) for _, names in compat.rebindings_for(version)) == count, version


def test_patch_rebinds_every_name_and_unpatch_restores_exactly() -> None:
    import torch.distributed._composable.fsdp as legacy
    import torch.distributed.fsdp as tfsdp
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    before = _snapshot()
    assert not compat.is_patched()
    try:
        names = compat.patch_torch()
        assert compat.patch_torch() == names  # idempotent: the second call changes nothing
        assert len(names) == len(before) >= 20, names
        assert sorted(names) == sorted(f"{m}.{n}" for m, ns in compat.TARGETS for n in ns)
        assert tfsdp.fully_shard is compat.fully_shard and legacy.fully_shard is compat.fully_shard
        assert tfsdp.FSDPModule is ours.FSDPModule and legacy.FSDPModule is ours.FSDPModule
        assert tfsdp.MixedPrecisionPolicy is ours.MixedPrecisionPolicy
        assert tfsdp.CPUOffloadPolicy is ours.CPUOffloadPolicy and tfsdp.OffloadPolicy is ours.OffloadPolicy
        assert tfsdp.UnshardHandle is ours.UnshardHandle
        assert tfsdp.register_fsdp_forward_method is ours.register_fsdp_forward_method
        assert tfsdp.share_comm_ctx is ours.share_comm_ctx
        assert stage.FSDPModule is ours.FSDPModule
        if "fully_shard" in dict(compat.TARGETS)["torch.distributed.pipelining.stage"]:  # before torch 2.15
            assert stage.fully_shard is compat.fully_shard
        if compat.TORCH_VERSION >= (2, 15):
            assert tfsdp.GradientReductionHandle is ours.GradientReductionHandle
            assert stage.GradientReductionHandle is ours.GradientReductionHandle
        assert schedules.FSDPModule is ours.FSDPModule and schedules.UnshardHandle is ours.UnshardHandle
        from torch.distributed.fsdp import fully_shard as imported  # a framework's import after patching

        assert imported is compat.fully_shard
        assert _torch_fully_shard() is before[("torch.distributed.fsdp", "fully_shard")]  # torch's impl untouched
        for (modname, name), original in before.items():
            assert vars(sys.modules[modname])[name] is not original, f"{modname}.{name} not rebound"
    finally:
        compat.unpatch_torch()
    compat.unpatch_torch()  # idempotent
    assert not compat.is_patched() and compat.patched_names() == []
    after = _snapshot()
    assert after.keys() == before.keys()
    for key, original in before.items():
        assert after[key] is original, f"{key} not restored"


_FRESH = """
from fully_shard import compat
compat.patch_torch()  # first import of pipelining and the legacy path happens in here
compat.unpatch_torch()
import torch.distributed._composable.fsdp as legacy
import torch.distributed.pipelining.schedules as schedules
import torch.distributed.pipelining.stage as stage
from torch.distributed.fsdp._fully_shard import _fully_shard as impl
assert stage.FSDPModule is impl.FSDPModule and getattr(stage, "fully_shard", impl.fully_shard) is impl.fully_shard
assert schedules.FSDPModule is impl.FSDPModule and schedules.UnshardHandle is impl.UnshardHandle
assert legacy.FSDPModule is impl.FSDPModule and legacy.fully_shard is impl.fully_shard
print("restored")
"""


def test_unpatch_restores_torch_modules_first_imported_by_patch() -> None:
    """Modules that import torch.distributed.fsdp's names at their own import (pipelining, the legacy
    path) must be imported before anything is rebound, or they would bind ours and unpatch would
    "restore" ours (a 4-rank pipeline run after an HSDP test found this)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "restored" in done.stdout, done.stderr[-2000:]


# --- code written against torch's API, run patched ------------------------------------------------
def _framework_shard(model: Decoder, group_raf: bool) -> Decoder:
    """What a framework's parallelize code does, importing torch's names (bound to ours now)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard([model.norm, model.head], mp_policy=mp, reshard_after_forward=group_raf)
    fully_shard(model, mp_policy=mp)
    # torchtitan also calls set_gradient_divide_factor(1.0) on every unit and scales the loss by the
    # global token count itself; left out here: torch's own implementation of it fails on gloo
    # (PREMUL_SUM), so the side-by-side run could not make the same call.
    return model


def _check_ours(model: Decoder) -> None:
    import torch.distributed._composable.fsdp as legacy
    import torch.distributed.fsdp as tfsdp

    for unit in (model, model.blocks[0], model.norm, model.head):
        assert isinstance(unit, tfsdp.FSDPModule) and isinstance(unit, legacy.FSDPModule)
        assert isinstance(unit, ours.FSDPModule)
    for sub in (model, model.tok, model.blocks[0][0], model.head):  # Dynamo's FSDP-managed flags
        assert sub._is_fsdp_managed_module is True and sub._fsdp_use_orig_params is True
    assert isinstance(model.head.weight, DTensor)


@distributed(world_size=2)
def _titan_patched(group_raf: bool, steps: int = 4) -> dict[str, float]:
    torch.manual_seed(0)
    ref = Decoder()
    shard_torch = _torch_fully_shard()
    theirs = copy.deepcopy(ref)
    for blk in theirs.blocks:
        shard_torch(blk)
    shard_torch([theirs.norm, theirs.head], reshard_after_forward=group_raf)
    shard_torch(theirs)
    compat.patch_torch()
    try:
        model = _framework_shard(copy.deepcopy(ref), group_raf)
        _check_ours(model)
        pair = {"ours": model} if TORCH_NO_TITAN_CHUNKS else {"ours": model, "torch": theirs}
        opts = {lib: torch.optim.AdamW(m.parameters(), lr=1e-2) for lib, m in pair.items()}
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        worst = {"ref": 0.0} if TORCH_NO_TITAN_CHUNKS else {"ref": 0.0, "torch": 0.0, "loss": 0.0}
        for step in range(steps):  # step 2 used to fail: 'mixed torch.Tensor and DTensor' at the norm
            x, y = tokens(4, seed=30 + step)
            got, losses = {}, {}
            for lib, m in pair.items():
                loss = titan_chunked_loss(m, rank_rows(x), rank_rows(y), 4, group_raf)
                got[lib], losses[lib] = grads(m), global_sum(loss)
                opts[lib].step()
                opts[lib].zero_grad()
            want = reference_grads(ref, ce_sum(ref(x), y) / rank_rows(y).numel())  # the unchunked loss
            ref_opt.step()
            worst["ref"] = max(worst["ref"], max_diff(got["ours"], want))
            if "torch" in pair:
                worst["torch"] = max(worst["torch"], max_diff(got["ours"], got["torch"]))
                worst["loss"] = max(worst["loss"], abs(losses["ours"] - losses["torch"]))
        assert model.head.fsdp_state_name == "SHARDED"  # reshard() and the settings restored
    finally:
        compat.unpatch_torch()
    assert max(worst.values()) < TOL, worst
    return worst


@pytest.mark.parametrize("group_raf", [False, True])
def test_torchtitan_chunked_loss_through_torch_imports(group_raf: bool) -> None:
    results = _titan_patched(group_raf)
    print(f"group_raf={group_raf}", {k: max(r[k] for r in results) for k in results[0]})
    if TORCH_NO_TITAN_CHUNKS:
        pytest.skip(TORCH_NO_TITAN_CHUNKS)


# --- torch's records: policies made before patching, dp_mesh_dims, ShardPlacementResult ----------
@distributed(world_size=2)
def _torch_records() -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    if TORCH_NO_PLACEMENT_RESULT:  # torch 2.11's shard_placement_fn returns the placement itself
        ShardPlacementResult: Any = lambda placement, mesh_info: placement  # noqa: E731
        _get_mesh_info: Any = lambda mesh: None  # noqa: E731 (torch 2.10 has no such function either)
    else:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    assert not compat.is_patched()
    torch_mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # made before patching
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("efsdp",))
    compat.patch_torch()
    try:
        from torch.distributed.fsdp import fully_shard

        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
        info = _get_mesh_info(mesh)

        def place(p: nn.Parameter) -> Any:
            return ShardPlacementResult(placement=Shard(1) if p.dim() == 2 else None, mesh_info=info)

        fully_shard(model[0], mesh=mesh, shard_placement_fn=place, mp_policy=torch_mp)
        fully_shard(model, mesh=mesh, mp_policy=torch_mp)
        assert model[0].weight.placements == (Shard(1),) and model[0].weight.device_mesh == mesh
        out = model(torch.randn(3, 8))
        assert out.dtype == torch.bfloat16  # torch's policy object, converted
        out.float().sum().backward()
        assert model[0].weight.grad is not None and model[0].weight.grad.dtype == torch.float32
        state = compat.fully_shard.state(model)
        assert state is not None and compat.fully_shard.state(nn.Linear(2, 2)) is None
        view = state._fsdp_param_group
        assert view is not None and view.mesh_info.shard_mesh_size == 2
        assert view.mesh_info.shard_process_group is mesh.get_group(0)
        assert view.mesh_info.replicate_process_group is None
        elsewhere = nn.Linear(4, 4)  # per-parameter meshes: one FSDPMeshInfo object per process group (torch's rule)
        if not TORCH_NO_PLACEMENT_RESULT:
            with pytest.raises(ValueError, match="another mesh object on the same process groups"):
                fully_shard(elsewhere, mesh=mesh,
                            shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), _get_mesh_info(other)))
            other_info = _get_mesh_info(other)
            fully_shard(elsewhere, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other_info))
            assert elsewhere.weight.device_mesh == other and elsewhere.bias.device_mesh == other
    finally:
        compat.unpatch_torch()
    return {"placements": str(model[0].weight.placements)}


def test_torch_policy_objects_dp_mesh_dims_and_shard_placement_results() -> None:
    _torch_records()
    if TORCH_NO_PLACEMENT_RESULT:
        pytest.skip(TORCH_NO_PLACEMENT_RESULT.replace("the torch-side comparison", "ShardPlacementResult's case"))


@distributed(world_size=4)
def _hsdp_dp_mesh_dims() -> dict[str, float]:
    """torchtitan's HSDP call, ``dp_mesh_dims`` naming the replicate and shard dims of its mesh,
    against torch's fully_shard on the same 2-D mesh: equal gradients; the state view's mesh info."""
    if TORCH_NO_DP_DIMS:  # older torch: code written for it passes ours (torch's fully_shard has no dp_mesh_dims)
        from fully_shard import DataParallelMeshDims
    else:
        from torch.distributed.fsdp import DataParallelMeshDims

    assert not compat.is_patched()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))
    full_x = torch.randn(4, 8)
    x = full_x[mesh.get_rank() % 4:][:1]
    got = {}
    dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    # dp_mesh_dims: the parameters are DTensors on the full mesh, Replicate() on the dp dims (torch's contract)
    theirs = distribute_module(copy.deepcopy(base), mesh)
    if not TORCH_NO_DP_DIMS:
        _torch_fully_shard()(theirs, mesh=mesh, dp_mesh_dims=dims)
    compat.patch_torch()
    try:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(distribute_module(copy.deepcopy(base), mesh), mesh=mesh, dp_mesh_dims=dims)
        want = (Replicate(), Shard(0)) if TORCH_NO_DP_DIMS else theirs[0].weight.placements  # torch's layout
        assert model[0].weight.placements == want, model[0].weight.placements
        state = compat.fully_shard.state(model)
        assert state is not None and state._fsdp_param_group is not None
        info = state._fsdp_param_group.mesh_info
        assert (info.shard_mesh_size, info.replicate_mesh_size) == (2, 2)
        assert info.shard_process_group is mesh.get_group(1) and info.replicate_process_group is mesh.get_group(0)
        assert info.replicate_mesh_rank == mesh.get_local_rank(0) and info.shard_mesh_rank == mesh.get_local_rank(1)
    finally:
        compat.unpatch_torch()
    for lib, m in (("ours", model), ("torch", theirs))[:1 if TORCH_NO_DP_DIMS else 2]:
        xd = DTensor.from_local(x, mesh, [Shard(0), Shard(0)])  # SPMD: the batch is sharded on both dp dims
        m(xd).pow(2).sum().full_tensor().backward()
        got[lib] = grads(m)
    # the unsharded model: the global loss, averaged over the 4 dp ranks once more (each rank's loss is global)
    want = reference_grads(base, base(full_x).pow(2).sum())
    diffs = {"grad_vs_ref": max_diff(got["ours"], want)}
    if not TORCH_NO_DP_DIMS:
        diffs["grad_vs_torch"] = max_diff(got["ours"], got["torch"])
    assert max(diffs.values()) < TOL, diffs
    return diffs


def test_hsdp_through_dp_mesh_dims_matches_torch() -> None:
    _hsdp_dp_mesh_dims()
    if TORCH_NO_DP_DIMS:
        pytest.skip(TORCH_NO_DP_DIMS)


# --- torchtitan's torchft path: the replica all-reduce hook set through torch's private names ----------------
def _titan_ft_hook(model: nn.Module, hook: Any) -> None:
    """What torchtitan's experiments/torchft ``maybe_set_all_reduce_hook`` does on every unit."""
    from torch.distributed._composable.fsdp.fully_shard import FSDPModule

    def apply(m: nn.Module) -> None:
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            if hasattr(state, "_fsdp_param_groups"):
                groups = state._fsdp_param_groups
            else:  # torch 2.11 keeps one group per unit (_fsdp_param_group); torchtitan for it sets that one
                groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
            for param_group in groups:
                param_group._all_reduce_hook = hook

    model.apply(apply)


@distributed(world_size=2)
def test_torchtitan_ft_hook_path_runs_our_units_as_torch_runs_its_own() -> dict[str, float]:
    torch.manual_seed(0)
    ref = Decoder()
    theirs = copy.deepcopy(ref)
    shard_torch = _torch_fully_shard()
    for blk in theirs.blocks:
        shard_torch(blk)
    shard_torch([theirs.norm, theirs.head])
    shard_torch(theirs)
    calls = {"ours": 0, "torch": 0}

    def hook_for(lib: str) -> Any:
        def hook(shard: torch.Tensor) -> None:  # stands for the replica all-reduce: observable, in place
            calls[lib] += 1
            shard.mul_(2)
        return hook

    _titan_ft_hook(theirs, hook_for("torch"))
    compat.patch_torch()
    try:
        model = _framework_shard(copy.deepcopy(ref), group_raf=True)
        _titan_ft_hook(model, hook_for("ours"))
        group = model.blocks[0]._get_fsdp_state()._fsdp_param_groups[0]
        assert group._all_reduce_hook is model.blocks[0]._fsdp.groups[0].reducer.settings.all_reduce_hook
        with pytest.raises(TypeError, match="callable"):
            group._all_reduce_hook = 3
        x, y = tokens(4, seed=3)
        got = {}
        for lib, m in (("ours", model), ("torch", theirs)):
            (ce_sum(m(rank_rows(x)), rank_rows(y)) / rank_rows(y).numel()).backward()
            got[lib] = grads(m)
    finally:
        compat.unpatch_torch()
    assert not hasattr(model, "_get_fsdp_state")  # torch's private method only while patched
    want = {n: None if g is None else 2 * g
            for n, g in reference_grads(ref, ce_sum(ref(x), y) / rank_rows(y).numel()).items()}
    worst = {"torch": max_diff(got["ours"], got["torch"]), "ref": max_diff(got["ours"], want)}
    assert calls["ours"] == calls["torch"] > 0, calls
    assert max(worst.values()) < TOL, worst
    return worst
