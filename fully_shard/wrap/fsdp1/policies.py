"""torch-style auto-wrap policies (callables and policy objects) and which modules FSDP1's auto_wrap_policy wraps.

The callables keep torch 2.13's signature ``policy(module, recurse, nonwrapped_numel) -> bool`` and its
bottom-up traversal (``_recursive_wrap``: a module's remaining un-wrapped numel decides); the policy objects
(``ModuleWrapPolicy``, ``CustomPolicy``) keep its ``_run_policy(root, ignored_modules, root_kwargs)``
protocol, so torch's own objects and ours are read the same way. This library's ``WrapPolicy`` objects
(``ModuleClassPolicy``...) are accepted too. ``wrap_targets`` only decides (nothing is changed): the
caller wraps the targets it returns, children first.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

__all__ = ["CustomPolicy", "ModuleWrapPolicy", "Target", "always_wrap_policy", "enable_wrap", "lambda_auto_wrap_policy",
           "size_based_auto_wrap_policy", "transformer_auto_wrap_policy", "wrap", "wrap_targets"]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every submodule."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wrap the submodules for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """Wrap every module that is an instance of one of ``transformer_layer_cls`` (use with
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """Wrap a module once the parameters under it that no wrapped child took reach ``min_num_params``
    elements; never descend into ``force_leaf_modules``, never wrap ``exclude_wrap_modules``."""
    leaves = size_based_auto_wrap_policy.FORCE_LEAF_MODULES if force_leaf_modules is None else force_leaf_modules  # type: ignore[attr-defined]
    exclude = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None else exclude_wrap_modules  # type: ignore[attr-defined]
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(leaves))
    return is_large and not isinstance(module, tuple(exclude))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


class ModuleWrapPolicy:
    """Wrap every module of one of ``module_classes`` with the root's arguments."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = set(module_classes)
        self._module_classes_str = str(self._module_classes)

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        classes = tuple(self._module_classes)
        return {m: copy.copy(root_kwargs) for m in root_module.modules()
                if m not in ignored_modules and isinstance(m, classes)}

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return True if recurse else isinstance(module, tuple(self._module_classes))

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({self._module_classes_str})"


class CustomPolicy:
    """``lambda_fn(module)`` returns False (not wrapped), True (wrapped with the root's arguments) or a
    dict of arguments that override the root's for that unit (e.g. ``{"sharding_strategy": ...}``)."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module: nn.Module, ignored_modules: set[nn.Module],
                    root_kwargs: dict[str, Any]) -> dict[nn.Module, dict[str, Any]]:
        out: dict[nn.Module, dict[str, Any]] = {}
        for module in root_module.modules():
            if module in ignored_modules:
                continue
            res = self._lambda_fn(module)
            if not isinstance(res, (dict, bool)):
                raise ValueError(f"CustomPolicy: lambda_fn must return False/True or a dict of arguments, got "
                                 f"{res!r} for a {type(module).__name__}. Fix: return True, False or e.g. "
                                 "{'sharding_strategy': ShardingStrategy.SHARD_GRAD_OP}.")
            if res:
                out[module] = {**root_kwargs, **(res if isinstance(res, dict) else {})}
        return out


# --- enable_wrap / wrap: torch's manual wrapping annotation --------------------------------------------
class _WrapContext:
    wrapper_cls: Callable[..., nn.Module] | None = None
    kwargs: dict[str, Any] = {}


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Inside, ``wrap(module)`` returns ``wrapper_cls(module, **wrapper_kwargs)``."""
    if _WrapContext.wrapper_cls is not None:
        raise NotImplementedError("enable_wrap: already inside an enable_wrap context (nesting is not supported).")
    _WrapContext.wrapper_cls, _WrapContext.kwargs = wrapper_cls, dict(wrapper_kwargs)
    try:
        yield
    finally:
        _WrapContext.wrapper_cls, _WrapContext.kwargs = None, {}


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """``module`` wrapped with the ``enable_wrap`` context's class and arguments (overridden by
    ``wrap_overrides``); ``module`` itself outside such a context."""
    if _WrapContext.wrapper_cls is None:
        return module
    kwargs = {**_WrapContext.kwargs, **wrap_overrides, **getattr(module, "_wrap_overrides", {})}
    return _WrapContext.wrapper_cls(module, **kwargs)


# --- which modules a policy wraps ---------------------------------------------------------------------
@dataclass
class Target:
    """One module to wrap, where it hangs, and the arguments that override the root's for it."""

    parent: nn.Module
    name: str
    module: nn.Module
    overrides: dict[str, Any] = field(default_factory=dict)


def wrap_targets(root: nn.Module, policy: Any, *, ignored_modules: set[nn.Module], ignored_params: set[int],
                 root_kwargs: dict[str, Any], full_precision_classes: Sequence[type[nn.Module]] = (),
                 is_wrapped: Callable[[nn.Module], bool]) -> list[Target]:
    """The modules under ``root`` (never ``root`` itself) that ``policy`` wraps, children before parents.

    ``full_precision_classes`` (MixedPrecision's BatchNorm rule): such modules are wrapped too, with
    ``mixed_precision=None``. ``is_wrapped(m)``: already a unit (FSDP1 refuses to auto-wrap around one).
    """
    for name, m in root.named_modules():
        if m is not root and is_wrapped(m):
            # torch's own sentence first (code and torch's tests match it), then what to do
            raise ValueError(f"FullyShardedDataParallel(auto_wrap_policy=...): FSDP auto wrapping requires modules "
                             f"to not already have FSDP applied but found {name} in {type(root).__name__}: "
                             f"{name!r} is already wrapped. FSDP1 auto-wrapping needs a model with no unit inside. "
                             "Fix: drop auto_wrap_policy and wrap the remaining modules by hand, or auto-wrap the "
                             "unwrapped model.")
    overrides: dict[int, dict[str, Any]] = {}
    if hasattr(policy, "_run_policy"):  # torch's _Policy objects and ours
        chosen = policy._run_policy(root, ignored_modules, dict(root_kwargs))
        for m, kwargs in chosen.items():
            overrides[id(m)] = {k: v for k, v in kwargs.items() if k not in root_kwargs or root_kwargs[k] is not v}
    elif hasattr(policy, "select"):  # this library's WrapPolicy
        for unit in policy.select(root):
            if len(unit) != 1:
                raise NotImplementedError(
                    f"FullyShardedDataParallel(auto_wrap_policy={policy!r}): a unit of {len(unit)} modules "
                    f"({', '.join(n for n, _ in unit)}) has no FSDP1 form (one wrapper per module). Fix: "
                    "use blocks_per_unit=1, or fully_shard([...]) / auto_wrap for grouped units.")
            overrides[id(unit[0][1])] = {}
    elif callable(policy):
        _recurse(root, policy, ignored_modules, ignored_params, overrides, top=True)
    else:
        raise TypeError(f"FullyShardedDataParallel(auto_wrap_policy=...): expected a callable policy(module, recurse, "
                        f"nonwrapped_numel), a ModuleWrapPolicy/CustomPolicy or a WrapPolicy, got {policy!r:.100}. "
                        "Fix: e.g. functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}).")
    wrapped_by_policy = set(overrides)
    if full_precision_classes:
        classes = tuple(full_precision_classes)
        for m in root.modules():
            if m is not root and m not in ignored_modules and isinstance(m, classes):
                overrides.setdefault(id(m), {})["mixed_precision"] = None
    targets: list[Target] = []
    seen: set[int] = {id(root)}

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if id(child) in seen or child in ignored_modules:
                continue
            seen.add(id(child))
            visit(child)
            if id(child) in overrides:
                targets.append(Target(parent, name, child, overrides[id(child)]))

    visit(root)
    if not wrapped_by_policy and not _is_size_based(policy):
        raise ValueError(f"FullyShardedDataParallel(auto_wrap_policy={_describe(policy)}) wraps no module of "
                         f"{type(root).__name__}, whose module classes are {_classes(root)}. Fix: name a class the "
                         "model uses (e.g. its decoder layer), or pass auto_wrap_policy=None to make the whole model "
                         "one unit.")
    return targets


def _recurse(module: nn.Module, policy: Callable[..., bool], ignored_modules: set[nn.Module], ignored_params: set[int],
             out: dict[int, dict[str, Any]], *, top: bool) -> int:
    """torch's ``_recursive_wrap`` deciding only: the numel wrapped under ``module`` (itself included)."""
    nonwrapped = sum(p.numel() for p in module.parameters() if id(p) not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped):
        return 0
    wrapped = sum(_recurse(child, policy, ignored_modules, ignored_params, out, top=False)
                  for child in module.children() if child not in ignored_modules)
    if not top and policy(module=module, recurse=False, nonwrapped_numel=nonwrapped - wrapped):
        out[id(module)] = {}
        return nonwrapped
    return wrapped


def _is_size_based(policy: Any) -> bool:
    fn = getattr(policy, "func", policy)  # functools.partial
    return getattr(fn, "__name__", "") == "size_based_auto_wrap_policy"


def _describe(policy: Any) -> str:
    """The policy as the user wrote it, the same on every rank (no object addresses)."""
    fn = getattr(policy, "func", None)
    if fn is not None:
        args = ", ".join(f"{k}={_name(v)}" for k, v in getattr(policy, "keywords", {}).items())
        return f"partial({_name(fn)}, {args})"
    if isinstance(policy, (ModuleWrapPolicy, CustomPolicy)) or not hasattr(policy, "__qualname__"):
        inner = getattr(policy, "_module_classes", None) or getattr(policy, "_lambda_fn", None)
        return f"{type(policy).__name__}({_name(inner)})" if inner is not None else repr(policy)
    return _name(policy)


def _name(value: Any) -> str:
    if isinstance(value, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(_name(v) for v in value)) + "}"
    if isinstance(value, type) or callable(value):
        return str(getattr(value, "__qualname__", getattr(value, "__name__", type(value).__name__)))
    return repr(value)


def _classes(root: nn.Module) -> str:
    names = sorted({type(m).__name__ for m in root.modules()})
    return ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
