"""fully_shard.optim.Muon against torch.optim.Muon + torch.optim.AdamW on the unsharded model, fed the same gradients.

Each distributed test runs several variants inside one call (the rank pools are shared; a call costs a
round trip). Equality is exact in practice (the owner runs torch's bf16 Newton-Schulz on the same
assembled matrix); the issue's bound, 1e-5, is what is asserted.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fully_shard import checkpoint, fully_shard
from fully_shard.optim import Muon, muon_param_groups
from fully_shard.optim.muon_plan import ns_cost
from tests.core.common import shard_gpt
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import batches
from tests.optim.common import feed_same_grads, make_pair, max_diff, run_equal

TOL = 1e-5


# --- equality with torch --------------------------------------------------------------------------------
@distributed(world_size=2)
def _equal_w2() -> dict[str, float]:
    variants: dict[str, dict[str, Any]] = {
        "default": {},
        "no nesterov, no weight decay": {"nesterov": False, "weight_decay": 0.0},
        "original": {"adjust_lr_fn": "original", "momentum": 0.9},
        "match_rms_adamw": {"adjust_lr_fn": "match_rms_adamw", "nesterov": False},
        "gather": {"comm": "gather"},
        "two per bucket": {"per_bucket": 2, "n_blocks": 2},
    }
    return {name: run_equal(**kw) for name, kw in variants.items()}


def test_equal_to_torch_muon_and_adamw_w2() -> None:
    for rank_result in _equal_w2():
        assert all(d <= TOL for d in rank_result.values()), rank_result


@distributed(world_size=3)
def _equal_w3() -> dict[str, float]:
    return {"owner": run_equal(n_blocks=2), "gather": run_equal(comm="gather")}


def test_equal_to_torch_w3_uneven_rows() -> None:
    """dim 60, hidden 157, 3*60 rows over 3 ranks: 157 rows split 53/53/51."""
    for rank_result in _equal_w3():
        assert all(d <= TOL for d in rank_result.values()), rank_result


def _hsdp(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return shard_gpt(model, mesh=mesh)


@distributed(world_size=4)
def _equal_w4() -> dict[str, Any]:
    out: dict[str, Any] = {"eq owner": run_equal(n_blocks=2), "eq hsdp": run_equal(shard=_hsdp)}
    # traffic and Newton-Schulz work of one owner step and one gather step (2 blocks: 8 matrices)
    for comm in ("owner", "gather"):
        model, opt, ref, _ = make_pair(n_blocks=2, comm=comm)
        x, y = batches(1)[0]
        feed_same_grads(model, ref, x, y)
        opt.step()  # the first step also checks the plan
        with CountCollectives() as counted:
            opt.step()
        muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        plan = next(iter(opt._plans.values()))
        out[comm] = {
            "calls": dict(opt.comm_stats.calls), "sent": opt.comm_stats.total_sent(),
            "received": opt.comm_stats.total_received(), "dispatched": dict(counted.counts),
            "param_bytes": sum(p.numel() * p.element_size() for p in muon), "ns_work": opt.ns_work,
            "ns_total": sum(ns_cost(s) for s in plan.specs), "load": plan.load, "buckets": len(plan.buckets),
            "plan_sent": plan.elements_sent(dist.get_rank()) * 2,  # bf16 elements
        }
    return out


def test_equal_w4_hsdp_traffic_and_work() -> None:
    results = _equal_w4()
    world = len(results)
    for rank, r in enumerate(results):
        assert r["eq owner"] <= TOL and r["eq hsdp"] <= TOL, r
        own, gat = r["owner"], r["gather"]
        # one all-to-all per bucket each way, nothing else (the plan check ran on the first step)
        assert own["calls"] == {"all_to_all": 2 * own["buckets"]}, own
        assert own["dispatched"] == {"alltoall_base_": 2 * own["buckets"]}, own
        assert gat["calls"] == {"all_gather": gat["buckets"]}, gat
        # bytes: what the plan predicts, and <= 2/W of the Muon parameters' bytes (x1.1)
        assert own["sent"] == own["plan_sent"], own
        assert own["sent"] <= 1.1 * 2 / world * own["param_bytes"], own
        assert own["sent"] < gat["sent"], (own, gat)
        # Newton-Schulz: the owner runs its share of the plan, the gather mode everything
        assert own["ns_work"] == own["load"][rank], own
        assert gat["ns_work"] == gat["ns_total"], gat
    assert sum(r["owner"]["ns_work"] for r in results) == results[0]["owner"]["ns_total"]
