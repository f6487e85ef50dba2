"""Bad input to FullyShardedDataParallel: a clear error naming what and where, on every rank, the user's model
(and optimizer) unchanged: an unknown strategy, a policy that wraps nothing, a state dict or optimizer state
of another model (missing/unexpected keys, wrong shapes), and the FSDP1 options this library refuses."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.nn as nn

from fully_shard import FullyShardedDataParallel, MixedPrecision, StateDictType
from fully_shard.core.state import get_state
from fully_shard.wrap import CustomPolicy, ModuleWrapPolicy, lambda_auto_wrap_policy, size_based_auto_wrap_policy
from fully_shard.wrap import transformer_auto_wrap_policy as twrap
from tests.distributed.harness import distributed
from tests.wrap.common import full_state_dict
from tests.wrap.note import TransformerBlock, build_model, loss_of, note_code, run_note, train

FSDP = FullyShardedDataParallel


def _snapshot(module: nn.Module) -> list[tuple[str, int, torch.Tensor]]:
    return [(n, id(p), p.detach().clone()) for n, p in module.named_parameters()]


def _unchanged(module: nn.Module, before: list[tuple[str, int, torch.Tensor]]) -> bool:
    after = _snapshot(module)
    return (not any(isinstance(m, FSDP) or get_state(m) is not None for m in module.modules())
            and [(n, i) for n, i, _ in after] == [(n, i) for n, i, _ in before]
            and all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(after, before)))


def _message(fn: Any) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


class _DummyProcessGroup:
    """What torch's FSDP1 tests pass as ``process_group`` (common_fsdp.DummyProcessGroup): a rank and a size."""

    def __init__(self, *, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"DummyProcessGroup(rank={self._rank}, size={self._size})"


@distributed(world_size=2)
def _bad_construction() -> dict[str, tuple[str, bool]]:
    cases = {
        "strategy_string": {"sharding_strategy": "FULL_SHARD"},
        "strategy_int": {"sharding_strategy": 7},
        "class_not_in_model": {"auto_wrap_policy": partial(twrap, transformer_layer_cls={nn.Conv2d})},
        "module_wrap_nothing": {"auto_wrap_policy": ModuleWrapPolicy({nn.GRU})},
        "lambda_nothing": {"auto_wrap_policy": partial(lambda_auto_wrap_policy, lambda_fn=lambda m: False)},
        "custom_nothing": {"auto_wrap_policy": CustomPolicy(lambda m: False)},
        "not_a_policy": {"auto_wrap_policy": 3},
        "low_precision_grads": {"mixed_precision": MixedPrecision(torch.bfloat16, keep_low_precision_grads=True)},
        "both_ignored": {"ignored_modules": [], "ignored_states": []},
        "hybrid_pair": {"sharding_strategy": "HYBRID_SHARD"},
        "dummy_group": {"process_group": _DummyProcessGroup(rank=0, size=2)},
        "string_group": {"process_group": "world"},
    }
    out = {}
    for name, kwargs in cases.items():
        model = build_model()
        before = _snapshot(model)
        out[name] = (_message(lambda model=model, kwargs=kwargs: FSDP(model, **kwargs)), _unchanged(model, before))
    model = build_model()
    FSDP(model, auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=10**9))  # below the size: one unit
    out["twice"] = (_message(lambda: FSDP(model)), True)
    model = build_model()
    model.blocks[1] = FSDP(model.blocks[1])  # a unit inside, then auto-wrapping around it
    out["auto_wrap_around_unit"] = (_message(lambda: FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))),
                                    True)
    return out


def test_bad_construction_is_refused_and_leaves_the_model_unchanged() -> None:
    results = _bad_construction()
    assert results[0].keys() == results[1].keys()
    for name, (message, unchanged) in results[0].items():
        assert unchanged, (name, message)
        assert all(r[name][0] == message for r in results), name  # on every rank, the same words
    r = results[0]
    assert "expected one of ShardingStrategy.FULL_SHARD" in r["strategy_string"][0] and "'FULL_SHARD'" in \
        r["strategy_string"][0]
    assert "got 7" in r["strategy_int"][0]
    for name in ("class_not_in_model", "module_wrap_nothing", "lambda_nothing", "custom_nothing"):
        assert "wraps no module of GPT, whose module classes are" in r[name][0] and "TransformerBlock" in r[name][0], r
        assert "auto_wrap_policy=None" in r[name][0]
    assert "Conv2d" in r["class_not_in_model"][0]
    assert r["not_a_policy"][0].startswith("TypeError") and "got 3" in r["not_a_policy"][0]
    assert r["low_precision_grads"][0].startswith("NotImplementedError: MixedPrecision(keep_low_precision_grads=True)")
    assert "not both" in r["both_ignored"][0]
    assert "already sharded" in r["twice"][0]
    # torch's own sentence (torch's test_wrap.py matches it with assertRaisesRegex), then our fix
    wrapped = r["auto_wrap_around_unit"][0]
    assert wrapped.startswith("ValueError"), wrapped
    assert "FSDP auto wrapping requires modules to not already have FSDP applied but found blocks.1 in" in wrapped, \
        wrapped
    assert "Fix: drop auto_wrap_policy" in wrapped, wrapped
    assert "process_group must be a torch.distributed.ProcessGroup" in r["dummy_group"][0], r["dummy_group"]
    assert "DummyProcessGroup(rank=0, size=2)" in r["dummy_group"][0] and "Fix: pass dist.new_group" in \
        r["dummy_group"][0]
    assert "got str 'world'" in r["string_group"][0], r["string_group"]


@distributed(world_size=2)
def _bad_state_dict(kind_name: str) -> dict[str, Any]:
    kind = StateDictType[kind_name]
    model = run_note(note_code(ours=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(2))
    before = full_state_dict(model)
    opt_before = [(k, {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()})
                  for k, s in opt.state_dict()["state"].items()]
    with FSDP.state_dict_type(model, kind):
        good = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    other = FSDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other(torch.randn(2, 8)).sum().backward()
    other_opt.step()
    with FSDP.state_dict_type(other, kind):
        foreign, foreign_osd = other.state_dict(), FSDP.optim_state_dict(other, other_opt)
    missing = dict(good)
    missing.pop("blocks.1.up.bias")
    unexpected = {**good, "blocks.0.extra.weight": torch.zeros(3)}
    wrong = {**good, "blocks.0.up.weight": torch.zeros(5, 32)}
    out = {}
    with FSDP.state_dict_type(model, kind):
        for name, sd in (("foreign", foreign), ("missing", missing), ("unexpected", unexpected), ("shape", wrong)):
            out[name] = _message(lambda sd=sd: model.load_state_dict(sd))
        out["shape_not_strict"] = _message(lambda: model.load_state_dict(wrong, strict=False))
        out["optim_foreign"] = _message(lambda: FSDP.optim_state_dict_to_load(model, opt, foreign_osd))
        missing_ok = model.load_state_dict(missing, strict=False)  # strict=False: the others load
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(full_state_dict(model).values(), before.values()))
    out["opt_unchanged"] = all(
        all(torch.equal(v, s[n]) if isinstance(v, torch.Tensor) else v == s[n] for n, v in now.items())
        for (_, now), (_, s) in zip(opt.state_dict()["state"].items(), opt_before))
    out["missing_ok"] = list(missing_ok.missing_keys)
    assert osd  # the model's own optimizer state still loads
    with FSDP.state_dict_type(model, kind):
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))
    loss_of(model, 0)
    return out


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_state_dict_of_another_model_is_refused_and_changes_nothing(kind: str) -> None:
    results = _bad_state_dict(kind)
    r = results[0]
    assert all(x == r for x in results[1:]) or all(x.keys() == r.keys() for x in results)
    assert r["unchanged"] and r["opt_unchanged"], r
    for name in ("foreign", "missing", "unexpected", "shape", "shape_not_strict"):
        assert "the state dict does not match this FullyShardedDataParallel" in r[name], (name, r[name])
        assert "nothing was loaded" in r[name] and "fix:" in r[name]
    assert "blocks.1.up.bias" in r["missing"] and "missing" in r["missing"]
    assert "blocks.0.extra.weight" in r["unexpected"]
    assert "blocks.0.up.weight: expected any[128, 32], found any[5, 32]" in r["shape"]
    assert "blocks.0.up.weight" in r["shape_not_strict"]
    assert "- 0.weight" in r["foreign"] and "- blocks.0.up.weight" in r["foreign"] and "and 7 more" in r["foreign"]
    assert "optimizer state does not match" in r["optim_foreign"] and "blocks.0.down.bias" in r["optim_foreign"]
    assert "0.weight" in r["optim_foreign"]
    assert r["missing_ok"] == ["blocks.1.up.bias"]


@distributed(world_size=2)
def _misuse() -> dict[str, str]:
    model = run_note(note_code(ours=True))
    loss_of(model, 0).backward()  # the root is known
    inner = model.blocks[0]

    def no_sync_inner() -> None:
        with inner.no_sync():
            pass

    return {"no_sync_inner": _message(no_sync_inner), "clip_inner": _message(lambda: inner.clip_grad_norm_(1.0)),
            "comm_hook": _message(lambda: model.register_comm_hook(None, lambda *a: None)),
            "rank0_writeback": _message(lambda: FSDP.summon_full_params(model, rank0_only=True).__enter__())}


def test_misuse_is_refused() -> None:
    r = _misuse()[0]
    assert "Please call `no_sync()` on root FSDP module" in r["no_sync_inner"]
    assert "should only be called on the root FSDP instance" in r["clip_inner"]
    assert r["comm_hook"].startswith("NotImplementedError") and "set_all_reduce_hook" in r["comm_hook"]
    assert "rank0_only=True, writeback=True" in r["rank0_writeback"]


def test_block_class_is_the_one_in_the_model() -> None:
    assert TransformerBlock in {type(m) for m in build_model().modules()}


def test_dummy_process_group_without_a_default_group_is_refused_clearly() -> None:
    """torch's FSDP1 tests (test_wrap's TestAutoWrap) pass a DummyProcessGroup with no default group at all:
    the refusal must name it and the fix, not c10d's 'Default process group has not been initialized'. A
    fresh interpreter, so that no default group of this session exists."""
    import subprocess
    import sys

    code = (
        "import torch.nn as nn\n"
        "from fully_shard import FullyShardedDataParallel as FSDP\n"
        "class DummyProcessGroup:\n"
        "    def rank(self): return 0\n"
        "    def size(self): return 1\n"
        "    def __repr__(self): return 'DummyProcessGroup(rank=0, size=1)'\n"
        "try:\n"
        "    FSDP(nn.Linear(4, 4), process_group=DummyProcessGroup())\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    print('no error')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    message = out.stdout.strip()
    assert "process_group must be a torch.distributed.ProcessGroup" in message and \
        "DummyProcessGroup(rank=0, size=1)" in message and "Fix: pass dist.new_group" in message, \
        f"expected our refusal naming the DummyProcessGroup and the fix, got {message!r} (stderr {out.stderr[-300:]!r})"
