"""Originals: an optimizer built before the FSDP1 front end sharded its module steps the sharded parameters instead.

FSDP1 with ``use_orig_params=True`` keeps the module's ``Parameter`` objects, so an optimizer built before
wrapping (accelerate's ``prepare(model, optimizer)`` on its FSDP1 path) keeps training. Here a parameter
becomes a new DTensor ``Parameter``; the original object cannot be turned into it in place (a plain
``Parameter`` and a ``DTensor`` have different Python object layouts: ``torch.utils.swap_tensors``
refuses them). So the front end records each original's successor (``keep_original``) and
``rebind_originals`` puts the successor in the optimizer's param groups in place of the original
before its first step (the step hook calls it whenever a ``fully_shard`` call happened since its last
check). An original that already has optimizer state is refused: that state was never sharded.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.optim import Optimizer

__all__ = ["keep_original", "rebind_originals"]

_SUCCESSOR_ATTR = "_fully_shard_successor"


class _Sharded(Protocol):
    @property
    def sharded_param(self) -> torch.Tensor: ...


def keep_original(original: torch.Tensor, successor: _Sharded) -> None:
    """An optimizer holding ``original`` steps ``successor.sharded_param`` (read at rebinding time: the
    sharded parameter object may change, e.g. after ``model.to(dtype)``)."""
    setattr(original, _SUCCESSOR_ATTR, successor)


def rebind_originals(optimizer: Optimizer) -> bool:
    """Replace, in ``optimizer.param_groups``, every original with a recorded successor by the current
    sharded parameter; True if anything changed."""
    changed = False
    for i, group in enumerate(optimizer.param_groups):
        params: list[Any] = group["params"]
        for j, p in enumerate(params):
            successor = getattr(p, _SUCCESSOR_ATTR, None)
            if successor is None:
                continue
            if optimizer.state.get(p):
                raise RuntimeError(
                    f"{type(optimizer).__name__}: param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)}) was "
                    "sharded by FullyShardedDataParallel after the optimizer created state for it, and that state "
                    "is unsharded. Fix: build (or load) the optimizer state after wrapping the model, e.g. "
                    "FSDP.optim_state_dict_to_load(model, optim, osd).")
            params[j] = successor.sharded_param
            changed = True
    return changed
