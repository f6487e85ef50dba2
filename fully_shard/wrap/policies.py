"""Wrap policies: which submodules become fully_shard units (module class, parameter count, predicate, granularity).

``GranularityPolicy`` groups k consecutive blocks per unit: the memory/communication knob the founding
note describes (design/hsdp-and-partial-reshard.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch.nn as nn

from ..core.tree import join_fqn

__all__ = ["GranularityPolicy", "ModuleClassPolicy", "ParamCountPolicy", "PredicatePolicy", "WrapPolicy", "as_policy"]


class WrapPolicy(Protocol):
    """Picks the units: lists of (FQN, module), each list becoming one ``fully_shard`` call."""

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]: ...


@dataclass(frozen=True)
class ModuleClassPolicy:
    """Every module that is an instance of one of ``classes`` is its own unit (FSDP1's
    ``transformer_auto_wrap_policy``); e.g. ``ModuleClassPolicy({TransformerBlock})``."""

    classes: frozenset[type]

    def __init__(self, classes: Iterable[type]) -> None:
        classes = frozenset(classes)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise TypeError(f"ModuleClassPolicy expects nn.Module subclasses, got {sorted(map(repr, classes))}. "
                            "Fix: pass the block class itself, e.g. ModuleClassPolicy({LlamaDecoderLayer}).")
        object.__setattr__(self, "classes", classes)

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        classes = tuple(self.classes)
        found: list[list[tuple[str, nn.Module]]] = [
            [(n, m)] for n, m in model.named_modules() if n and _is_instance(m, classes)]
        _reject_containers(found, "ModuleClassPolicy")
        return found


@dataclass(frozen=True)
class PredicatePolicy:
    """Every module (except the root) for which ``fn(fqn, module)`` is true is its own unit."""

    fn: Callable[[str, nn.Module], bool]

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        found = [[(n, m)] for n, m in model.named_modules() if n and self.fn(n, m)]
        _reject_containers(found, "PredicatePolicy")
        return found


@dataclass(frozen=True)
class ParamCountPolicy:
    """FSDP1's ``size_based_auto_wrap_policy``: bottom-up, a module becomes a unit once the parameters
    under it that no unit below took reach ``min_params`` elements. Containers without a forward
    (ModuleList, ModuleDict) are never units: their parameters count towards the parent."""

    min_params: int

    def __post_init__(self) -> None:
        if not isinstance(self.min_params, int) or self.min_params < 1:
            raise ValueError(f"ParamCountPolicy(min_params=...) must be a positive int, got {self.min_params!r}. "
                             "Fix: e.g. ParamCountPolicy(min_params=100_000_000) for ~100M-element units.")

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        found: list[list[tuple[str, nn.Module]]] = []
        taken: set[int] = set()

        def visit(prefix: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                visit(join_fqn(prefix, name), child)
            if not prefix or not _has_forward(module):
                return
            fresh = [p for p in module.parameters() if id(p) not in taken]
            if sum(p.numel() for p in fresh) >= self.min_params:
                found.append([(prefix, module)])
                taken.update(id(p) for p in fresh)

        visit("", model)
        return found


@dataclass(frozen=True)
class GranularityPolicy:
    """Group ``blocks_per_unit`` consecutive blocks into one unit (``fully_shard([blk_i, ...])``):
    1 = one unit per block (lowest peak memory, most all-gathers), ``"all"`` = one unit for all blocks
    (fewest, largest all-gathers). The blocks are the modules of ``block_classes`` in forward order, or
    by default the children of the largest ``ModuleList``/``Sequential`` of same-class modules."""

    blocks_per_unit: int | Literal["all"] = 1
    block_classes: frozenset[type] | None = None

    def __post_init__(self) -> None:
        k = self.blocks_per_unit
        if k != "all" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"GranularityPolicy(blocks_per_unit=...) must be an int >= 1 or 'all', got {k!r}.")
        if self.block_classes is not None:
            object.__setattr__(self, "block_classes", frozenset(self.block_classes))

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        if self.block_classes is not None:
            classes = tuple(self.block_classes)
            found: list[tuple[str, nn.Module]] = []
            for name, m in model.named_modules():
                if name and _is_instance(m, classes) and not any(name.startswith(f + ".") for f, _ in found):
                    found.append((name, m))
            if not found:
                raise ValueError(f"GranularityPolicy: no module of {sorted(c.__name__ for c in classes)} in "
                                 f"{type(model).__name__}. Fix: pass the block class the model uses.")
            return found
        best: tuple[int, str, nn.Module] | None = None
        for name, m in model.named_modules():
            if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) == 0:
                continue
            kinds = {type(c) for c in m}
            if len(kinds) != 1 or not _has_forward(next(iter(m))):
                continue
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[0]:
                best = (size, name, m)
        if best is None:
            raise ValueError(f"GranularityPolicy: {type(model).__name__} has no ModuleList/Sequential of "
                             "same-class modules to group. Fix: pass block_classes={YourBlock}.")
        _, prefix, container = best
        return [(join_fqn(prefix, str(i)), m) for i, m in enumerate(container.children())]

    def select(self, model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
        blocks = self.blocks(model)
        k = len(blocks) if self.blocks_per_unit == "all" else int(self.blocks_per_unit)
        return [blocks[i:i + k] for i in range(0, len(blocks), k)]


def _is_instance(module: nn.Module, classes: tuple[type, ...]) -> bool:
    return isinstance(module, classes)


def _has_forward(module: nn.Module) -> bool:
    return getattr(type(module), "forward", None) is not nn.Module.forward


def _reject_containers(units: list[list[tuple[str, nn.Module]]], policy: str) -> None:
    for unit in units:
        for name, m in unit:
            if not _has_forward(m):
                raise ValueError(
                    f"{policy} picked {name!r}, a {type(m).__name__} without forward(): fully_shard's hooks "
                    "run on forward, so its parameters would never be gathered. Fix: pick its children, "
                    "or use GranularityPolicy to group them.")


def as_policy(policy: Any) -> WrapPolicy:
    if hasattr(policy, "select"):
        return policy  # type: ignore[no-any-return]
    if isinstance(policy, (set, frozenset, list, tuple)) and all(isinstance(c, type) for c in policy):
        return ModuleClassPolicy(policy)
    if callable(policy):
        return PredicatePolicy(policy)
    raise TypeError(f"auto_wrap policy must be a WrapPolicy, a set of module classes or a predicate "
                    f"fn(fqn, module) -> bool, got {policy!r}. Fix: e.g. ModuleClassPolicy({{Block}}).")
