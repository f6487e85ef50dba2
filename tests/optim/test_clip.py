"""clip_grad_norm_ over gradients on several meshes (HSDP blocks, a 1-D root, an ignored plain param)
against the unsharded reference, for norm types 2, 1 and inf."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard
from fully_shard.optim.clip import clip_grad_norm_, total_grad_norm
from tests.distributed.counting import CountOps
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn
from tests.policies.common import full, local_slice

NORMS = {"2": 2.0, "1": 1.0, "inf": math.inf}


@distributed(world_size=4)
def _clip_mixed_meshes(norm: str, max_norm: float) -> dict[str, object]:
    norm_type = NORMS[norm]
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (4,))
    for blk in model.blocks:
        fully_shard(blk, mesh=hsdp)
    fully_shard(model, mesh=flat, ignored_params={model.pos})
    x, y = batches(1, batch=8)[0]
    loss_fn(model(local_slice(x)), local_slice(y)).backward()
    assert model.pos.grad is not None and not isinstance(model.pos.grad, DTensor)
    dist.all_reduce(model.pos.grad, op=dist.ReduceOp.AVG)  # an ignored param: the user syncs it
    loss_fn(ref(x), y).backward()
    kinds = {type(p.grad).__name__ + str(getattr(p.grad, "placements", "")) for p in model.parameters()}
    total = clip_grad_norm_(model.parameters(), max_norm, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
    grad_diff = max((full(p.grad) - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())
    return {"total": total, "ref_total": ref_total.item(), "grad_diff": grad_diff, "kinds": kinds,
            "after": total_grad_norm(model.parameters(), norm_type).item()}


@pytest.mark.parametrize("norm", ["2", "1", "inf"])
def test_clip_matches_reference_across_meshes(norm: str) -> None:
    results = _clip_mixed_meshes(norm, 0.05)
    totals = [r["total"] for r in results]
    for r in results:
        t = r["total"]
        assert type(t) is torch.Tensor and t.dim() == 0  # plain scalar, not a DTensor
        assert abs(t.item() - r["ref_total"]) <= 1e-5 * r["ref_total"], (t.item(), r["ref_total"])
        assert r["ref_total"] > 0.05  # clipping really happened
        assert abs(r["after"] - 0.05) < 1e-3 * 0.05 + 1e-6, r["after"]
        assert r["grad_diff"] < 1e-7, r["grad_diff"]
        # the model really mixed: HSDP, 1-D and replicated (0-dim) DTensors and a plain tensor
        assert r["kinds"] == {"DTensor(Replicate(), Shard(dim=0))", "DTensor(Shard(dim=0),)",
                              "DTensor(Replicate(), Replicate())", "Tensor"}, r["kinds"]
    assert len({t.item() for t in totals}) == 1  # identical on every rank


def test_no_clip_below_max_norm() -> None:
    for r in _clip_mixed_meshes("2", 1e6):
        assert abs(r["after"] - r["total"].item()) < 1e-6 * r["total"].item()
        assert r["grad_diff"] < 1e-7


def test_clip_rejects_non_positive_max_norm() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"max_norm must be > 0, got .*Fix: pass the largest"):
            clip_grad_norm_([p], bad)
    with pytest.raises(ValueError, match=r"norm_type must be > 0, got 0"):
        clip_grad_norm_([p], 1.0, norm_type=0)
    assert torch.equal(p.grad, torch.ones(3))  # nothing was touched


def test_clip_runs_one_foreach_kernel_per_device_and_dtype() -> None:
    """Norm and scaling: one _foreach_norm and one _foreach_mul_ per (device, dtype), no per-gradient
    kernels or full-size temporaries (``abs``, ``pow``, ``mul``), and the same values as torch's."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(5)]
    params += [torch.nn.Parameter(torch.randn(6, dtype=torch.float64)) for _ in range(2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, ref):
        p.grad = torch.randn_like(p)
        r.grad = p.grad.clone()
    with CountOps() as counted:
        total = clip_grad_norm_(params, 0.5)
    ref_total = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    counts = counted.counts
    assert counts["_foreach_norm"] == 2 and counts["_foreach_mul_"] == 2, dict(counts)  # float32, float64
    # nothing per gradient but its detach (a view): the old loop ran abs, mul, sum, to and mul_ per gradient
    per_grad = {k for k, v in counts.items() if v >= len(params) and k != "detach"}
    assert per_grad == set() and "abs" not in counts, dict(counts)
    assert abs(total.item() - ref_total.item()) <= 1e-6 * ref_total.item()
    for p, r in zip(params, ref):
        assert torch.allclose(p.grad, r.grad, rtol=1e-6, atol=0), (p.grad, r.grad)
