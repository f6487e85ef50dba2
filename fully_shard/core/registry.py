"""What the core announces to the add-ons above it: units sharded, sharded gradients made; and who owns a parameter.

The core never imports its add-ons (the local-shard optimizer step in ``optim/``): they listen here.
``fully_shard/__init__.py`` imports ``optim``, whose ``__init__`` registers its listeners, so they are in
place before the first ``fully_shard`` call whatever module a user imports first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OWNER_ATTR", "announce_grad", "announce_sharded", "on_grad", "on_sharded", "owner_of", "set_owner"]

# Which fully_shard unit owns a parameter (the original or the sharded object) is recorded as this
# tensor attribute, "<Class> (param 'name')". Not a weakref registry: a weakref on a parameter makes
# torch.utils.swap_tensors (module.to_empty()/.to() on DTensor params) refuse to swap it.
OWNER_ATTR = "_fully_shard_owner"

# (the unit's ShardedParams, the original parameters they replaced)
ShardedListener = Callable[[list[Any], list[torch.Tensor]], None]
# (a new sharded DTensor gradient, its parameter's placements, the gradient's local tensor)
GradListener = Callable[[Any, tuple[Any, ...], torch.Tensor], None]

_sharded_listeners: list[ShardedListener] = []
_grad_listeners: list[GradListener] = []


def on_sharded(listener: ShardedListener) -> None:
    """Call ``listener(sharded_params, replaced)`` after every ``fully_shard`` call (once per listener)."""
    if listener not in _sharded_listeners:
        _sharded_listeners.append(listener)


def on_grad(listener: GradListener) -> None:
    """Call ``listener(grad, placements, local)`` for every sharded gradient the reduce side creates."""
    if listener not in _grad_listeners:
        _grad_listeners.append(listener)


def announce_sharded(params: list[Any], replaced: list[torch.Tensor]) -> None:
    for listener in _sharded_listeners:
        listener(params, replaced)


def announce_grad(grad: Any, placements: tuple[Any, ...], local: torch.Tensor) -> None:
    for listener in _grad_listeners:
        listener(grad, placements, local)


def owner_of(p: torch.Tensor) -> str | None:
    return getattr(p, OWNER_ATTR, None)


def set_owner(p: torch.Tensor, description: str) -> None:
    setattr(p, OWNER_ATTR, description)
