"""Interop with torch's composable APIs: mark each fully_shard module as torch's fully_shard marks
its own, so ``torch.distributed._composable.replicate()`` applied above it leaves its parameters
to this library instead of converting them to local tensors and all-reducing them with DDP.

See design/hooks.md (composable replicate). torch's replicate() asks one question, "is 'fully_shard'
in this module's composable registry?"; the registry is a private attribute of torch's
``_composable.contract`` module (no public API answers it), read here and nowhere else. Without it
the two do not compose: replicate()'s DDP sees the shards as local tensors of different shapes per
rank and hangs, or averages gradients fully_shard averages again.
"""

from __future__ import annotations

import torch.nn as nn

try:  # torch's private registry; if a future torch drops it, replicate() is simply not recognized
    from torch.distributed._composable.contract import REGISTRY_KEY as _REGISTRY_KEY
    from torch.distributed._composable.contract import RegistryItem as _RegistryItem
except ImportError:  # pragma: no cover
    _REGISTRY_KEY, _RegistryItem = None, None  # type: ignore[assignment,misc]


def _registry(module: nn.Module) -> dict[str, object] | None:
    return module.__dict__.get(_REGISTRY_KEY) if _REGISTRY_KEY is not None else None


def check_not_replicated(module: nn.Module) -> None:
    """fully_shard inside a replicate()'d module is fine; on the replicate()'d module itself it is
    not (torch refuses it too)."""
    registry = _registry(module)
    if registry is not None and "replicate" in registry:
        raise ValueError(
            f"fully_shard on a {type(module).__name__} that torch's replicate() was already applied to: "
            "replicate() would all-reduce the gradients fully_shard reduce-scatters. Fix: call "
            "fully_shard on the submodules first, then replicate() (or fully_shard) on the parent.")


def mark_fully_shard(module: nn.Module) -> None:
    """Register ``module`` as managed by fully_shard in torch's composable registry."""
    if _REGISTRY_KEY is None:
        return
    registry = module.__dict__.setdefault(_REGISTRY_KEY, {})
    registry.setdefault("fully_shard", _RegistryItem())
