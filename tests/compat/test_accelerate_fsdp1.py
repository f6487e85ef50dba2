"""accelerate's FSDP1 path unchanged after ``compat.patch_torch(fsdp1=True)``: ``FullyShardedDataParallelPlugin(
fsdp_version=1, auto_wrap_policy=TRANSFORMER_BASED_WRAP, state_dict_type=SHARDED_STATE_DICT)``, ``prepare(model,
optimizer)`` with the optimizer built before wrapping, ``backward`` / ``clip_grad_norm_``, and ``save_state`` /
``load_state`` (DCP) into a fresh model and optimizer (after one step: DCP loads into existing state tensors),
side by side with the same run on torch's FSDP1 (CPU/gloo, 2 ranks): the same losses and gradient norms, and the
resumed run continues the loss exactly. Also ``cpu_ram_efficient_loading`` (rank 0 holds the weights, the other
ranks build the model on the meta device, ``sync_module_states`` with accelerate's ``param_init_fn``), which
torch's FSDP1 refuses on CPU: the same losses as torch's run from real weights."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.compat.frameworks import fsdp1_class, reset_accelerate, select_fsdp
from tests.distributed.harness import distributed
from tests.wrap.common import rel_diffs, shared_dir
from tests.wrap.note import GPT, SIZES, build_model, loss_of

pytest.importorskip("accelerate", reason="accelerate is in the test extra (pyproject)")

FIRST, LATER = range(0, 3), range(3, 5)


def _prepare(variant: str, *, low_ram: bool) -> tuple[Any, Any, Any]:
    """A fresh Accelerator with the FSDP1 plugin, the note's model and an AdamW built before wrapping."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    reset_accelerate()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["TransformerBlock"],
        state_dict_type="SHARDED_STATE_DICT", use_orig_params=True)  # as transformers passes it: the optimizer
    # built before wrapping keeps stepping (torch: views into the flat parameter; ours: see optim/originals.py)
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    select_fsdp(accelerator, plugin, variant=variant)
    if low_ram:  # what the plugin's __post_init__ sets for cpu_ram_efficient_loading on a GPU node
        plugin.cpu_ram_efficient_loading = plugin.sync_module_states = True
        plugin.param_init_fn = lambda m: m.to_empty(device=torch.device("cpu"), recurse=False)
    if low_ram and dist.get_rank() != 0:
        torch.manual_seed(1)
        with torch.device("meta"):
            model: nn.Module = GPT(SIZES)  # the note's GPT on meta: no weights on this rank
    else:
        model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _steps(accelerator: Any, model: Any, opt: Any, steps: range) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for step in steps:
        loss = loss_of(model, step)
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))
    return losses, norms


@distributed(world_size=2)
def _run(variant: str, low_ram: bool) -> dict[str, Any]:
    with fsdp1_class(variant):
        accelerator, model, opt = _prepare(variant, low_ram=low_ram)
        from torch.distributed.fsdp import FullyShardedDataParallel as Bound

        wrapped = type(model) is Bound  # accelerate's FSDP1 code tests this (load_fsdp_model)
        losses, norms = _steps(accelerator, model, opt, FIRST)
        with shared_dir() as path:
            accelerator.save_state(path)
            going_on = _steps(accelerator, model, opt, LATER)[0]
            accelerator, model, opt = _prepare(variant, low_ram=False)  # a fresh job resumes; one step first
            _steps(accelerator, model, opt, range(99, 100))  # gives the optimizer the state tensors DCP loads into
            accelerator.load_state(path)
            resumed = _steps(accelerator, model, opt, LATER)[0]
        reset_accelerate()
    return {"losses": losses, "norms": norms, "going_on": going_on, "resumed": resumed, "wrapped": wrapped,
            "class": type(model).__module__}


def _check(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    print(f"\naccelerate FSDP1: losses {ours['losses']} (torch {theirs['losses']}); after save_state "
          f"{ours['going_on']}, resumed {ours['resumed']}")
    assert ours["wrapped"] and ours["class"].startswith("fully_shard"), ours
    assert theirs["wrapped"] and theirs["class"].startswith("torch"), theirs
    assert rel_diffs(ours["losses"] + ours["going_on"], theirs["losses"] + theirs["going_on"]) <= 1e-6
    assert rel_diffs(ours["norms"], theirs["norms"]) <= 2e-6
    for r in (ours, theirs):
        assert r["resumed"] == r["going_on"], r  # load_state continues the loss exactly


@functools.cache
def _torch_run() -> dict[str, Any]:
    result: dict[str, Any] = _run("torch", False)[0]
    return result


def test_accelerate_fsdp1_plugin_runs_unchanged_and_resumes() -> None:
    _check(_run("ours", False)[0], _torch_run())


def test_accelerate_cpu_ram_efficient_loading() -> None:
    _check(_run("ours", True)[0], _torch_run())
