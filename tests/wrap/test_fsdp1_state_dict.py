"""FSDP1's state dicts on per-parameter DTensors: FULL, SHARDED (through torch.distributed.checkpoint) and LOCAL
round trips of model and optimizer continue the loss exactly; FULL with rank0_only/offload_to_cpu; torch's
enums and configs; and checkpoints written by torch's own FSDP1 (FULL, and DCP SHARDED) load into this
library's FullyShardedDataParallel (the optimizer through optim_state_dict_to_load) and continue as
torch's run goes on."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import FullStateDictConfig, FullyShardedDataParallel, StateDictType
from tests.distributed.harness import distributed
from tests.wrap.common import both_note_models, shared_dir
from tests.wrap.note import note_code, run_note, train

FSDP = FullyShardedDataParallel
FIRST, LATER = range(0, 3), range(3, 6)
KINDS = ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]


def _model_and_opt(*, torch_fsdp: bool = False) -> tuple[Any, torch.optim.Optimizer]:
    if torch_fsdp:
        model = both_note_models()[1]
    else:
        model = run_note(note_code(ours=True))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save(model: Any, opt: torch.optim.Optimizer, kind: Any, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimizer state dicts under ``kind``; SHARDED written with DCP (and returned empty)."""
    cls = type(model)
    with cls.state_dict_type(model, kind):
        msd, osd = model.state_dict(), cls.optim_state_dict(model, opt)
    if kind.name == "SHARDED_STATE_DICT":
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        return {}, {}
    return copy.deepcopy(msd), copy.deepcopy(osd)  # the state dict holds views of the live training state


def _load(model: Any, opt: torch.optim.Optimizer, kind: Any, msd: dict[str, Any], osd: dict[str, Any],
          path: str) -> None:
    if kind.name == "SHARDED_STATE_DICT":
        train(model, opt, range(99, 100), clip=None)  # the optimizer's state tensors: what DCP loads into
        with FSDP.state_dict_type(model, kind):
            skeleton = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        assert all(isinstance(v, DTensor) for v in skeleton["model"].values())
        dcp.load(skeleton, checkpoint_id=path)
        msd, osd = skeleton["model"], skeleton["optim"]
    with FSDP.state_dict_type(model, kind):
        model.load_state_dict(msd)
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, osd))


@distributed(world_size=2)
def _round_trip(kind_name: str) -> tuple[list[float], list[float]]:
    kind = StateDictType[kind_name]
    with shared_dir() as path:
        model, opt = _model_and_opt()
        train(model, opt, FIRST)
        msd, osd = _save(model, opt, kind, path)
        reference = train(model, opt, LATER)[0]  # the original run goes on
        fresh, fresh_opt = _model_and_opt()
        _load(fresh, fresh_opt, kind, msd, osd, path)
        resumed = train(fresh, fresh_opt, LATER)[0]
    return reference, resumed


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_continues_the_loss_exactly(kind: str) -> None:
    for reference, resumed in _round_trip(kind):
        assert resumed == reference, (kind, reference, resumed)


@distributed(world_size=2)
def _torch_checkpoint(kind_name: str) -> tuple[list[float], list[float]]:
    """torch's FSDP1 trains, saves (its own state dict / DCP), goes on; ours loads that and goes on."""
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    with shared_dir() as path:
        theirs, their_opt = _model_and_opt(torch_fsdp=True)
        train(theirs, their_opt, FIRST)
        msd, osd = _save(theirs, their_opt, TorchStateDictType[kind_name], path)
        reference = train(theirs, their_opt, LATER)[0]
        ours, our_opt = _model_and_opt()
        _load(ours, our_opt, StateDictType[kind_name], msd, osd, path)
        resumed = train(ours, our_opt, LATER)[0]
    return reference, resumed


@pytest.mark.parametrize("kind", KINDS[:2])
def test_torch_fsdp1_checkpoint_loads_and_continues(kind: str) -> None:
    for reference, resumed in _torch_checkpoint(kind):
        assert max(abs(a - b) / b for a, b in zip(resumed, reference)) <= 1e-6, (kind, reference, resumed)


@distributed(world_size=2)
def _full_options() -> dict[str, Any]:
    from torch.distributed.fsdp import FullStateDictConfig as TorchConfig
    from torch.distributed.fsdp import StateDictType as TorchType

    model, opt = _model_and_opt()
    train(model, opt, FIRST)
    everywhere = {k: v.clone() for k, v in model.state_dict().items()}  # FULL is the default type
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True,
                                                                                        rank0_only=True)):
        rank0 = model.state_dict()
    with FSDP.state_dict_type(model, TorchType.FULL_STATE_DICT, TorchConfig(rank0_only=True)):  # torch's objects
        torch_config = model.state_dict()
    settings = FSDP.get_state_dict_type(model)
    assert settings.state_dict_type is StateDictType.FULL_STATE_DICT and not settings.state_dict_config.rank0_only
    if dist.get_rank() == 0:
        assert sorted(rank0) == sorted(everywhere) == sorted(torch_config)
        assert all(torch.equal(rank0[k], everywhere[k]) and rank0[k].device.type == "cpu" for k in rank0)
    else:
        assert rank0 == {} and torch_config == {}
    plain = all(type(v) is torch.Tensor for v in everywhere.values())
    return {"keys": sorted(everywhere), "plain": plain}


def test_full_state_dict_options() -> None:
    results = _full_options()
    assert results[0] == results[1] and results[0]["plain"]
    assert "blocks.0.qkv.weight" in results[0]["keys"] and not any("_fsdp_wrapped" in k for k in results[0]["keys"])


@distributed(world_size=2)
def _wrong_config_message() -> str:
    from fully_shard import LocalStateDictConfig

    model = FullyShardedDataParallel(nn.Linear(4, 4))
    try:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, LocalStateDictConfig()):
            pass
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_wrong_state_dict_config_in_torchs_words() -> None:
    """torch's test_fsdp_state_dict.test_wrong_state_dict_config matches 'Expected state_dict_config of type'."""
    for message in _wrong_config_message():
        assert message.startswith("Expected state_dict_config of type FullStateDictConfig but got "
                                  "LocalStateDictConfig") and "Fix: pass FullStateDictConfig" in message, message
