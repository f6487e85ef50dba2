"""Walk nested containers: map over the tensors inside tuples, lists, dicts, namedtuples and dataclasses;
join dotted FQNs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """Rebuild ``obj`` with ``fn`` applied to every tensor; other leaves are returned unchanged."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is tuple:  # a forward's args: the common case, first
        return tuple([map_tensors(fn, v) for v in obj])
    if type(obj) is dict and not obj:  # a forward's empty kwargs
        return {}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, dict):
        out = {k: map_tensors(fn, v) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        try:
            new = type(obj)(**out)  # e.g. transformers' ModelOutput (an OrderedDict dataclass)
        except TypeError:
            new = obj.copy()
            new.update(out)
        return new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj``, in traversal order."""
    found: list[torch.Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj: Any, found: list[torch.Tensor]) -> None:
    """``tensors`` without rebuilding the containers (the same traversal as ``map_tensors``)."""
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (list, tuple)):  # namedtuples included
        for v in obj:
            _collect(v, found)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.init:
                _collect(getattr(obj, f.name), found)


def join_fqn(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` alone under the root (``prefix == ""``)."""
    return f"{prefix}.{name}" if prefix else name
