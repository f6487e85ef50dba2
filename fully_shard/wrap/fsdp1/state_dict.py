"""FSDP1's state_dict_type: what ``model.state_dict()`` gives and ``load_state_dict()`` takes, by hooks on each wrapper.

Every ``FullyShardedDataParallel`` registers a state-dict post-hook and a load pre-hook (as FSDP1 does):
the post-hook strips its ``_fsdp_wrapped_module.`` from the keys under it and turns the sharded DTensors
into what the state-dict type asks for (FULL: plain full tensors, gathered one at a time, optionally to
CPU and rank 0 only; SHARDED: the DTensors, which ``torch.distributed.checkpoint`` saves and loads;
LOCAL: this rank's shards as plain tensors); the load pre-hook checks the whole dict against the model
first (missing/unexpected keys, shapes: an error leaves the model unchanged), puts the prefix back and
turns each value into a DTensor laid out like its parameter. See design/fsdp1.md.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Generator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...checkpoint.errors import Signature, check_structure
from ...checkpoint.state_dict import gather_full, offload_to_cpu
from ...checkpoint.views import describe, from_local_like, shard_like
from .options import (
    CONFIG_OF,
    OPTIM_CONFIG_OF,
    FullStateDictConfig,
    OptimStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    coerce,
    coerce_config,
)

__all__ = ["WRAPPED", "default_settings", "load_pre_hook", "state_dict_post_hook", "settings_of", "set_settings"]

WRAPPED = "_fsdp_wrapped_module."
SETTINGS_ATTR = "_fsdp1_state_dict_settings"
BUFFER_DTYPES_ATTR = "_fsdp1_buffer_dtypes"  # {key relative to the wrapper: original dtype} (buffer_dtype cast)
NESTED_ATTR = "_fsdp1_nested"  # inside another FullyShardedDataParallel: the outer one checks load structure

# structure only: the post-hook renames keys and leaves values as held (no gather), for the load check
_STRUCTURE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("fsdp1_structure_only", default=False)
# the ``strict`` of the wrapper's own load_state_dict call (nn.Module hands its hooks strict=True always);
# None: loaded through a plain parent module, whose strict is unknown: only shapes are checked up front
STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("fsdp1_strict", default=None)


def default_settings() -> StateDictSettings:
    return StateDictSettings(StateDictType.FULL_STATE_DICT, CONFIG_OF[StateDictType.FULL_STATE_DICT](),
                             OPTIM_CONFIG_OF[StateDictType.FULL_STATE_DICT]())


def settings_of(module: nn.Module) -> StateDictSettings:
    settings: StateDictSettings = getattr(module, SETTINGS_ATTR)
    return settings


def set_settings(wrappers: Sequence[nn.Module], state_dict_type: Any, state_dict_config: Any,
                 optim_state_dict_config: Any) -> StateDictSettings:
    """Set the state-dict type and configs of every wrapper in ``wrappers``; return the previous settings
    (which must agree across wrappers, as FSDP1 asserts)."""
    kind = coerce(state_dict_type, StateDictType, "state_dict_type")
    config: StateDictConfig = coerce_config(state_dict_config, CONFIG_OF[kind], "state_dict_config")
    optim_config: OptimStateDictConfig = coerce_config(optim_state_dict_config, OPTIM_CONFIG_OF[kind],
                                                       "optim_state_dict_config")
    previous = None
    for wrapper in wrappers:
        mine = settings_of(wrapper)
        if previous is None:
            previous = mine
        elif mine.state_dict_type is not previous.state_dict_type:
            raise AssertionError(f"FSDP modules disagree on state_dict_type: {previous.state_dict_type.name} and "
                                 f"{mine.state_dict_type.name}. Fix: set it on the root module only.")
    for wrapper in wrappers:
        setattr(wrapper, SETTINGS_ATTR, StateDictSettings(kind, config, optim_config))
    return previous if previous is not None else default_settings()


@contextlib.contextmanager
def structure_only() -> Generator[None, None, None]:
    token = _STRUCTURE_ONLY.set(True)
    try:
        yield
    finally:
        _STRUCTURE_ONLY.reset(token)


# --- save ---------------------------------------------------------------------------------------------
def state_dict_post_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Strip this wrapper's prefix from the keys under it and convert their values (module docstring).
    The wrappers inside ran first, so their keys are converted already: converting a DTensor is the only
    work left, and it happens once per value."""
    settings = settings_of(module)
    kind = settings.state_dict_type
    structure = _STRUCTURE_ONLY.get()
    rank0_only = (kind is StateDictType.FULL_STATE_DICT and isinstance(settings.state_dict_config, FullStateDictConfig)
                  and settings.state_dict_config.rank0_only)
    drop = rank0_only and not structure and dist.get_rank() != 0
    cpu = settings.state_dict_config.offload_to_cpu and not structure
    buffer_dtypes: dict[str, torch.dtype] = getattr(module, BUFFER_DTYPES_ATTR, {})
    wrapped = prefix + WRAPPED
    for key in [k for k in state_dict if k.startswith(wrapped)]:
        value = state_dict.pop(key)
        relative = key[len(wrapped):]
        if isinstance(value, DTensor):
            if structure:
                value = value.to_local() if kind is StateDictType.LOCAL_STATE_DICT else value
            elif kind is StateDictType.FULL_STATE_DICT:
                value = gather_full(value, cpu_offload=cpu)  # collective: every rank, in key order
            elif kind is StateDictType.LOCAL_STATE_DICT:
                value = value.to_local().detach()
                value = value.cpu() if cpu else value
            else:
                value = offload_to_cpu(value) if cpu else value.detach()
        elif isinstance(value, torch.Tensor) and not structure:
            if kind is StateDictType.FULL_STATE_DICT and relative in buffer_dtypes:
                value = value.detach().to(buffer_dtypes[relative], copy=True)  # buffer_dtype: the original dtype
            if cpu:
                value = value.detach().cpu()
        if not drop:
            state_dict[prefix + relative] = value


# --- load ---------------------------------------------------------------------------------------------
def _signature(value: Any) -> Signature:
    if not isinstance(value, torch.Tensor):
        return ("object", ())
    return ("any", tuple(value.shape))  # dtypes are cast on load


def expected_structure(module: nn.Module) -> dict[str, Signature]:
    """The keys and shapes ``module.state_dict()`` has under the current state-dict type (no gathering)."""
    with structure_only():
        held = module.state_dict(keep_vars=True)
    return {k: _signature(v) for k, v in held.items()}


def load_pre_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                  missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Check (outermost wrapper), put this wrapper's prefix back, lay each value out like its parameter."""
    if prefix == "" or not getattr(module, NESTED_ATTR, False):
        _check_structure(module, state_dict, prefix, STRICT.get())
    kind = settings_of(module).state_dict_type
    wrapped = prefix + WRAPPED
    inner = module._modules[WRAPPED[:-1]]
    assert inner is not None
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(wrapped)]:
        relative = key[len(prefix):]
        value = state_dict.pop(key)
        target = _resolve(inner, relative)
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor):
            value = _like(target, value, kind)
        state_dict[wrapped + relative] = value


def _check_structure(module: nn.Module, state_dict: dict[str, Any], prefix: str, strict: bool | None) -> None:
    expected = expected_structure(module)
    found = {k[len(prefix):]: _signature(v) for k, v in state_dict.items() if k.startswith(prefix)}
    where = f" under {prefix[:-1]!r}" if prefix else ""
    check_structure(expected, found, strict=bool(strict),
                    title=f"load_state_dict: the state dict does not match this {module._get_name()}{where} "
                          f"({settings_of(module).state_dict_type.name}); nothing was loaded:",
                    fix="load a state dict saved from this model under the same state_dict_type (keys without "
                        "'_fsdp_wrapped_module.'), or strict=False to skip missing/unexpected keys (not shapes)")


def _resolve(module: nn.Module, key: str) -> torch.Tensor | None:
    """The parameter or buffer ``key`` names under ``module``, through plain modules only (a key of a
    nested wrapper has no ``_fsdp_wrapped_module`` yet: that wrapper converts it)."""
    *path, name = key.split(".")
    for part in path:
        child = module._modules.get(part)
        if child is None:
            return None
        module = child
    return module._parameters.get(name) if name in module._parameters else module._buffers.get(name)


def _like(target: DTensor, value: torch.Tensor, kind: StateDictType) -> torch.Tensor:
    """``value`` as a DTensor with ``target``'s mesh and placements (this rank's rows of a full tensor,
    this rank's shard under LOCAL_STATE_DICT)."""
    if isinstance(value, DTensor):
        if value.device_mesh == target.device_mesh and value.placements == target.placements:
            return value
        value = value.full_tensor()
    if kind is StateDictType.LOCAL_STATE_DICT and tuple(value.shape) == tuple(describe("p", target).local.shape):
        return from_local_like(target, value.detach().to(target.device, copy=True), tuple(target.shape))
    if tuple(value.shape) == tuple(target.shape):
        return shard_like(target, value.to(target.dtype) if value.dtype != target.dtype else value)
    return value  # a shape the structure check let through (strict=False on another key): torch reports it
