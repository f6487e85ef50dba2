"""FullyShardedDataParallel: torch 2.13's FSDP1 class, each wrapper one fully_shard unit of per-parameter DTensors.

``FSDP(module, sharding_strategy=..., auto_wrap_policy=..., mixed_precision=...)`` wraps ``module`` as
FSDP1 does (``self._fsdp_wrapped_module``; the policy's targets wrapped first, each in its own
``FullyShardedDataParallel``) and applies ``fully_shard`` to the wrapper on the mesh the strategy
means (mesh.py). What frameworks call on FSDP1 keeps its meaning: ``no_sync``, ``summon_full_params``,
``clip_grad_norm_``, ``state_dict_type`` (state_dict.py), ``optim_state_dict[_to_load]``
(optim_state.py), ``fsdp_modules``, ``module``, ``apply``; names without ``_fsdp_wrapped_module.``;
``forward`` and attribute access reach the wrapped module. There is no flat parameter: every parameter
is its own ``Shard(0)`` DTensor whatever ``use_orig_params`` says (design/fsdp1.md).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...core import registry
from ...core.api import fully_shard
from ...core.module import FSDPModule
from ...core.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy
from ...core.state import FSDPState, TrainingState, get_state
from ...core.tree import map_tensors
from ...optim.clip import clip_grad_norm_ as _clip_grad_norm
from ...optim.originals import keep_original
from ...parallel.mesh import device_of
from . import optim_state
from . import state_dict as sd
from .init import materialize, unit_modules
from .init import sync_module_states as broadcast_module_states
from .mesh import Placement, check_group, compute_device_type, resolve_placement
from .options import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    StateDictSettings,
    StateDictType,
    coerce,
    fsdp1_reduce_dtype,
)
from .policies import wrap_targets
from .summon import summon

__all__ = ["FullyShardedDataParallel"]

_WRAPPED_NAME = sd.WRAPPED[:-1]  # "_fsdp_wrapped_module"


class FullyShardedDataParallel(FSDPModule, nn.Module):
    """torch 2.13's ``FullyShardedDataParallel`` constructor and methods on this library's units.

    Arguments as torch's (its enums and config objects are accepted as well as this library's):
    ``sharding_strategy`` FULL_SHARD (default) / SHARD_GRAD_OP / NO_SHARD / HYBRID_SHARD /
    _HYBRID_SHARD_ZERO2 (mesh.py); ``mixed_precision`` with FSDP1's rules (options.MixedPrecision);
    ``cpu_offload=CPUOffload(offload_params=True)``; ``auto_wrap_policy`` torch's callables and policy
    objects or this library's (policies.py); ``param_init_fn`` / meta-device modules and
    ``sync_module_states`` (init.py); ``ignored_modules`` / ``ignored_states``; ``device_id`` (optional:
    the device comes from the process group's backend, as ``fully_shard``'s). ``backward_prefetch``,
    ``forward_prefetch``, ``limit_all_gathers`` and ``use_orig_params`` are accepted: the first three
    are scheduling hints for flat parameters (this library prefetches one unit ahead in both passes),
    the last changes nothing (the original parameters are what is exposed either way).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> FullyShardedDataParallel:
        # a plain constructor (FSDPModule's __new__ builds the class a unit was swapped from; this class is
        # an FSDPModule from the start, so fully_shard keeps it: ``type(wrapper) is FullyShardedDataParallel``,
        # which FSDP1 code such as accelerate's load_fsdp_model tests)
        return nn.Module.__new__(cls)

    def __init__(self, module: nn.Module, process_group: Any = None, sharding_strategy: Any = None,
                 cpu_offload: Any = None, auto_wrap_policy: Any = None,
                 backward_prefetch: Any = BackwardPrefetch.BACKWARD_PRE, mixed_precision: Any = None,
                 ignored_modules: Iterable[nn.Module] | None = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None,
                 device_id: int | torch.device | None = None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True, use_orig_params: bool = False,
                 ignored_states: Iterable[Any] | None = None, device_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        # --- every argument read and checked first: a bad one leaves ``module`` as it was ----------
        _check_module(module)
        strategy = (ShardingStrategy.FULL_SHARD if sharding_strategy is None
                    else coerce(sharding_strategy, ShardingStrategy, "FullyShardedDataParallel(sharding_strategy=...)"))
        mp = (None if mixed_precision is None
              else coerce(mixed_precision, MixedPrecision, "FullyShardedDataParallel(mixed_precision=...)"))
        _check_mixed_precision(mp)
        offload = (CPUOffload() if cpu_offload is None
                   else coerce(cpu_offload, CPUOffload, "FullyShardedDataParallel(cpu_offload=...)"))
        prefetch = (None if backward_prefetch is None
                    else coerce(backward_prefetch, BackwardPrefetch, "FullyShardedDataParallel(backward_prefetch=...)"))
        if param_init_fn is not None and not callable(param_init_fn):
            raise ValueError(f"FullyShardedDataParallel(param_init_fn=...): expected a callable fn(module), got "
                             f"{type(param_init_fn).__name__}. Fix: e.g. param_init_fn=lambda m: m.to_empty("
                             "device=torch.device('cuda'), recurse=False).")
        ignored_mods, ignored_params = _resolve_ignored(module, ignored_modules, ignored_states)
        if process_group is not None and not isinstance(process_group, tuple):
            check_group(process_group, "process_group")  # before the default group is read (tests pass none)
        device_type = compute_device_type(device_id)
        placement = resolve_placement(strategy, process_group=process_group, device_mesh=device_mesh,
                                      device_type=device_type)
        device = device_of(placement.mesh)
        _check_device_id(device_id, device)
        child_kwargs: dict[str, Any] = {
            "process_group": process_group, "sharding_strategy": strategy, "cpu_offload": offload,
            "backward_prefetch": prefetch, "mixed_precision": mp, "param_init_fn": param_init_fn,
            "device_id": device_id, "sync_module_states": sync_module_states, "forward_prefetch": forward_prefetch,
            "limit_all_gathers": limit_all_gathers, "use_orig_params": use_orig_params,
            "ignored_states": None, "device_mesh": device_mesh}
        targets = []
        if auto_wrap_policy is not None:
            targets = wrap_targets(module, auto_wrap_policy, ignored_modules=ignored_mods,
                                   ignored_params=ignored_params, root_kwargs=child_kwargs, is_wrapped=_is_unit,
                                   full_precision_classes=tuple(mp._module_classes_to_ignore) if mp else ())
        # --- the model changes from here on -------------------------------------------------------------
        for target in targets:
            kwargs = {**child_kwargs, **target.overrides, "auto_wrap_policy": None}
            if target.overrides.get("mixed_precision", mp) is None and mp is not None:
                _run_in_full_precision(target.module)  # FSDP1's BatchNorm rule
            kwargs["ignored_modules"] = [m for m in ignored_mods if _under(m, target.module)] or None
            setattr(target.parent, target.name, type(self)(target.module, **kwargs))
        modules = unit_modules(module, ignored_modules=ignored_mods, is_wrapped=_is_unit)
        materialize(modules, param_init_fn=param_init_fn, device=device, ignored_params=ignored_params)
        if sync_module_states:
            broadcast_module_states(modules, mesh=placement.mesh, ignored_params=ignored_params)
        self._fsdp_wrapped_module = module
        self._set_fsdp1_attributes(placement, strategy, mp, offload, prefetch, forward_prefetch, limit_all_gathers,
                                   use_orig_params, device, ignored_mods)
        originals = {(id(m), n): p for m in modules for n, p in m._parameters.items()
                     if p is not None and id(p) not in ignored_params}
        buffer_dtypes = _buffer_dtypes(module, modules, mp)
        fully_shard(self, mesh=placement.mesh, reshard_after_forward=placement.reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(param_dtype=mp.param_dtype if mp else None,
                                                   reduce_dtype=fsdp1_reduce_dtype(mp),
                                                   cast_forward_inputs=False),  # FSDP1's casting: forward()
                    offload_policy=CPUOffloadPolicy() if offload.offload_params else OffloadPolicy(),
                    ignored_params={p for p in module.parameters() if id(p) in ignored_params} or None)
        state = get_state(self)
        assert state is not None
        for group in state.groups:  # an optimizer built before wrapping steps the sharded parameters
            for sp in group.params:
                for m, n in sp.slots:
                    original = originals.get((id(m), n))
                    if original is not None:
                        keep_original(original, sp)
        for inner in module.modules():
            if isinstance(inner, FullyShardedDataParallel):
                inner.__dict__[sd.NESTED_ATTR] = True
        self.__dict__[sd.SETTINGS_ATTR] = sd.default_settings()
        self.__dict__[sd.BUFFER_DTYPES_ATTR] = buffer_dtypes
        self.__dict__["_fsdp1_summoning"] = False
        self.register_state_dict_post_hook(sd.state_dict_post_hook)
        self.register_load_state_dict_pre_hook(sd.load_pre_hook)

    def _set_fsdp1_attributes(self, placement: Placement, strategy: ShardingStrategy, mp: MixedPrecision | None,
                              offload: CPUOffload, prefetch: BackwardPrefetch | None, forward_prefetch: bool,
                              limit_all_gathers: bool, use_orig_params: bool, device: torch.device,
                              ignored_mods: set[nn.Module]) -> None:
        """The attributes FSDP1 code reads off a wrapper (plain values, as FSDP1 sets them)."""
        self.__dict__.update({
            "sharding_strategy": strategy, "mixed_precision": mp if mp is not None else MixedPrecision(),
            "_fsdp1_mp": mp, "cpu_offload": offload, "backward_prefetch": prefetch,
            "forward_prefetch": forward_prefetch, "limit_all_gathers": limit_all_gathers,
            "_use_orig_params": use_orig_params, "process_group": placement.process_group,
            "_inter_node_pg": placement.inter_node_group, "_device_mesh": placement.mesh,
            "compute_device": device, "rank": dist.get_rank(placement.process_group),
            "world_size": dist.get_world_size(placement.process_group), "_ignored_modules": ignored_mods,
            "_flat_param": None, "_handle": None})

    # --- the wrapped module -------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        inner = self._modules[_WRAPPED_NAME]
        assert inner is not None
        return inner

    def __getattr__(self, name: str) -> Any:
        """Attributes the wrapper does not have come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules.get(_WRAPPED_NAME) if name != _WRAPPED_NAME else None
            if inner is None:
                raise
            return getattr(inner, name)

    def __getitem__(self, key: int) -> Any:
        """Indexing reaches the wrapped module (an ``nn.Sequential``)."""
        return self.module[key]  # type: ignore[index]

    def _get_name(self) -> str:
        return "FullyShardedDataParallel"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, between this unit's all-gather and reshard (its hooks), with
        FSDP1's input casting (the root's inputs if ``cast_root_forward_inputs``, every unit's if
        ``cast_forward_inputs``) and buffers at ``buffer_dtype``."""
        if self.__dict__.get("_fsdp1_summoning"):
            raise RuntimeError("FullyShardedDataParallel.forward inside summon_full_params: the full parameters are "
                               "exposed for reading and editing only. Fix: run forward after leaving the context.")
        state = self._state()
        mp: MixedPrecision | None = self.__dict__["_fsdp1_mp"]
        if state.is_root:
            _cast_buffers(self)  # (nothing to do unless a unit has MixedPrecision(buffer_dtype=...))
        if mp is not None and mp.param_dtype is not None:
            cast = mp.cast_root_forward_inputs if state.is_root else (mp.cast_forward_inputs and bool(state.groups))
            if cast:
                args, kwargs = _cast_floats(mp.param_dtype, args, kwargs)
        return self.module(*args, **kwargs)

    def _state(self) -> FSDPState:
        state = get_state(self)
        assert state is not None
        return state

    @property
    def _is_root(self) -> bool | None:
        """Whether this wrapper runs as the root (None before its first forward), as FSDP1's."""
        state = self._state()
        return state.is_root if state.root is not None else None

    def check_is_root(self) -> bool:
        """Whether this wrapper is the root: no wrapper encloses it (known without a forward)."""
        state = self._state()
        if state.root is not None:
            return state.is_root
        return not self.__dict__.get(sd.NESTED_ATTR, False)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every wrapper at or below ``module`` (``root_only``: those no other wrapper encloses)."""
        if not root_only:
            return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        out: list[FullyShardedDataParallel] = []
        stack = [module]
        while stack:
            m = stack.pop()
            if isinstance(m, FullyShardedDataParallel):
                out.append(m)
                continue
            stack.extend(reversed([c for c in m.children() if c is not None]))
        return out

    # --- names without the wrapper prefix --------------------------------------------------------------
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """As ``nn.Module.named_parameters``, without ``_fsdp_wrapped_module.`` in the names."""
        for name, param in super().named_parameters(*args, **kwargs):
            yield name.replace(sd.WRAPPED, ""), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """As ``nn.Module.named_buffers``, without ``_fsdp_wrapped_module.`` in the names."""
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield name.replace(sd.WRAPPED, ""), buffer

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` under the state-dict type; the whole dict is checked against the
        model first (keys if ``strict``, shapes always), so a mismatch loads nothing."""
        token = sd.STRICT.set(strict)
        try:
            result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            sd.STRICT.reset(token)
        for keys in (result.missing_keys, result.unexpected_keys):  # (strict=False) named as the state dict names them
            keys[:] = [k.replace(sd.WRAPPED, "") for k in keys]
        return result

    # --- training ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Inside, backward accumulates unsharded gradients with no collective; the first backward after
        the context reduces the sum. Call on the root (as FSDP1)."""
        state = self._state()
        state.lazy_init()
        if not state.is_root:
            raise RuntimeError("`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` on "
                               "root FSDP module.")
        self._check_idle("no_sync")
        groups = [g for _, s in _states(self) for g in s.groups]
        before = [g.reducer.requires_gradient_sync for g in groups]
        for g in groups:
            g.reducer.requires_gradient_sync = False
        try:
            yield
        finally:
            for g, flag in zip(groups, before):
                g.reducer.requires_gradient_sync = flag

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every parameter under this root to total ``norm_type``-norm ``max_norm``;
        return the total norm before clipping (the same on every rank). Call on the root (as FSDP1)."""
        state = self._state()
        state.lazy_init()
        if not state.is_root:
            raise RuntimeError("`clip_grad_norm_()` should only be called on the root FSDP instance")
        if state.training_state is not TrainingState.IDLE:  # (the root's: FSDP1 checks it alone too)
            raise RuntimeError(f"FullyShardedDataParallel.clip_grad_norm_: the root is in "
                               f"{state.training_state.name}; call it after backward, before the next forward.")
        params = list(self.parameters())
        total = _clip_grad_norm(params, max_norm, norm_type)
        dtypes = [p.grad.dtype for p in params if p.grad is not None]
        if dtypes:
            total = total.to(functools.reduce(torch.promote_types, dtypes))
        else:  # torch's words (its tests match them): generally a mistake, e.g. called before backward
            warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {self.rank} with no gradients -- returning the "
                          f"total norm in the default dtype {total.dtype}", stacklevel=2)
        return total

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:  # type: ignore[override]
        """``nn.Module.apply`` with this unit's full parameters in place (written back after), as FSDP1."""
        self._check_idle("apply")
        with summon([("", self._state())], writeback=True, rank0_only=False, offload_to_cpu=False, with_grads=False):
            super().apply(fn)
        return self

    def _assert_state(self, state: Any) -> None:
        """torch's FSDP1 private check (torch's test helpers call it after a step): raise ValueError unless
        this wrapper is in ``state`` (one of torch's ``TrainingState`` members, or a list of them), with
        torch's words. IDLE between steps, SUMMON_FULL_PARAMS inside ``summon_full_params``, else
        FORWARD_BACKWARD."""
        wanted = list(state) if isinstance(state, (list, tuple)) else [state]
        unit = self._state()
        if self.__dict__.get("_fsdp1_summoning"):
            current = "SUMMON_FULL_PARAMS"
        elif unit.training_state is TrainingState.IDLE:
            current = "IDLE"
        else:
            current = "FORWARD_BACKWARD"
        if current not in {getattr(s, "name", s) for s in wanted}:
            raise ValueError(f"expected to be in states {wanted} but current state is TrainingState.{current}")

    def _check_idle(self, what: str) -> None:
        for fqn, s in _states(self):
            if s.training_state is not TrainingState.IDLE:
                raise RuntimeError(f"FullyShardedDataParallel.{what}: unit {fqn or '<root>'!r} is in "
                                   f"{s.training_state.name}; call it between steps, not inside forward/backward.")

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        raise NotImplementedError(
            "FullyShardedDataParallel.register_comm_hook: FSDP1 comm hooks act on flat-parameter gradients, which "
            "this library does not have. Fix: MixedPrecision(reduce_dtype=torch.bfloat16) for low-precision "
            "reduction, or set_all_reduce_hook(hook) on the unit for a hook on each reduced gradient.")

    # --- full parameters ------------------------------------------------------------------------------
    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False) -> Generator[None, None, None]:
        """Full parameters (plain tensors, the parameters' own dtype) in every wrapper at or below ``module``
        (``recurse=False``: ``module`` itself only); edits written back to the shards on exit
        (``writeback``). Collective: every rank enters."""
        if recurse:
            wrappers = FullyShardedDataParallel.fsdp_modules(module)
        else:
            wrappers = [module] if isinstance(module, FullyShardedDataParallel) else []
        states = [(type(w.module).__name__, w._state()) for w in wrappers]
        with summon(states, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu,
                    with_grads=with_grads):
            for w in wrappers:
                w.__dict__["_fsdp1_summoning"] = True
            try:
                yield
            finally:
                for w in wrappers:
                    w.__dict__["_fsdp1_summoning"] = False

    # --- state dicts ---------------------------------------------------------------------------------
    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: Any, state_dict_config: Any = None,
                            optim_state_dict_config: Any = None) -> StateDictSettings:
        """What ``state_dict()`` / ``load_state_dict()`` and ``optim_state_dict`` give and take for every
        wrapper at or below ``module``; returns the previous settings."""
        return sd.set_settings(list(FullyShardedDataParallel.fsdp_modules(module)), state_dict_type, state_dict_config,
                               optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The settings of the wrappers at or below ``module`` (they must agree)."""
        wrappers = FullyShardedDataParallel.fsdp_modules(module)
        if not wrappers:
            raise ValueError(f"get_state_dict_type: no FullyShardedDataParallel in {type(module).__name__}. Fix: pass "
                             "the wrapped model.")
        settings = sd.settings_of(wrappers[0])
        for w in wrappers[1:]:
            if sd.settings_of(w) != settings:
                raise AssertionError(f"All FSDP modules must have the same state dict settings. Got "
                                     f"{sd.settings_of(w)} and {settings}.")
        return settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: Any, state_dict_config: Any = None,
                        optim_state_dict_config: Any = None) -> Generator[None, None, None]:
        """``set_state_dict_type`` for the duration of the context."""
        previous = FullyShardedDataParallel.set_state_dict_type(module, state_dict_type, state_dict_config,
                                                                 optim_state_dict_config)
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(module, previous.state_dict_type,
                                                         previous.state_dict_config, previous.optim_state_dict_config)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None, group: Any = None) -> dict[str, Any]:
        """The optimizer state keyed by parameter FQN under the model's state-dict type (optim_state.py)."""
        return optim_state.optim_state_dict(model, optim, optim_state_dict,
                                            FullyShardedDataParallel.get_state_dict_type(model))

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any],
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group: Any = None) -> dict[str, Any]:
        """``optim_state_dict`` (ours or torch FSDP1's) as the id-keyed dict ``optim.load_state_dict`` takes
        (loaded into ``optim`` as well with ``load_directly``)."""
        return optim_state.optim_state_dict_to_load(model, optim, optim_state_dict,
                                                    FullyShardedDataParallel.get_state_dict_type(model),
                                                    load_directly=load_directly)

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, optim_input: Any = None,
                              rank0_only: bool = True, group: Any = None) -> dict[str, Any]:
        """FSDP1's legacy full optimizer state dict (FQN-keyed full tensors; rank 0 only by default)."""
        return optim_state.full_optim_state_dict(model, optim, rank0_only=rank0_only)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, group: Any = None) -> dict[str, Any]:
        """FSDP1's legacy sharded optimizer state dict (FQN-keyed DTensors)."""
        settings = StateDictSettings(StateDictType.SHARDED_STATE_DICT,
                                     FullyShardedDataParallel.get_state_dict_type(model).state_dict_config,
                                     optim_state.sharded_config())
        return optim_state.optim_state_dict(model, optim, None, settings)


# --- helpers ------------------------------------------------------------------------------------------
def _is_unit(module: nn.Module) -> bool:
    return get_state(module) is not None


def _under(module: nn.Module, root: nn.Module) -> bool:
    return any(m is module for m in root.modules())


def _states(wrapper: nn.Module) -> list[tuple[str, FSDPState]]:
    seen: set[int] = set()
    out = []
    for fqn, m in wrapper.named_modules():
        state = get_state(m)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            out.append((fqn.replace(sd.WRAPPED, ""), state))
    return out


def _check_module(module: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"FullyShardedDataParallel expects an nn.Module, got {type(module).__name__}: {module!r:.80}")
    mine = unit_modules(module, ignored_modules=set(), is_wrapped=_is_unit)  # (units inside are fine: nesting)
    owned = next((f"{n!r} ({registry.owner_of(p)})" for m in mine for n, p in m._parameters.items()
                  if p is not None and registry.owner_of(p) is not None), None)
    if isinstance(module, FullyShardedDataParallel) or get_state(module) is not None or owned is not None:
        found = f"its parameter {owned} belongs to a unit" if owned else "it is a wrapper or a fully_shard unit"
        raise ValueError(f"FullyShardedDataParallel: this {type(module).__name__} is already sharded ({found}); "
                         "wrapping it again would shard the shards. Fix: wrap the unwrapped model once (nested "
                         "wrappers: wrap the inner modules first, then the outer one).")


def _check_mixed_precision(mp: MixedPrecision | None) -> None:
    if mp is not None and mp.keep_low_precision_grads:
        raise NotImplementedError(
            "MixedPrecision(keep_low_precision_grads=True): the sharded gradient is a DTensor of the parameter's own "
            "dtype here (a float32 parameter cannot hold a bfloat16 .grad). Fix: keep_low_precision_grads=False "
            "(gradients are reduced in reduce_dtype and cast back), or keep the parameters themselves in bfloat16.")


def _check_device_id(device_id: int | torch.device | None, device: torch.device) -> None:
    if device_id is None:
        return
    wanted = device_id if isinstance(device_id, torch.device) else torch.device(device_id)
    if wanted.type != device.type or (wanted.index is not None and device.index is not None
                                      and wanted.index != device.index):
        raise ValueError(f"FullyShardedDataParallel(device_id={device_id!r}): this rank computes on {device} (the "
                         f"current {device.type} device). Fix: torch.{wanted.type}.set_device({wanted.index}) before "
                         "wrapping, or pass device_id=torch.cuda.current_device().")


def _resolve_ignored(module: nn.Module, ignored_modules: Iterable[nn.Module] | None,
                     ignored_states: Iterable[Any] | None) -> tuple[set[nn.Module], set[int]]:
    """(ignored modules with everything under them, ids of their parameters and the ignored parameters)."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("FullyShardedDataParallel: pass ignored_modules or ignored_states, not both. Fix: list the "
                         "modules in ignored_states (or only in ignored_modules).")
    mods: list[nn.Module] = []
    params: list[torch.Tensor] = []
    for item in list(ignored_modules or ()) + list(ignored_states or ()):
        if isinstance(item, nn.Module):
            mods.append(item)
        elif isinstance(item, torch.Tensor):
            params.append(item)
        else:
            raise TypeError(f"FullyShardedDataParallel: ignored_modules/ignored_states take modules or parameters, got "
                            f"{type(item).__name__}.")
    if mods and params:
        raise ValueError("FullyShardedDataParallel(ignored_states=...): give either modules or parameters, not a "
                         "mix (as FSDP1). Fix: pass the modules' parameters instead.")
    expanded: set[nn.Module] = set()
    for m in mods:
        if isinstance(m, FullyShardedDataParallel):
            raise ValueError("FullyShardedDataParallel: ignored_modules must not be FullyShardedDataParallel "
                             "wrappers. Fix: pass the module it wraps (before wrapping).")
        if m is module:
            raise ValueError("FullyShardedDataParallel: the wrapped module itself cannot be ignored. Fix: ignore "
                             "its children, or do not wrap it.")
        expanded.update(m.modules())
    ids = {id(p) for m in expanded for p in m.parameters()} | {id(p) for p in params}
    return expanded, ids


def _buffer_dtypes(root: nn.Module, modules: list[nn.Module], mp: MixedPrecision | None) -> dict[str, torch.dtype]:
    """{buffer key relative to the wrapped module: original dtype} of this unit's buffers, when
    ``buffer_dtype`` casts them (full state dicts give them back at the original dtype)."""
    if mp is None or mp.buffer_dtype is None:
        return {}
    mine = {id(m) for m in modules}
    return {f"{prefix}.{name}" if prefix else name: b.dtype for prefix, m in root.named_modules() if id(m) in mine
            for name, b in m._buffers.items() if b is not None and name not in m._non_persistent_buffers_set}


def _cast_buffers(root: FullyShardedDataParallel) -> None:
    """Every unit's buffers at its ``buffer_dtype`` (FSDP1 casts at the root's pre-forward). The
    (module, name, dtype) slots are listed once per root; a buffer replaced since is cast again."""
    slots = root.__dict__.get("_fsdp1_buffer_slots")
    if slots is None:
        slots = []
        for wrapper in FullyShardedDataParallel.fsdp_modules(root):
            mp: MixedPrecision | None = wrapper.__dict__["_fsdp1_mp"]
            if mp is None or mp.buffer_dtype is None:
                continue
            for m in unit_modules(wrapper.module, ignored_modules=wrapper.__dict__["_ignored_modules"],
                                  is_wrapped=_is_unit):
                slots += [(m, name, mp.buffer_dtype) for name, b in m._buffers.items()
                          if b is not None and b.is_floating_point()]
        root.__dict__["_fsdp1_buffer_slots"] = slots
    for m, name, dtype in slots:
        b = m._buffers.get(name)
        if b is not None and b.dtype != dtype:
            m._buffers[name] = b.to(dtype)


def _cast_floats(dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(cast, args), map_tensors(cast, kwargs)


def _run_in_full_precision(module: nn.Module) -> None:
    """FSDP1's rule for MixedPrecision's ignored classes (BatchNorm): inputs cast to float32 before the
    module and its outputs back to the input dtype after."""
    input_dtype: dict[str, torch.dtype] = {}  # this module's last floating input dtype (its hooks own it)

    def pre(mod: nn.Module, args: tuple) -> tuple:
        found = [t.dtype for t in _floats(args)]
        if found:
            input_dtype["last"] = found[0]
        out: tuple = map_tensors(lambda t: t.to(torch.float32) if t.is_floating_point() else t, args)
        return out

    def post(mod: nn.Module, args: tuple, output: Any) -> Any:
        dtype = input_dtype.get("last")
        if dtype is None:
            return output
        return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, output)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _floats(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            found.append(t)
        return t

    map_tensors(visit, tree)
    return found
