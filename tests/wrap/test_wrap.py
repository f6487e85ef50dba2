"""FSDP1-style quick start: ShardingStrategy -> fully_shard mapping (parity and collective counts per
strategy) and auto_wrap with every policy, granularity k = 1..all, tied weights and a transformers
LlamaDecoderLayer."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fully_shard import MixedPrecisionPolicy, ShardingStrategy
from fully_shard.comm import trace
from fully_shard.comm.trace import EventKind, Phase
from fully_shard.wrap import (
    ROOT,
    GranularityPolicy,
    ModuleClassPolicy,
    ParamCountPolicy,
    PredicatePolicy,
    auto_wrap,
    plan_wrap,
    strategy_kwargs,
)
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.models import Block, TinyGPT, batches, loss_fn
from tests.policies.common import local_slice, train_parity

UNITS = [ROOT, "blocks.0", "blocks.1", "blocks.2"]


def one_step_events(model: nn.Module) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    x, y = batches(1, batch=8, seed=5)[0]
    with trace.record() as events, CountCollectives() as counted:
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
    kept = [(e.kind, e.fqn or ROOT, e.phase, e.group_size) for e in events
            if e.kind in (EventKind.ALL_GATHER, EventKind.REDUCE_SCATTER, EventKind.ALL_REDUCE)]
    return kept, dict(counted.counts)


def summarize(events: list[tuple[Any, ...]]) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for kind, fqn, phase, size in events:
        key = kind.value if kind is not EventKind.ALL_GATHER else f"all_gather_{phase.value}"
        out.setdefault(key, []).append((fqn, size))
    return {k: sorted(v) for k, v in out.items()}


def _strategy_run(strategy_name: str) -> dict[str, object]:
    strategy = ShardingStrategy[strategy_name]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) \
        if strategy is ShardingStrategy.HYBRID_SHARD else None
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    plan = auto_wrap(model, {Block}, strategy=strategy, mesh=mesh)
    kwargs = strategy_kwargs(strategy, mesh=mesh)
    events, counted = one_step_events(model)
    model.zero_grad()  # no optimizer step: model and ref still hold the same weights
    result: dict[str, object] = dict(train_parity(model, ref, steps=5, batch=8))
    p = model.blocks[0].up.weight
    result.update(
        events=summarize(events), counted=counted, units=[u.fqn for u in plan.units],
        mesh_shape=tuple(kwargs["mesh"].shape), raf=kwargs["reshard_after_forward"],
        placements=tuple(p.placements), local_shape=tuple(p.to_local().shape), shape=tuple(p.shape))
    return result


@distributed(world_size=2)
def _strategy_w2(strategy_name: str) -> dict[str, object]:
    return _strategy_run(strategy_name)


@distributed(world_size=4)
def _strategy_w4(strategy_name: str) -> dict[str, object]:
    return _strategy_run(strategy_name)


BLOCKS = [f"blocks.{i}" for i in range(3)]


def expected_events(strategy: str) -> tuple[dict[str, list[tuple[str, int]]], dict[str, int]]:
    """Per strategy: trace events (unit, group size) and the dispatcher's collective counts for one
    forward+backward of TinyGPT wrapped per block (4 units; the root keeps its params for backward).
    A one-rank shard group (NO_SHARD) issues no all-gather or reduce-scatter, as torch's FSDP2."""
    def units(names: list[str], size: int) -> list[tuple[str, int]]:
        return sorted((n, size) for n in names)

    if strategy == "FULL_SHARD":  # W=2
        ev = {"all_gather_forward": units(UNITS, 2), "all_gather_backward": units(BLOCKS, 2),
              "reduce_scatter": units(UNITS, 2)}
        return ev, {"all_gather": 7, "reduce_scatter": 4}
    if strategy == "SHARD_GRAD_OP":  # gathered params kept from forward to backward: no re-gather
        ev = {"all_gather_forward": units(UNITS, 2), "reduce_scatter": units(UNITS, 2)}
        return ev, {"all_gather": 4, "reduce_scatter": 4}
    if strategy == "NO_SHARD":  # DDP: whole params; the only real traffic is the all-reduce over 2
        ev = {"all_gather_forward": units(UNITS, 1), "reduce_scatter": units(UNITS, 1),
              "all_reduce": units(UNITS, 2)}
        return ev, {"all_reduce": 4}
    # HYBRID_SHARD on 2x2: FULL_SHARD inside the shard group of 2, then an all-reduce over 2 replicas
    ev = {"all_gather_forward": units(UNITS, 2), "all_gather_backward": units(BLOCKS, 2),
          "reduce_scatter": units(UNITS, 2), "all_reduce": units(UNITS, 2)}
    return ev, {"all_gather": 7, "reduce_scatter": 4, "all_reduce": 4}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_strategy_mapping_parity_and_collectives(strategy: str) -> None:
    ev, counts = expected_events(strategy)
    for r in _strategy_w2(strategy):
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r
        assert r["events"] == ev, r["events"]
        assert {k: v for k, v in r["counted"].items() if k != "broadcast"} == counts, r["counted"]
        assert r["units"] == ["blocks.2", "blocks.1", "blocks.0", ROOT] or sorted(r["units"]) == sorted(UNITS)
        if strategy == "NO_SHARD":  # replicated: a shard group of one holds the whole parameter
            assert r["mesh_shape"] == (2, 1) and r["raf"] is False
            assert r["placements"] == (Replicate(), Shard(0)) and r["local_shape"] == r["shape"]
        else:
            assert r["mesh_shape"] == (2,) and r["raf"] is (strategy == "FULL_SHARD")
            assert r["local_shape"][0] < r["shape"][0]


def test_hybrid_shard_on_2x2() -> None:
    ev, counts = expected_events("HYBRID_SHARD")
    for r in _strategy_w4("HYBRID_SHARD"):
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r
        assert r["events"] == ev, r["events"]
        assert {k: v for k, v in r["counted"].items() if k != "broadcast"} == counts, r["counted"]
        assert r["mesh_shape"] == (2, 2) and r["placements"] == (Replicate(), Shard(0))


@distributed(world_size=2)
def _policy_units(policy_name: str, arg: Any) -> dict[str, object]:
    model = TinyGPT()
    policies = {"class": lambda: ModuleClassPolicy({Block}), "count": lambda: ParamCountPolicy(arg),
                "predicate": lambda: PredicatePolicy(lambda fqn, m: fqn in arg),
                "granularity": lambda: GranularityPolicy(blocks_per_unit=arg)}
    policy = policies[policy_name]()
    dry = plan_wrap(copy.deepcopy(model), policy, shard_world=2)
    ref = copy.deepcopy(model)
    plan = auto_wrap(model, policy)
    events, _ = one_step_events(model)
    model.zero_grad()
    out: dict[str, object] = dict(train_parity(model, ref, steps=3, batch=8))
    out.update(units=[u.fqn for u in plan.units], plan=plan, dry=dry, table=str(plan),
               n_params=sum(p.numel() for p in ref.parameters()),
               ag_forward=sum(1 for k, _, ph, _ in events if k is EventKind.ALL_GATHER and ph is Phase.FORWARD),
               ag_backward=sum(1 for k, _, ph, _ in events if k is EventKind.ALL_GATHER and ph is Phase.BACKWARD))
    return out


@pytest.mark.parametrize(("policy", "arg", "units"), [
    ("class", None, ["blocks.2", "blocks.1", "blocks.0", ROOT]),
    # FSDP1 size-based: a block (~33k) and the 997x60 embedding / head (59,820 each) reach 20k; no
    # Linear inside a block does (qkv has 10,800)
    ("count", 20_000, ["blocks.0", "blocks.1", "blocks.2", "tok", "head", ROOT]),
    ("predicate", {"blocks.0", "blocks.2"}, ["blocks.2", "blocks.0", ROOT]),
    ("granularity", 1, ["blocks.0", "blocks.1", "blocks.2", ROOT]),
    ("granularity", 2, ["blocks.0+blocks.1", "blocks.2", ROOT]),
    ("granularity", "all", ["blocks.0+blocks.1+blocks.2", ROOT]),
])
def test_policies_pick_units_and_train(policy: str, arg: Any, units: list[str]) -> None:
    for r in _policy_units(policy, arg):
        assert sorted(r["units"]) == sorted(units), r["units"]
        assert r["units"][-1] == ROOT
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r
        plan, dry = r["plan"], r["dry"]
        assert plan.units == dry.units, (plan.units, dry.units)  # the dry run predicts the real groups
        assert sum(u.num_params for u in plan.units) == r["n_params"]
        assert r["ag_forward"] == len(units) and r["ag_backward"] == len(units) - 1
        assert "gathered" in r["table"] and "<root>" in r["table"]


@distributed(world_size=2)
def _granularity_sweep() -> list[dict[str, int]]:
    out = []
    for k in (1, 2, "all"):
        model = TinyGPT()
        plan = auto_wrap(model, GranularityPolicy(blocks_per_unit=k))
        events, _ = one_step_events(model)
        out.append({"units": len(plan.units), "largest_block_unit": max(u.gathered_nbytes for u in plan.units
                                                                        if u.fqn != ROOT),
                    "all_gathers": sum(1 for e in events if e[0] is EventKind.ALL_GATHER),
                    "ag_bytes_per_step": plan.all_gather_bytes_per_step})
    return out


def test_granularity_trades_all_gather_count_for_unit_size() -> None:
    k1, k2, kall = _granularity_sweep()[0]
    assert k1["all_gathers"] > k2["all_gathers"] > kall["all_gathers"] == 3  # root + blocks fwd + bwd
    assert k1["largest_block_unit"] < k2["largest_block_unit"] < kall["largest_block_unit"]
    assert kall["largest_block_unit"] == 3 * k1["largest_block_unit"]  # three identical blocks
    assert k1["ag_bytes_per_step"] == k2["ag_bytes_per_step"] == kall["ag_bytes_per_step"]


@distributed(world_size=2)
def _tied(pick: str) -> dict[str, object]:
    ref = TinyGPT(tied=True)
    model = copy.deepcopy(ref)
    chosen = {"both": {"tok", "head"}, "head": {"head"}}[pick]
    plan = auto_wrap(model, PredicatePolicy(lambda fqn, m: fqn in chosen or isinstance(m, Block)))
    out: dict[str, object] = dict(train_parity(model, ref, steps=3, batch=8))
    out.update(units=[u.fqn for u in plan.units], notes=plan.notes,
               still_tied=model.tok.weight is model.head.weight)
    return out


@pytest.mark.parametrize(("pick", "unit"), [("both", "tok+head"), ("head", "head+tok")])
def test_tied_parameters_end_up_in_one_unit(pick: str, unit: str) -> None:
    for r in _tied(pick):
        assert unit in r["units"], r["units"]
        assert any("tied parameter" in n for n in r["notes"]), r["notes"]
        assert r["still_tied"]
        assert r["loss_diff"] < 1e-5 and r["param_diff"] < 1e-5, r


def test_policy_errors() -> None:
    with pytest.raises(ValueError, match=r"picked 'blocks', a ModuleList without forward\(\).*Fix"):
        plan_wrap(TinyGPT(), ModuleClassPolicy({nn.ModuleList}), shard_world=2)
    with pytest.raises(ValueError, match=r"blocks_per_unit=.*must be an int >= 1 or 'all', got 0"):
        GranularityPolicy(blocks_per_unit=0)
    with pytest.raises(ValueError, match=r"min_params=.*must be a positive int, got -5"):
        ParamCountPolicy(-5)
    with pytest.raises(TypeError, match=r"ModuleClassPolicy expects nn.Module subclasses"):
        ModuleClassPolicy({int})
    with pytest.raises(TypeError, match=r"auto_wrap policy must be"):
        plan_wrap(TinyGPT(), 3, shard_world=2)
    with pytest.raises(ValueError, match=r"no ModuleList/Sequential of same-class modules.*block_classes"):
        plan_wrap(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), GranularityPolicy(), shard_world=2)


def test_granularity_finds_blocks_by_class_set() -> None:
    plan = plan_wrap(TinyGPT(), GranularityPolicy(blocks_per_unit=2, block_classes=frozenset({Block})),
                     shard_world=4, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert [u.fqn for u in plan.units] == ["blocks.0+blocks.1", "blocks.2", ROOT]
    first, second = plan.units[0], plan.units[1]
    assert first.num_params == 2 * second.num_params
    # 4 ranks' padded fp32 shards, gathered at bf16: half their bytes; about half the fp32 size
    assert first.gathered_nbytes == 4 * first.shard_nbytes // 2
    assert first.nbytes // 2 <= first.gathered_nbytes < first.nbytes // 2 + 4 * 1024


# --- transformers ---------------------------------------------------------------------------------
def _tiny_llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


@distributed(world_size=2, timeout=240)
def _llama(tied: bool, meta: bool) -> dict[str, object]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fully_shard.core.init import materialize_meta_module

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = _tiny_llama(tied)
    else:
        model = _tiny_llama(tied)
        ref = copy.deepcopy(model)
    plan = auto_wrap(model, ModuleClassPolicy({LlamaDecoderLayer}),
                     mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    if meta:
        materialize_meta_module(model, device="cpu", init_fn=model._init_weights)
        ref = _tiny_llama(tied)
        with torch.no_grad():
            ref_params = dict(ref.named_parameters())
            for n, p in model.named_parameters():
                ref_params[n].copy_(p.full_tensor())
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 101, (6, 4, 12), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    diffs = []
    for ids in data:
        loss = model(input_ids=local_slice(ids), labels=local_slice(ids)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        diffs.append(abs(mean.item() - ref_loss.item()))
    inv = model.model.rotary_emb.inv_freq
    return {"units": [u.fqn for u in plan.units], "loss_diff": max(diffs), "first_loss": ref_loss.item(),
            "inv_freq_ok": bool(torch.isfinite(inv).all()) and inv[0].item() == 1.0,
            "tied": model.lm_head.weight is model.model.embed_tokens.weight}


@pytest.mark.parametrize(("tied", "meta"), [(False, False), (True, True)])
def test_llama_decoder_layer_policy(tied: bool, meta: bool) -> None:
    pytest.importorskip("transformers")
    for r in _llama(tied, meta):
        assert sorted(r["units"]) == sorted([f"model.layers.{i}" for i in range(3)] + [ROOT]), r["units"]
        # (batch of 4 splits 2+2; the per-rank mean of token losses equals the global mean here)
        assert r["loss_diff"] < 1e-4, r
        assert r["inv_freq_ok"] and r["tied"] is tied
