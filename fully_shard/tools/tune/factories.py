"""The user's factories (``module:function``) and what the tuner builds from them: blocks, units, loss."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from ...wrap import GranularityPolicy, auto_wrap


def load_object(spec: str, what: str) -> Any:
    """``"pkg.module:attr"`` -> the object (the current directory is importable)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--{what} expects 'module:function', found {spec!r}. Fix: e.g. "
                         f"--{what} models.gpt:build_{what}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--{what} {spec}: expected an importable module:function, found {type(e).__name__}: "
                         f"{e}. Fix: run from the directory the module is importable from (the current "
                         f"directory is on the path), or install the package.") from e
    return obj


def find_blocks(model: nn.Module, attr: str | None = None) -> list[nn.Module]:
    """The repeated blocks the tuner groups, in forward order: the children of ``model.<attr>`` or, by
    default, of the largest ModuleList/Sequential of same-class modules (``wrap.GranularityPolicy``)."""
    if attr:
        found = model.get_submodule(attr)
        if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) == 0:
            raise ValueError(f"--blocks {attr!r}: expected a non-empty nn.ModuleList, found {type(found).__name__}. "
                             "Fix: name the ModuleList holding the transformer blocks (e.g. 'layers').")
        return list(found)
    return [m for _, m in GranularityPolicy(1).blocks(model)]


def shard_by_granularity(model: nn.Module, blocks: Sequence[nn.Module], k: int, *, reshard_after_forward: bool,
                         **kwargs: Any) -> int:
    """``k`` consecutive blocks per unit (``wrap.auto_wrap`` with a ``GranularityPolicy`` over the blocks'
    class), the rest of the model the root unit. Returns the number of units."""
    classes = frozenset({type(b) for b in blocks})
    plan = auto_wrap(model, GranularityPolicy(k, block_classes=classes), reshard_after_forward=reshard_after_forward,
                     **kwargs)
    return len(plan.units)


def default_loss(output: Any, targets: Any) -> torch.Tensor:
    if isinstance(output, (tuple, list)):
        output = output[0]
    if targets is None:
        return output.float().pow(2).mean()
    if not targets.is_floating_point():
        return torch.nn.functional.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1))
    return torch.nn.functional.mse_loss(output.float(), targets.float())


def call_batch(fn: Callable[..., Any], rank: int) -> Any:
    """The batch factory's result: ``fn(rank)`` if it takes an argument, else ``fn()``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn()
    return fn(rank) if params else fn()


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` with every tensor inside (tuples, lists, dicts) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x
