"""torchtitan's MoE recipe, restated, on this library after ``compat.patch_torch()`` (4 gloo ranks).

torchtitan is not installed here, so ``apply_fsdp_to_decoder`` below restates its logic (torchtitan
``distributed/fsdp.py``, ep > 1 path since its PR #2281); it is not torchtitan's file. Its calls are
torchtitan's, and every name comes from torch's modules at call time (so after ``patch_torch()`` they are
this library's), the private ``_get_mesh_info`` and ``ShardPlacementResult`` included. torchtitan's own
file runs unchanged in ``tests/manual/torchtitan_moe.py`` (``pip install --no-deps torchtitan``; not in CI).
The same function runs unpatched on torch's fully_shard for the side-by-side numbers. ``clip_with_ep``
restates torchtitan's ``_clip_grad_norm_with_ep``. The sharding cases are those of torchtitan's
``tests/unit_tests/test_fsdp_moe_sharding.py`` at world 4."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from fully_shard import compat
from tests.distributed.harness import distributed
from tests.parallel.moe_common import TOKENS, VOCAB, Decoder, expert_parallel, sparse_meshes
from tests.torch_ref import lacks_name

# torch < 2.12: no ShardPlacementResult (torch's fully_shard has no per-parameter meshes); the ep path then
# returns this library's ShardPlacement, and only this library runs it (against the unsharded model)
TORCH_NO_PLACEMENT_RESULT = lacks_name("torch.distributed.fsdp._fully_shard._fsdp_common", "ShardPlacementResult")


def apply_fsdp_to_decoder(model: Decoder, dp_mesh: DeviceMesh, ep_degree: int, edp_mesh: DeviceMesh | None) -> None:
    """torchtitan's ``apply_fsdp_to_decoder`` (no weight tying, no PP, fp32 for exact comparisons)."""
    from torch.distributed._composable.fsdp import FSDPModule
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    config: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    fully_shard(model.tok_embeddings, **config, reshard_after_forward=True)
    fully_shard([model.norm, model.lm_head], **config, reshard_after_forward=False)
    for block in model.layers.values():
        experts = block.experts  # torchtitan: block.moe.routed_experts.inner_experts
        expert_params = set(experts.parameters())
        efsdp_ep = edp_mesh["efsdp"].size() * ep_degree if ep_degree > 1 else dp_mesh.size()  # type: ignore[index]
        placement = Shard(1) if efsdp_ep > experts.num_experts else Shard(0)
        if ep_degree == 1 and placement == Shard(0):
            fully_shard(block, **config, reshard_after_forward=True)
        elif ep_degree == 1:
            fully_shard(block, **config, reshard_after_forward=True,
                        shard_placement_fn=lambda p, e=expert_params: Shard(1) if p in e else None)
        elif TORCH_NO_PLACEMENT_RESULT:
            from fully_shard import ShardPlacement

            def ours_fn(p: nn.Parameter, e: set = expert_params, pl: Shard = placement) -> Any:
                return ShardPlacement(pl, mesh=edp_mesh) if p in e else ShardPlacement(Shard(0), mesh=dp_mesh)

            fully_shard(block, **config, reshard_after_forward=True, shard_placement_fn=ours_fn)
        else:
            from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
            from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

            edp_info, dp_info = _get_mesh_info(edp_mesh), _get_mesh_info(dp_mesh)
            assert isinstance(edp_info, FSDPMeshInfo) and isinstance(dp_info, FSDPMeshInfo)

            def fn(p: nn.Parameter, e: set = expert_params, pl: Shard = placement, ei: Any = edp_info,
                   di: Any = dp_info) -> Any:
                return ShardPlacementResult(pl, ei) if p in e else ShardPlacementResult(Shard(0), di)

            fully_shard(block, **config, reshard_after_forward=True, shard_placement_fn=fn)
    fully_shard(model, **config)
    for module in model.modules():  # disable_fsdp_gradient_division
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    if ep_degree == 1:
        return
    blocks = list(model.layers.values())
    model.tok_embeddings.set_modules_to_forward_prefetch([blocks[0]])  # type: ignore[operator]
    for block, nxt in zip(blocks, [*blocks[1:], None]):
        block.set_modules_to_forward_prefetch([nxt] if nxt is not None else [model.norm, model.lm_head])
    model.lm_head.set_modules_to_backward_prefetch([blocks[-1]])  # type: ignore[operator]
    for block, prev in zip(reversed(blocks), [*reversed(blocks[:-1]), None]):
        block.set_modules_to_backward_prefetch([prev] if prev is not None else [model.tok_embeddings])


def clip_with_ep(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torchtitan's ``_clip_grad_norm_with_ep``: split by ``"ep" in mesh_dim_names``, one norm per side."""
    ep = [p for p in params if p.grad is not None and "ep" in (p.device_mesh.mesh_dim_names or ())]
    dense = [p for p in params if p.grad is not None and p not in set(ep)]
    norms = []
    for side in (ep, dense):
        norm = torch.nn.utils.get_total_norm([p.grad for p in side], 2.0, False, True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = (norms[0] ** 2 + norms[1] ** 2) ** 0.5
    torch.nn.utils.clip_grads_with_norm_(ep, max_norm, total, True)
    torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total, True)
    return total


def _expert_shard_dim(model: Decoder) -> int | None:
    for layer in model.layers.values():
        for p in layer.experts.parameters():
            for pl in p.placements:
                if isinstance(pl, Shard):
                    return int(pl.dim)
    return None


def _train(model: Decoder, steps: int, unsharded: bool = False) -> list[tuple[float, float]]:
    """Global-token loss (sum / all tokens of all ranks), AdamW, torchtitan's clipping: (loss, norm).
    ``unsharded``: the plain model on every rank's tokens at once, torch's clip_grad_norm_."""
    world = dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, VOCAB, (world * TOKENS,), generator=g)
        if unsharded:
            targets = torch.cat([t.roll(1) for t in tokens.split(TOKENS)])
            loss = F.cross_entropy(model(tokens), targets, reduction="sum") / (world * TOKENS)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        else:
            mine = tokens[dist.get_rank() * TOKENS:(dist.get_rank() + 1) * TOKENS]
            loss = F.cross_entropy(model(mine), mine.roll(1), reduction="sum") / (world * TOKENS)
            loss.backward()
            norm = clip_with_ep(list(model.parameters()), max_norm=0.5)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if not unsharded:
            dist.all_reduce(total)
        out.append((total.item(), norm.item()))
    return out


@distributed(world_size=4, timeout=300)
def _torchtitan() -> dict[str, Any]:
    dims: dict[str, Any] = {}
    compat.patch_torch()
    try:
        dp = init_device_mesh("cpu", (4,))
        for name, (experts, ep, edp) in {
                "no_ep_fsdp_gt_experts": (2, 1, None), "no_ep_fsdp_le_experts": (4, 1, None),
                "ep2_gt_experts": (2, 2, init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep")))}.items():
            model = Decoder(experts)
            apply_fsdp_to_decoder(model, dp, ep, edp)
            dims[name] = _expert_shard_dim(model)
        dense, edp_mesh, ep_mesh = sparse_meshes(2, 2)
        base = Decoder(4)
        ours = expert_parallel(copy.deepcopy(base), ep_mesh)
        apply_fsdp_to_decoder(ours, dense, 2, edp_mesh)
        ours_losses = _train(ours, 3)
        groups = [len(s._fsdp_param_groups) for s in (compat.fully_shard.state(b) for b in ours.layers.values())]
    finally:
        compat.unpatch_torch()
    ref = _train(copy.deepcopy(base), 3, unsharded=True)
    placements = {n: tuple(p.placements) for n, p in ours.named_parameters()}
    if TORCH_NO_PLACEMENT_RESULT:
        return {"dims": dims, "ours": ours_losses, "ref": ref, "groups": groups, "placements": placements}
    theirs = expert_parallel(copy.deepcopy(base), ep_mesh)
    apply_fsdp_to_decoder(theirs, dense, 2, edp_mesh)
    for module in theirs.modules():  # torch's factor 1.0 needs NCCL's PREMUL_SUM unless forced to SUM (gloo)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    return {"dims": dims, "ours": ours_losses, "ref": ref, "torch": _train(theirs, 3), "groups": groups,
            "placements": placements,
            "torch_placements": {n: tuple(p.placements) for n, p in theirs.named_parameters()}}


def test_torchtitan_apply_fsdp_to_decoder_restated_after_patch_torch() -> None:
    for r in _torchtitan():
        assert r["dims"] == {"no_ep_fsdp_gt_experts": 1, "no_ep_fsdp_le_experts": 0, "ep2_gt_experts": 1}, r["dims"]
        assert r["groups"] == [2, 2], r["groups"]
        for (ours, ours_norm), (ref, ref_norm) in zip(r["ours"], r["ref"], strict=True):
            assert abs(ours - ref) < 1e-5 and abs(ours_norm - ref_norm) < 1e-5, (r["ours"], r["ref"])
        if TORCH_NO_PLACEMENT_RESULT:
            continue
        assert r["placements"] == r["torch_placements"], r
        for (ours, ours_norm), (theirs, theirs_norm) in zip(r["ours"], r["torch"]):
            assert abs(ours - theirs) < 1e-6 and abs(ours_norm - theirs_norm) < 1e-5, (r["ours"], r["torch"])
    if TORCH_NO_PLACEMENT_RESULT:
        pytest.skip(TORCH_NO_PLACEMENT_RESULT)
