"""What torch.compile (Dynamo) needs from fully_shard: hooks that run eagerly, and marked modules.

See design/hooks.md ("torch.compile"). ``block.compile()`` compiles ``block._call_impl``; Dynamo
skips that frame (it is torch's own code) but compiles every Python frame it calls that is not
torch's: the forward, and our forward hooks. A hook traced by Dynamo breaks the graph (it
enters locks, issues collectives, resizes storages, mutates Python state), which
``fullgraph=True`` turns into an error. So every hook is wrapped in ``torch.compiler.disable``
(public API) when it is registered, as torch's FSDP2 wraps its own: Dynamo sees no frame of ours,
the hooks run eagerly around the compiled forward, and the forward is one graph.

The wrapping happens when ``fully_shard()`` runs, not at import: ``torch.compiler.disable`` imports
``torch._dynamo`` (seconds), which a program that never compiles should not pay at import time.

Dynamo also looks for two attributes on the modules of a unit (the ones whose parameters the unit
manages, i.e. not inside nested units): ``_is_fsdp_managed_module`` and ``_fsdp_use_orig_params``.
With them it traces the module as an ``FSDPManagedNNModuleVariable``: its parameters become graph
inputs, with no guards on their identity or on the module's structure (``skip_fsdp_guards``), so
swapping sharded and unsharded parameters never recompiles. They are private names that Dynamo
reads (torch's fully_shard sets the same two); this file is the only place that sets them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
import torch.nn as nn

_F = TypeVar("_F", bound=Callable[..., object])

# The attributes Dynamo reads (torch/_dynamo/variables/builder.py); private to torch, set only here.
_MANAGED_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def eager(fn: _F) -> _F:
    """``fn`` (a hook) run by Dynamo as an opaque eager call: never traced, never a graph break
    when called from a frame Dynamo skips (``nn.Module._call_impl``, the autograd engine)."""
    return torch.compiler.disable(fn, recursive=True, reason="fully_shard hooks run eagerly")  # type: ignore[no-any-return]


def mark_managed(modules: Iterable[nn.Module]) -> None:
    """Mark the modules whose parameters a unit manages the way Dynamo recognizes FSDP modules."""
    for module in modules:
        for flag in _MANAGED_FLAGS:
            setattr(module, flag, True)


def is_managed(module: nn.Module) -> bool:
    return all(getattr(module, flag, False) for flag in _MANAGED_FLAGS)
