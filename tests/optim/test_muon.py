"""fully_shard.optim.Muon against torch.optim.Muon + torch.optim.AdamW on the unsharded model, fed the same gradients.

Each distributed test runs several variants inside one call (the rank pools are shared; a call costs a
round trip). Equality is exact (the owner runs torch's bf16 Newton-Schulz on the same assembled matrix, the
same ops in the same order): every comparison asserts a worst parameter difference of 0.0.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
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
from fully_shard.optim import muon as muon_module
from fully_shard.optim.muon_plan import ns_cost
from tests.core.common import shard_gpt
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches
from tests.optim.common import feed_same_grads, make_pair, max_diff, run_equal

EXACT = 0.0  # worst |ours - torch| over all parameters: bitwise equal


# --- equality with torch --------------------------------------------------------------------------------
@distributed(world_size=2)
def _equal_w2() -> dict[str, float]:
    variants: dict[str, dict[str, Any]] = {
        "default": {},
        "no nesterov, no weight decay, match_rms_adamw": {"nesterov": False, "weight_decay": 0.0,
                                                          "adjust_lr_fn": "match_rms_adamw"},
        "original, gather": {"adjust_lr_fn": "original", "momentum": 0.9, "comm": "gather"},
        "two per bucket": {"per_bucket": 2, "n_blocks": 2},
    }
    return {name: run_equal(**kw) for name, kw in variants.items()}


def test_equal_to_torch_muon_and_adamw_w2() -> None:
    for rank_result in _equal_w2():
        assert all(d == EXACT for d in rank_result.values()), rank_result


@distributed(world_size=3)
def _equal_w3() -> dict[str, float]:
    return {"owner": run_equal(), "gather": run_equal(comm="gather")}


def test_equal_to_torch_w3_uneven_rows() -> None:
    """dim 60, hidden 157, 3*60 rows over 3 ranks: 157 rows split 53/53/51."""
    for rank_result in _equal_w3():
        assert all(d == EXACT for d in rank_result.values()), rank_result


@contextlib.contextmanager
def recording_order() -> Iterator[list[str]]:
    """The sequence of all-to-all launches and Newton-Schulz calls inside the block (this rank)."""
    order: list[str] = []
    launch, ortho = muon_module.all_to_all_rows, muon_module._orthogonalize

    def spy_launch(*args: Any, **kwargs: Any) -> Any:
        order.append("all_to_all")
        return launch(*args, **kwargs)

    def spy_ortho(*args: Any, **kwargs: Any) -> Any:
        order.append("ns")
        return ortho(*args, **kwargs)

    muon_module.all_to_all_rows, muon_module._orthogonalize = spy_launch, spy_ortho  # type: ignore[assignment]
    try:
        yield order
    finally:
        muon_module.all_to_all_rows, muon_module._orthogonalize = launch, ortho  # type: ignore[assignment]


def _hsdp(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return shard_gpt(model, mesh=mesh)


@distributed(world_size=4)
def _equal_w4() -> dict[str, Any]:
    out: dict[str, Any] = {"eq hsdp": run_equal(shard=_hsdp)}
    # equality, traffic and Newton-Schulz work of an owner and a gather step (2 blocks: 8 matrices)
    for comm in ("owner", "gather"):
        model, opt, ref, ref_opts = make_pair(n_blocks=2, comm=comm)
        for k, (x, y) in enumerate(batches(2)):
            feed_same_grads(model, ref, x, y)
            for o in ref_opts:
                o.step()
            if k == 0:
                opt.step()  # the first step also checks the plan
            else:
                with CountCollectives() as counted, recording_order() as order:
                    opt.step()
            ref.zero_grad()
        muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
        plan = next(iter(opt._plans.values()))
        out[comm] = {
            "calls": dict(opt.comm_stats.calls), "sent": opt.comm_stats.total_sent(),
            "received": opt.comm_stats.total_received(), "dispatched": dict(counted.counts),
            "param_bytes": sum(p.numel() * p.element_size() for p in muon), "ns_work": opt.ns_work,
            "ns_total": sum(ns_cost(s) for s in plan.specs), "load": plan.load, "buckets": len(plan.buckets),
            "plan_sent": plan.elements_sent(dist.get_rank()) * 2,  # bf16 elements
            "diff": max_diff(model, ref),
            "order": order,
        }
    return out


def test_equal_w4_hsdp_traffic_and_work() -> None:
    results = _equal_w4()
    world = len(results)
    for rank, r in enumerate(results):
        assert r["eq hsdp"] == EXACT and r["owner"]["diff"] == EXACT and r["gather"]["diff"] == EXACT, r
        own, gat = r["owner"], r["gather"]
        # one all-to-all per bucket each way, nothing else (the plan check ran on the first step)
        assert own["calls"] == {"all_to_all": 2 * own["buckets"]}, own
        assert own["dispatched"] == {"alltoall_base_": 2 * own["buckets"]}, own
        assert gat["calls"] == {"all_gather": gat["buckets"]}, gat
        # bytes: what the plan predicts, and <= 2/W of the Muon parameters' bytes (x1.1)
        assert own["sent"] == own["plan_sent"], own
        assert own["sent"] <= 1.1 * 2 / world * own["param_bytes"], own
        assert own["sent"] <= 1.1 * 2 / world * own["param_bytes"] / 2, own  # the same bound on bf16 bytes
        assert own["sent"] < gat["sent"], (own, gat)
        # Newton-Schulz: the owner runs its share of the plan, the gather mode everything
        assert own["ns_work"] == own["load"][rank], own
        # overlap: bucket k+1's rows are on their way while bucket k is orthogonalized
        assert own["buckets"] == 2 and own["order"][:2] == ["all_to_all", "all_to_all"], own["order"]
        assert own["order"].index("ns") < own["order"].index("all_to_all", 2), own["order"]
        assert gat["ns_work"] == gat["ns_total"], gat
    work = [r["owner"]["ns_work"] for r in results]
    assert sum(work) == results[0]["owner"]["ns_total"]
    assert max(work) <= 1.5 * sum(work) / world, work  # ~1/W each (8 matrices of 3 costs on 4 ranks)


# --- bad input ------------------------------------------------------------------------------------------
@distributed(world_size=2)
def _bad_input() -> dict[str, str]:
    torch.manual_seed(0)
    model = shard_gpt(copy.deepcopy(make_pair()[2]))
    named = dict(model.named_parameters())
    errors: dict[str, str] = {}

    def refused(key: str, make: Any) -> None:
        try:
            make()
        except (ValueError, RuntimeError) as e:
            errors[key] = str(e)

    refused("1-d", lambda: Muon([("blocks.0.norm1.weight", named["blocks.0.norm1.weight"]),
                                 ("blocks.0.up.weight", named["blocks.0.up.weight"])]))
    mesh = init_device_mesh("cpu", (2,))
    col = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]))
    refused("shard(1)", lambda: Muon([("tp.weight", col)]))
    ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    expert = nn.Parameter(distribute_tensor(torch.randn(4, 8, 6), ep_mesh, [Shard(1)]))  # rows of each expert split
    refused("ep", lambda: Muon([("experts.w1", expert)]))
    refused("blocks", lambda: Muon([{"params": [named["blocks.0.up.weight"]], "param_names": ["blocks.0.up.weight"],
                                     "ns_blocks": 2}]))
    # built before fully_shard: the library's step hook refuses it (it runs for every optimizer)
    torch.manual_seed(0)
    raw = TinyGPT(n_blocks=1)
    early = Muon(muon_param_groups(raw))
    shard_gpt(raw)
    refused("before", early.step)
    # ranks that built different plans (here: another parameter order) are told, not left to hang
    a, b = named["blocks.0.up.weight"], named["blocks.0.down.weight"]
    order = [("blocks.0.up.weight", a), ("blocks.0.down.weight", b)]
    mixed = Muon(order[::-1] if dist.get_rank() == 1 else order)
    for q in (a, b):
        q.grad = distribute_tensor(torch.zeros(q.shape), q.device_mesh, q.placements, src_data_rank=None)
    refused("plan", mixed.step)
    # a gradient laid out unlike its parameter
    p = named["blocks.0.proj.weight"]
    opt = Muon([("blocks.0.proj.weight", p)])
    p.grad = distribute_tensor(torch.zeros(p.shape), p.device_mesh, [Shard(1)])
    refused("grad", opt.step)
    return errors


def test_bad_input_names_the_parameter() -> None:
    errors = _bad_input()[0]
    assert "'blocks.0.norm1.weight'" in errors["1-d"] and "(60,)" in errors["1-d"]
    assert "muon_param_groups" in errors["1-d"]  # the fix
    assert "'tp.weight'" in errors["shard(1)"] and "Shard(dim=1)" in errors["shard(1)"]
    assert "'experts.w1'" in errors["ep"] and "whole [m, n] matrices" in errors["ep"]
    assert "'blocks.0.up.weight'" in errors["blocks"] and "ns_blocks=2" in errors["blocks"]
    assert "'blocks.0.proj.weight'" in errors["grad"] and "gradient" in errors["grad"]
    assert "build the optimizer after fully_shard" in errors["before"]
    assert "plan differs across ranks" in errors["plan"] and "ranks [1]" in errors["plan"]


# --- experts, per-head blocks, plain parameters next to sharded ones -----------------------------------
class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 12, 7))  # 5 experts over 2 ranks: 3 + 2
        self.q = nn.Linear(7, 12, bias=False)  # 3 heads of 4 rows
        self.free = nn.Linear(7, 7, bias=False)  # not sharded by fully_shard: a plain parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bi,eoi->beo", x, self.w).sum(1)
        return (self.q(x) * h).sum() + self.free(x).pow(2).sum()


@distributed(world_size=2)
def _experts_heads_plain() -> float:
    torch.manual_seed(0)
    ref = Experts()
    model = copy.deepcopy(ref)
    fully_shard(model, ignored_params={model.free.weight})
    assert isinstance(model.w, DTensor) and not isinstance(model.free.weight, DTensor)
    groups = muon_param_groups(model, heads={"q.weight": 3})
    assert [g["param_names"] for g in groups] == [["w", "free.weight"], ["q.weight"]], groups
    opt = Muon(groups, lr=0.05)
    # reference: torch's Muon per expert and per head block (each a separate 2-D parameter)
    pieces = [nn.Parameter(ref.w.detach()[e].clone()) for e in range(5)]
    heads = [nn.Parameter(ref.q.weight.detach()[4 * h:4 * (h + 1)].clone()) for h in range(3)]
    free = nn.Parameter(ref.free.weight.detach().clone())
    ref_opt = torch.optim.Muon([*pieces, *heads, free], lr=0.05)
    for step in range(3):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step))
        ref.zero_grad()
        ref(x).backward()
        for e, piece in enumerate(pieces):
            piece.grad = ref.w.grad[e].clone()
        for h, head in enumerate(heads):
            head.grad = ref.q.weight.grad[4 * h:4 * (h + 1)].clone()
        free.grad = ref.free.weight.grad.clone()
        feed_same_grads(model, ref, x, None)
        ref_opt.step()
        opt.step()
        with torch.no_grad():
            ref.w.copy_(torch.stack(list(pieces)))
            ref.q.weight.copy_(torch.cat(list(heads)))
            ref.free.weight.copy_(free)
    return max_diff(model, ref)


def test_experts_per_head_and_plain_params() -> None:
    """3-D experts: per-expert Newton-Schulz on each rank's own experts (batched); ns_blocks: per head;
    a parameter fully_shard left plain is stepped as torch would."""
    assert all(d == EXACT for d in _experts_heads_plain()), _experts_heads_plain()


# --- routing a transformers Llama (tiny local config, nothing downloaded) -------------------------------
def _tiny_llama(tied: bool) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_routing(tied: bool) -> None:
    model = _tiny_llama(tied)
    groups = muon_param_groups(model, adamw_lr=1e-3, heads={"*.q_proj.weight": 4})
    routed = {n: (g["algorithm"], g.get("ns_blocks")) for g in groups
              for n in g["param_names"]}
    assert set(routed) == {n for n, _ in model.named_parameters()}  # every parameter once (tied: once)
    for name, (algorithm, blocks) in routed.items():
        hidden = any(k in name for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"))
        assert algorithm == ("muon" if hidden else "adamw"), name
        if hidden:
            assert blocks == (4 if "q_proj" in name else 1), name
    assert routed["model.embed_tokens.weight"][0] == "adamw"
    assert ("lm_head.weight" in routed) == (not tied)
    adamw = next(g for g in groups if g["algorithm"] == "adamw")
    assert adamw["lr"] == 1e-3
    assert {n.rsplit(".", 1)[0].split(".")[-1] for n in adamw["param_names"]} >= {"input_layernorm", "norm"}


def test_single_process_llama_equals_torch() -> None:
    """No process group: plain parameters, one optimizer for both algorithms, equal to torch's pair."""
    model = _tiny_llama(False)
    ref = copy.deepcopy(model)
    groups = muon_param_groups(model, adamw_lr=1e-3)
    opt = Muon(groups, lr=0.02, adjust_lr_fn="match_rms_adamw")
    ref_params = dict(ref.named_parameters())
    ref_opts = [torch.optim.Muon([ref_params[n] for n in groups[0]["param_names"]], lr=0.02,
                                 adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW([ref_params[n] for n in groups[1]["param_names"]], lr=1e-3)]
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        for m in (model, ref):
            m(ids, labels=ids).loss.backward()
        opt.step()
        for o in ref_opts:
            o.step()
        opt.zero_grad()
        for o in ref_opts:
            o.zero_grad()
    assert max_diff(model, ref) == EXACT
    assert set(opt.state_dict()["state"]) == set(range(len(ref_params)))  # one state dict for both


# --- state dicts: DCP and fully_shard.checkpoint at another world size ----------------------------------
def _train(model: nn.Module, opt: Muon, ref: nn.Module, ref_opts: list[torch.optim.Optimizer],
           data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in data:
        feed_same_grads(model, ref, x, y)
        opt.step()
        opt.zero_grad()
        for o in ref_opts:
            o.step()
        ref.zero_grad()


def _full_state(opt: Muon) -> dict[int, dict[str, torch.Tensor]]:
    return {k: {n: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for n, v in entry.items()}
            for k, entry in opt.state_dict()["state"].items()}


DATA = batches(4)


@distributed(world_size=2)
def _save_w2(dcp_path: str, ck_path: str) -> float:
    model, opt, ref, ref_opts = make_pair()
    _train(model, opt, ref, ref_opts, DATA[:2])
    assert all(isinstance(s["momentum_buffer"], DTensor) for s in opt.state.values() if "momentum_buffer" in s)
    checkpoint.save(ck_path, model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=dcp_path)
    saved = _full_state(opt)
    # a fresh model and optimizer (another seed) loaded through DCP continue exactly like the reference
    torch.manual_seed(1)
    fresh, fresh_opt, _, _ = make_pair()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=dcp_path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _full_state(fresh_opt)
    assert loaded.keys() == saved.keys()
    for k in saved:
        for n in saved[k]:
            assert torch.equal(loaded[k][n], saved[k][n]), (k, n)
    _train(fresh, fresh_opt, ref, ref_opts, DATA[2:])
    dist.barrier()
    return max_diff(fresh, ref)


@distributed(world_size=3)
def _load_w3(ck_path: str) -> float:
    first, first_opt, ref, ref_opts = make_pair()
    _train(first, first_opt, ref, ref_opts, DATA[:2])  # the reference's first steps
    model, opt, _, _ = make_pair()
    checkpoint.load(ck_path, model, opt)
    _train(model, opt, ref, ref_opts, DATA[2:])
    return max_diff(model, ref)


def test_state_dict_dcp_and_checkpoint_at_another_world_size(tmp_path: Path) -> None:
    """Momentum is a DTensor state: saved at W=2 through DCP (loaded into a fresh model there) and through
    checkpoint.save (loaded at W=3); training continues as the uninterrupted unsharded reference."""
    dcp_path, ck_path = str(tmp_path / "dcp"), str(tmp_path / "ck")
    assert all(d == EXACT for d in _save_w2(dcp_path, ck_path))
    assert all(d == EXACT for d in _load_w3(ck_path))


@distributed(world_size=2)
def _expert_parallel_experts() -> float:
    """Experts Shard(0) on an ``ep`` mesh (each rank holds whole experts): per-expert Newton-Schulz on the
    local experts, equal to the same Muon over the whole stack in one process."""
    torch.manual_seed(0)
    full = torch.randn(4, 8, 6)
    grads = [torch.randn(4, 8, 6) for _ in range(3)]
    ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    expert = nn.Parameter(distribute_tensor(full.clone(), ep_mesh, [Shard(0)]))
    plain = nn.Parameter(full.clone())
    opts = [Muon([("experts.w1", expert)], lr=0.02), Muon([("experts.w1", plain)], lr=0.02)]
    for g in grads:
        expert.grad = distribute_tensor(g.clone(), ep_mesh, [Shard(0)])
        plain.grad = g.clone()
        for opt in opts:
            opt.step()
    return float((expert.full_tensor() - plain.detach()).abs().max())


def test_expert_parallel_experts_step_locally() -> None:
    assert max(_expert_parallel_experts()) == EXACT


@distributed(world_size=2)
def _profiled() -> dict[str, Any]:
    from fully_shard import profile
    from tests.models import loss_fn
    from tests.policies.common import local_slice

    torch.manual_seed(0)
    model = shard_gpt(TinyGPT(n_blocks=2))
    opt = Muon(muon_param_groups(model), lr=0.02)
    sent, calls = [], []
    with profile(model) as prof:
        for x, y in batches(2):
            loss_fn(model(local_slice(x)), local_slice(y)).backward()
            opt.step()
            opt.zero_grad()
            sent.append(opt.comm_stats.total_sent())
            calls.append(sum(n for name, n in opt.comm_stats.calls.items() if name != "plan_check"))
            prof.step()
    return {"summary": prof.summary(), "table": prof.table(), "sent": sent, "calls": calls}


def test_profiler_counts_the_optimizer_collectives() -> None:
    for r in _profiled():
        s = r["summary"]
        assert r["calls"][0] > 0 and s["optimizer_collectives"] == sum(r["calls"]) / len(r["calls"]), (s, r["calls"])
        assert s["optimizer_bytes"] == sum(r["sent"]) / len(r["sent"]), (s, r["sent"])
        assert "optimizer step:" in r["table"], r["table"]
