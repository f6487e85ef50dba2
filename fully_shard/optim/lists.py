"""Hand torch's own ``step()`` a param group's tensor lists ready-made, instead of its per-parameter loop.

See design/optimizer-step.md ("Ready lists"). torch's SGD, Adam and AdamW ``step()`` gather each group's
lists in ``self._init_group(group, params, grads, ...)``: a Python loop over the parameters reading
``p.grad``, looking up ``self.state[p]`` (a Python-level ``Tensor.__hash__``) and appending. For a group
whose stand-in lists optimizer.py already holds (the local views, their local gradients, the local
state tensors, checked in bulk), that loop is redundant. The stand-in optimizer is an instance of a
subclass of the real class that overrides only ``_init_group``: for a prepared group it extends the
lists with the cached ones (same tensors, same order, so ``step()`` calls the same functional optimizer
with the same arguments: the same kernels and bits), for any other group it runs torch's own loop.

Only when ``_init_group`` is one this module was checked against: its signature, and its source's hash
among those of the torch versions tested (a torch that moves work into ``_init_group`` under the same
signature would otherwise have that work skipped); else ``local_class`` returns None and the stand-in
keeps the real class (the views then carry ``.grad``: correct, only slower).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer

__all__ = ["KNOWN_SOURCES", "Ready", "local_class", "source_hash", "state_keys_of"]

# _init_group's parameters after (self, group) and, per name, the state key whose local tensors fill it.
_LISTS: dict[type[Optimizer], tuple[tuple[str, str | None], ...]] = {
    SGD: (("params", None), ("grads", None), ("momentum_buffer_list", "momentum_buffer")),
    Adam: (("params_with_grad", None), ("grads", None), ("exp_avgs", "exp_avg"), ("exp_avg_sqs", "exp_avg_sq"),
           ("max_exp_avg_sqs", "max_exp_avg_sq"), ("state_steps", "step")),
}
_LISTS[AdamW] = _LISTS[Adam]

# sha256 prefixes of ``inspect.getsource(cls._init_group)`` in the torch versions tested (2.11, 2.13): the
# ready path assumes the body only gathers the lists (state creation, which differs, is excluded: the
# ready path needs the state to exist). Adam's and AdamW's are the same function.
KNOWN_SOURCES: dict[type[Optimizer], frozenset[str]] = {
    SGD: frozenset({"ffb0d879c5f7195d"}),
    Adam: frozenset({"0636be5a849a4d3a", "3ce4e10725d7c8d4"}),
}
KNOWN_SOURCES[AdamW] = KNOWN_SOURCES[Adam]


@dataclass(frozen=True, slots=True)
class Ready:
    """One param group's lists, in ``_init_group``'s order: the local views with a gradient, their
    local gradients, then per state list the local tensors (empty where torch's loop appends none:
    ``max_exp_avg_sqs`` without amsgrad, SGD's ``momentum_buffer_list`` without momentum)."""

    params: Sequence[torch.Tensor]
    grads: Sequence[torch.Tensor]
    states: tuple[Sequence[Any], ...]
    result: bool  # _init_group's return: has_sparse_grad (SGD) or has_complex (Adam), computed once


def state_keys_of(cls: type[Optimizer], group: dict[str, Any]) -> tuple[str | None, ...] | None:
    """Per state list of ``cls._init_group``, the state key it reads for ``group`` (None: a list torch
    leaves empty for this group); None when the class has no ready path."""
    if local_class(cls) is None:
        return None
    keys: list[str | None] = []
    for _, key in _LISTS[cls][2:]:
        if key == "max_exp_avg_sq" and not group.get("amsgrad"):
            key = None
        if key == "momentum_buffer" and group["momentum"] == 0:
            key = None  # SGD without momentum: torch appends nothing to this list
        keys.append(key)
    return tuple(keys)


# The stand-in class per optimizer class (local_class), made once: a fact about the running torch's class,
# so module-level, as the classes are (design/overview.md, "Module-level state")
_classes: dict[type[Optimizer], type[Optimizer] | None] = {}


def local_class(cls: type[Optimizer]) -> type[Optimizer] | None:
    """The stand-in class for ``cls`` (exactly SGD, Adam or AdamW): ``cls`` with ``_init_group``
    overridden to take ready lists; None if unsupported or ``_init_group`` is not the expected one."""
    if cls in _classes:
        return _classes[cls]
    local: type[Optimizer] | None = None
    names = tuple(name for name, _ in _LISTS.get(cls, ()))
    if (names and tuple(inspect.signature(cls._init_group).parameters)[2:] == names  # type: ignore[attr-defined]
            and source_hash(cls) in KNOWN_SOURCES[cls]):
        local = type(f"Local{cls.__name__}", (cls,), {"_init_group": _init_group, "__module__": __name__})
    _classes[cls] = local
    return local


def source_hash(cls: type[Optimizer]) -> str | None:
    """The sha256 prefix of ``cls._init_group``'s source (None where the source is unavailable)."""
    try:
        source = inspect.getsource(cls._init_group)  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _init_group(self: Any, group: dict[str, Any], *lists: list[Any]) -> bool:
    ready: Ready | None = self._fully_shard_ready.get(id(group))
    if ready is None:  # not prepared (a group with plain parameters, or on the views' .grad path)
        return bool(super(type(self), self)._init_group(group, *lists))
    lists[0].extend(ready.params)
    lists[1].extend(ready.grads)
    for out, values in zip(lists[2:], ready.states):
        out.extend(values)
    return ready.result
