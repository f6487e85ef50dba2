"""What frameworks call on FSDP1, side by side with torch's FSDP1 where it runs on CPU/gloo: summon_full_params
(writeback, rank0_only, offload_to_cpu, with_grads), no_sync accumulation (= one step on the whole batch),
apply, names and delegation, fsdp_modules, per-rank state size, an optimizer built before wrapping, torch's
enums and configs, CPU offload."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fully_shard import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from fully_shard.wrap import transformer_auto_wrap_policy
from tests.distributed.harness import distributed
from tests.wrap.common import both_note_models, full_state_dict, max_diff
from tests.wrap.note import VOCAB, TransformerBlock, batch, build_model, loss_of, note_code, run_note, train

FSDP = FullyShardedDataParallel


@distributed(world_size=2)
def _summon() -> dict[str, Any]:
    rank = dist.get_rank()
    ours, theirs = both_note_models(dtype=None)
    out: dict[str, Any] = {}
    for model in (ours, theirs):
        cls = type(model)
        with cls.summon_full_params(model):  # writeback=True: the edit persists
            w = model.module.blocks[0].module.up.weight
            assert type(w) is nn.Parameter and tuple(w.shape) == (128, 32), (type(w), w.shape)
            with torch.no_grad():
                w.fill_(0.5)
                model.module.tok.weight[3].zero_()
        with cls.summon_full_params(model, writeback=False), torch.no_grad():  # the edit is discarded
            model.module.blocks[1].module.down.weight.fill_(7.0)
        out[cls.__module__] = full_state_dict(model)
    # rank0_only + offload_to_cpu (torch's FSDP1 fails this one on CPU: "storage of size 0")
    with FSDP.summon_full_params(ours, writeback=False, rank0_only=True, offload_to_cpu=True):
        w = ours.module.blocks[0].module.up.weight
        if rank == 0:
            assert type(w) is nn.Parameter and tuple(w.shape) == (128, 32) and w.device.type == "cpu"
            assert bool((w == 0.5).all())
        else:  # the other ranks keep their shards
            assert isinstance(w, DTensor) and tuple(w.to_local().shape) == (64, 32)
    # recurse=False: only the given wrapper's own parameters
    with FSDP.summon_full_params(ours.blocks[0], recurse=False):
        assert type(ours.module.blocks[0].module.up.weight) is nn.Parameter
        assert isinstance(ours.module.blocks[1].module.up.weight, DTensor)
        assert isinstance(ours.module.tok.weight, DTensor)
    a, b = out.values()
    assert bool((a["blocks.0.up.weight"] == 0.5).all()) and not bool((a["blocks.1.down.weight"] == 7.0).any())
    assert bool((a["tok.weight"][3] == 0).all())
    return {"diff": max_diff(a, b)}


def test_summon_full_params_writeback_like_torch() -> None:
    for r in _summon():
        assert r["diff"] == 0.0, r


@distributed(world_size=2)
def _summon_with_grads() -> float:
    ours, _ = both_note_models(dtype=None)
    _, theirs = both_note_models(dtype=None, extra="use_orig_params=True")  # torch's with_grads needs it
    grads = []
    for model in (ours, theirs):
        loss_of(model, 0).backward()
        with type(model).summon_full_params(model, with_grads=True):
            grads.append({n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()})
    return max_diff(*grads)


def test_summon_full_params_with_grads_equals_torch() -> None:
    assert max(_summon_with_grads()) <= 1e-7


@distributed(world_size=2)
def _no_sync() -> dict[str, float]:
    """Two micro-batches (one inside no_sync) vs one backward of their mean loss; ours and torch's."""
    ours, theirs = both_note_models(dtype=None)
    whole = run_note(note_code(dtype=None, ours=True))
    results = {}
    for name, model in (("ours", ours), ("torch", theirs)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with model.no_sync():
            (loss_of(model, 0) / 2).backward()
        (loss_of(model, 1) / 2).backward()
        opt.step()
        results[name] = full_state_dict(model)
    opt = torch.optim.SGD(whole.parameters(), lr=0.5)
    x0, y0 = batch(0)
    x1, y1 = batch(1)
    logits = whole(torch.cat([x0, x1]))
    F.cross_entropy(logits.reshape(-1, VOCAB), torch.cat([y0, y1]).reshape(-1)).backward()
    opt.step()
    return {"vs_whole": max_diff(results["ours"], full_state_dict(whole)),
            "vs_torch": max_diff(results["ours"], results["torch"])}


def test_no_sync_accumulation_equals_one_step_on_the_whole_batch() -> None:
    for r in _no_sync():
        assert r["vs_whole"] <= 1e-6 and r["vs_torch"] <= 1e-6, r


@distributed(world_size=2)
def _surface() -> dict[str, Any]:
    plain = build_model()
    original = build_model()
    blocks = list(original.blocks)
    policy = partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    model = FSDP(original, auto_wrap_policy=policy)
    assert model.module is original and model.tok is original.tok  # .module, attribute delegation
    assert isinstance(model.blocks[0], FSDP) and model.blocks[0].module is blocks[0]
    assert repr(model).startswith("FullyShardedDataParallel(\n  (_fsdp_wrapped_module): GPT(")
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert FSDP.fsdp_modules(model) == [model, model.blocks[0], model.blocks[1]]
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    assert model.check_is_root() and not model.blocks[0].check_is_root()
    world = dist.get_world_size()
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in plain.parameters())
    padding = sum((-p.shape[0] % world) * p[0].numel() for p in plain.parameters()) // world
    # apply(fn) with the full parameters in place, written back (as torch's)
    ours, theirs = both_note_models(dtype=None)
    for m in (ours, theirs):
        m.apply(lambda mod: torch.nn.init.constant_(mod.weight, 0.25) if isinstance(mod, nn.Linear) else None)
    applied = max_diff(full_state_dict(ours), full_state_dict(theirs))
    return {"local": local, "bound": total / world + padding, "total": total, "applied": applied}


def test_names_delegation_fsdp_modules_apply_and_state_per_rank() -> None:
    for r in _surface():
        assert r["local"] <= r["bound"] < r["total"], r
        assert r["applied"] == 0.0, r


@distributed(world_size=2)
def _optimizer_before_wrapping() -> tuple[list[float], list[float]]:
    policy = partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    module = build_model()
    early = torch.optim.AdamW(module.parameters(), lr=1e-2)  # built before wrapping: holds the originals
    model = FSDP(module, auto_wrap_policy=policy)
    losses_early = train(model, early, range(3))[0]
    held = {id(p) for g in early.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}  # its groups now hold the sharded parameters
    model2 = FSDP(build_model(), auto_wrap_policy=policy)
    losses_after = train(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), range(3))[0]
    return losses_early, losses_after


def test_optimizer_built_before_wrapping_keeps_training() -> None:
    for early, after in _optimizer_before_wrapping():
        assert early == after, (early, after)


@distributed(world_size=2)
def _torch_objects_and_offload() -> dict[str, Any]:
    from torch.distributed.fsdp import BackwardPrefetch as TBP
    from torch.distributed.fsdp import CPUOffload as TCPUOffload
    from torch.distributed.fsdp import MixedPrecision as TMP
    from torch.distributed.fsdp import ShardingStrategy as TSS

    policy = partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    mine = FSDP(build_model(), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy=policy,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), cpu_offload=CPUOffload(offload_params=True))
    theirs = FSDP(build_model(), sharding_strategy=TSS.SHARD_GRAD_OP, auto_wrap_policy=policy,
                  mixed_precision=TMP(param_dtype=torch.bfloat16), cpu_offload=TCPUOffload(offload_params=True),
                  backward_prefetch=TBP.BACKWARD_POST)
    assert theirs.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP and isinstance(theirs.mixed_precision,
                                                                                     MixedPrecision)
    # what torch's test_wrap checks on every wrapper: equal to the torch objects passed in
    for unit in FSDP.fsdp_modules(theirs):
        assert unit.cpu_offload == TCPUOffload(offload_params=True), unit.cpu_offload
        assert unit.backward_prefetch == TBP.BACKWARD_POST, unit.backward_prefetch
    plain = FSDP(build_model(), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy=policy,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    runs = [train(m, torch.optim.AdamW(m.parameters(), lr=1e-2), range(3))[0] for m in (mine, theirs, plain)]
    return {"runs": runs}


def test_torch_enums_and_configs_and_cpu_offload() -> None:
    for r in _torch_objects_and_offload():
        mine, theirs, plain = r["runs"]
        assert mine == theirs == plain, r


@distributed(world_size=2)
def _reduce_dtypes() -> dict[str, list[str]]:
    from unittest import mock

    from fully_shard.core import policy
    from fully_shard.core.state import get_state

    out: dict[str, list[str]] = {}
    for rule in (False, True):  # torch < 2.15's reading of FSDP2's reduce_dtype=None, and 2.15's (original dtype)
        with mock.patch.object(policy, "REDUCE_IN_ORIG_DTYPE", rule):
            for reduce in (None, torch.float32):
                model = FullyShardedDataParallel(build_model(), auto_wrap_policy=partial(
                    transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock}),
                    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce))
                units = [m for m in model.modules() if get_state(m) is not None]
                out[f"2.15 rule={rule}, reduce_dtype={reduce}"] = sorted(
                    {str(g.reduce_dtype) for m in units for g in get_state(m).groups if g.params})  # type: ignore[union-attr]
    return out


def test_mixed_precision_reduces_in_param_dtype_by_default_on_every_torch() -> None:
    """FSDP1's rule: reduce_dtype=None reduces in param_dtype, on every torch (torch 2.15 changed only FSDP2's
    MixedPrecisionPolicy to reduce in the original dtype; its FSDP1 still reduces in param_dtype)."""
    got = _reduce_dtypes()[0]
    assert got == {"2.15 rule=False, reduce_dtype=None": ["torch.bfloat16"],
                   "2.15 rule=False, reduce_dtype=torch.float32": ["torch.float32"],
                   "2.15 rule=True, reduce_dtype=None": ["torch.bfloat16"],
                   "2.15 rule=True, reduce_dtype=torch.float32": ["torch.float32"]}, got


@distributed(world_size=2)
def _clip_without_gradients() -> dict[str, Any]:
    import warnings

    model = FSDP(nn.Linear(24, 24))
    model(torch.randn(4, 24))  # forward only: no gradient anywhere
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = model.clip_grad_norm_(1.0)
    return {"messages": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
            "dtype": total.dtype, "total": float(total), "rank": dist.get_rank()}


def test_clip_grad_norm_without_gradients_warns_like_torch() -> None:
    """torch's FSDP1 warns (and its test_fsdp_clip_grad_norm.test_no_gradients matches the words) when
    clip_grad_norm_ finds no gradient on a rank, and returns a float32 zero."""
    for r in _clip_without_gradients():
        expected = (f"Called FSDP.clip_grad_norm_() on rank {r['rank']} with no gradients -- returning the total "
                    "norm in the default dtype torch.float32")
        assert expected in r["messages"], f"expected torch's warning {expected!r}, got {r['messages']}"
        assert r["dtype"] == torch.float32 and r["total"] == 0.0, r


def test_torch_config_objects_equal_ours() -> None:
    """A wrapper keeps this library's CPUOffload / BackwardPrefetch; they equal torch's of the same value
    (FSDP1 code and torch's own tests compare a wrapper's attributes with torch's objects)."""
    from torch.distributed.fsdp import BackwardPrefetch as TBP
    from torch.distributed.fsdp import CPUOffload as TCPUOffload

    from fully_shard import BackwardPrefetch

    assert CPUOffload(offload_params=True) == TCPUOffload(offload_params=True)
    assert TCPUOffload(offload_params=False) == CPUOffload(), "expected torch's CPUOffload() to equal ours"
    assert CPUOffload() != TCPUOffload(offload_params=True) and CPUOffload() != "CPUOffload"
    assert BackwardPrefetch.BACKWARD_POST == TBP.BACKWARD_POST and TBP.BACKWARD_PRE == BackwardPrefetch.BACKWARD_PRE
    assert BackwardPrefetch.BACKWARD_POST != TBP.BACKWARD_PRE and BackwardPrefetch.BACKWARD_PRE != "BACKWARD_PRE"
    assert len({BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST}) == 2


@distributed(world_size=2)
def _assert_state_like_torch() -> dict[str, Any]:
    from torch.distributed.fsdp._common_utils import TrainingState as TState

    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    model(torch.randn(2, 4)).sum().backward()
    out: dict[str, Any] = {}

    def message(state: Any) -> str:
        try:
            model._assert_state(state)
        except ValueError as e:
            return str(e)
        return "ok"

    out["idle_after_step"] = message(TState.IDLE)
    out["idle_in_list"] = message([TState.FORWARD_BACKWARD, TState.IDLE])
    out["forward_backward_after_step"] = message(TState.FORWARD_BACKWARD)
    with FSDP.summon_full_params(model):
        out["summon_inside"] = message(TState.SUMMON_FULL_PARAMS)
        out["idle_inside"] = message(TState.IDLE)
    return out


def test_assert_state_like_torch() -> None:
    """torch's FSDP1 ``_assert_state`` (torch's common_fsdp calls it after every training step of its
    parity tests): passes in the state named, else ValueError in torch's words."""
    for r in _assert_state_like_torch():
        assert r["idle_after_step"] == "ok" and r["idle_in_list"] == "ok" and r["summon_inside"] == "ok", r
        assert r["forward_backward_after_step"].startswith("expected to be in states [<TrainingState."
                                                           "FORWARD_BACKWARD") and \
            r["forward_backward_after_step"].endswith("current state is TrainingState.IDLE"), r
        assert r["idle_inside"].endswith("current state is TrainingState.SUMMON_FULL_PARAMS"), r
