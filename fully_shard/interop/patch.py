"""compat: opt-in ``patch_torch()`` makes code that imports torch's FSDP2 names run on this library.

Frameworks (torchtitan, torchtune, accelerate, Lightning) import ``fully_shard`` and friends from
``torch.distributed.fsdp`` themselves, so "change one import" cannot reach them. ``patch_torch()``
rebinds those names, in torch's own modules, to this library's objects; ``unpatch_torch()`` puts back
exactly what was there. Nothing happens on import: only an explicit call patches. This is the one
library file that touches torch's FSDP modules, and only to rebind names (see design/compat.md).

Call ``patch_torch()`` before the framework is imported: a module that already ran
``from torch.distributed.fsdp import fully_shard`` holds torch's object in its own namespace (the
torch modules in the table below that do so are rebound too).

Names touched: the table ``REBINDINGS`` below, one record per torch module and the torch versions that
bind those names there (``rebindings_for()`` picks the running torch's rows; design/compat.md prints it):
``torch.distributed.fsdp`` and its ``_fully_shard`` package (the eight public FSDP2 names, plus
``GradientReductionHandle`` from torch 2.15), the legacy ``torch.distributed._composable.fsdp`` path,
and the names torch's pipelining binds at its import (``stage``: ``fully_shard`` before 2.15,
``GradientReductionHandle`` from 2.15; ``schedules``).

While patched, this library's ``FSDPModule`` also has torch's private ``_get_fsdp_state()`` (torchtitan's torchft
path sets ``_fsdp_param_groups[i]._all_reduce_hook`` through it; removed again by ``unpatch_torch()``).

Left alone on purpose (design/compat.md has the reasons): torch's implementation modules
(``_fully_shard._fully_shard``, ``_fsdp_api``, ``_fsdp_common``, ``_fsdp_init``, ``_fsdp_param_group``,
``_fsdp_state``), so torch's own fully_shard keeps working side by side while patched;
``DataParallelMeshDims`` and the private ``FSDPMeshInfo`` / ``ShardPlacementResult`` /
``_get_mesh_info`` (torchtitan's expert-parallel path), plain records the ``fully_shard`` bound here
reads (``dp_mesh_dims`` picks the sub-mesh; a ``ShardPlacementResult`` gives its parameter a placement
and a mesh: per-parameter meshes, design/experts.md); ``torch.distributed._tools.
fsdp2_mem_tracker`` (it wraps torch's ``FSDPParamGroup`` methods, so it keeps seeing only torch's
units); ``torch.distributed.checkpoint.state_dict`` (imports only FSDP1 names; it works on the
DTensor state dicts as is). Dynamo's two module flags (``_is_fsdp_managed_module``,
``_fsdp_use_orig_params``) are set by this library's own ``fully_shard`` (core/dynamo.py), patched or not.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..core import api
from ..core.finalize import GradientReductionHandle
from ..core.group import ParamGroup
from ..core.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from ..core.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..core.state import FSDPState, get_state
from ..core.torch_version import TORCH_VERSION, Version
from ..parallel.mesh import MeshInfo

__all__ = ["REBINDINGS", "TARGETS", "GroupView", "MeshInfoView", "Rebinding", "StateView", "fully_shard", "is_patched",
           "patch_torch", "patched_names", "rebindings_for", "unpatch_torch"]

@dataclass(frozen=True)
class Rebinding:
    """Names one torch module binds to torch's FSDP objects on torch ``since`` <= version < ``until``
    (None: no upper bound), and that ``patch_torch()`` rebinds there to this library's."""

    module: str
    names: tuple[str, ...]
    since: Version = (2, 10)
    until: Version | None = None

    def applies(self, version: Version) -> bool:
        return self.since <= version and (self.until is None or version < self.until)


_PUBLIC = ("fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy", "register_fsdp_forward_method", "share_comm_ctx")
_FSDP = "torch.distributed.fsdp"
_PACKAGE = "torch.distributed.fsdp._fully_shard"
_STAGE = "torch.distributed.pipelining.stage"
REBINDINGS: tuple[Rebinding, ...] = (
    Rebinding(_FSDP, _PUBLIC),
    Rebinding(_FSDP, ("GradientReductionHandle",), since=(2, 15)),
    Rebinding(_PACKAGE, _PUBLIC),
    Rebinding(_PACKAGE, ("GradientReductionHandle",), since=(2, 15)),
    Rebinding("torch.distributed._composable.fsdp", ("fully_shard", "FSDPModule", "MixedPrecisionPolicy",
                                                     "OffloadPolicy", "CPUOffloadPolicy",
                                                     "register_fsdp_forward_method")),
    Rebinding("torch.distributed._composable.fsdp.fully_shard", ("fully_shard", "FSDPModule", "UnshardHandle",
                                                                 "register_fsdp_forward_method")),
    Rebinding(_STAGE, ("FSDPModule",)),
    Rebinding(_STAGE, ("fully_shard",), until=(2, 15)),  # 2.15's stage calls finalize_backward instead
    Rebinding(_STAGE, ("GradientReductionHandle",), since=(2, 15)),
    Rebinding("torch.distributed.pipelining.schedules", ("FSDPModule", "UnshardHandle")),
)


def rebindings_for(version: Version = TORCH_VERSION,
                   table: tuple[Rebinding, ...] = REBINDINGS) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(module, names)`` per torch module, in the table's order: the rows of ``table`` that apply to
    torch ``version`` (default the running one), merged by module."""
    merged: dict[str, list[str]] = {}
    for row in table:
        if row.applies(version):
            merged.setdefault(row.module, []).extend(n for n in row.names if n not in merged.get(row.module, ()))
    return tuple((module, tuple(names)) for module, names in merged.items())


TARGETS = rebindings_for()  # the running torch's

_LOCK = threading.Lock()
_SAVED: dict[tuple[str, str], object] = {}  # (module, name) -> torch's object, while patched


# --- the fully_shard torch code calls ------------------------------------------------------------
class _TorchSignatureFullyShard:
    """``fully_shard`` with torch 2.13's signature (``dp_mesh_dims``, ``ShardPlacementResult``, torch's
    policy objects) and its ``fully_shard.state(module)`` accessor, running this library."""

    def __call__(self, module: Any, *, mesh: DeviceMesh | None = None,
                 reshard_after_forward: bool | int | None = None,
                 shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                 mp_policy: Any = MixedPrecisionPolicy(), offload_policy: Any = OffloadPolicy(),
                 ignored_params: set[nn.Parameter] | None = None, dp_mesh_dims: Any = None) -> Any:
        out = api.fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                              shard_placement_fn=shard_placement_fn,
                              mp_policy=_mp_policy(mp_policy), offload_policy=_offload_policy(offload_policy),
                              ignored_params=ignored_params, dp_mesh_dims=dp_mesh_dims)
        return out  # api.fully_shard sets Dynamo's module flags (dynamo.mark_managed)

    def state(self, module: nn.Module) -> StateView | None:
        """``fully_shard.state(module)``: the view torch's pipelining reads (``perform_reduce_grad``);
        None for a module not passed to fully_shard (as torch's)."""
        state = get_state(module)
        return StateView(state) if state is not None else None

    def __repr__(self) -> str:
        return "<fully_shard.compat.fully_shard (torch's signature, this library)>"


fully_shard = _TorchSignatureFullyShard()


def _convert(value: Any, ours: type) -> Any:
    """torch's frozen policy dataclass (imported before patching) -> ours, field by field."""
    if isinstance(value, ours):
        return value
    if not dataclasses.is_dataclass(value):
        raise TypeError(f"expected a {ours.__name__}, got {type(value).__name__}: {value!r}")
    names = {f.name for f in dataclasses.fields(ours)}
    return ours(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name in names})


def _mp_policy(value: Any) -> MixedPrecisionPolicy:
    return _convert(value, MixedPrecisionPolicy)  # type: ignore[no-any-return]


def _offload_policy(value: Any) -> OffloadPolicy:
    if isinstance(value, OffloadPolicy):
        return value
    kind = type(value).__name__
    if kind not in ("OffloadPolicy", "CPUOffloadPolicy"):
        raise TypeError(f"offload_policy expects OffloadPolicy() or CPUOffloadPolicy(...), got {kind}: {value!r}")
    return _convert(value, CPUOffloadPolicy) if kind == "CPUOffloadPolicy" else OffloadPolicy()  # type: ignore[no-any-return]


def _ours(name: str) -> object:
    if name in ("FullyShardedDataParallel", "FSDP"):
        from ..wrap.fsdp1 import FullyShardedDataParallel  # imported on use: `import fully_shard.compat` stays light

        return FullyShardedDataParallel
    ours: dict[str, object] = {
        "share_comm_ctx": share_comm_ctx, "fully_shard": fully_shard, "FSDPModule": FSDPModule,
        "UnshardHandle": UnshardHandle, "MixedPrecisionPolicy": MixedPrecisionPolicy, "OffloadPolicy": OffloadPolicy,
        "CPUOffloadPolicy": CPUOffloadPolicy, "register_fsdp_forward_method": register_fsdp_forward_method,
        "GradientReductionHandle": GradientReductionHandle}
    return ours[name]


# --- patch / unpatch -----------------------------------------------------------------------------
# patch_torch(fsdp1=True) also rebinds torch's FSDP1 class (FSDP1 code: accelerate's fsdp_version=1, verl's
# strategy=fsdp, Lightning's FSDPStrategy) to fully_shard.FullyShardedDataParallel (wrap/fsdp1/,
# design/fsdp1.md): where torch defines it and where torch's own modules bound it at their import. Its
# enums and configs stay torch's: the class reads torch's objects as its own.
FSDP1_TARGETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch.distributed.fsdp", ("FullyShardedDataParallel",)),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", ("FullyShardedDataParallel",)),
    ("torch.distributed.checkpoint.state_dict", ("FSDP",)),
    ("torch.distributed.optim.named_optimizer", ("FSDP",)),
    ("torch.distributed.algorithms._optimizer_overlap.optimizer_overlap", ("FullyShardedDataParallel",)),
)


def patch_torch(*, fsdp1: bool = False) -> list[str]:
    """Rebind torch's FSDP2 names (table in this module's docstring) to this library, and with ``fsdp1``
    its FSDP1 class too (``FSDP1_TARGETS``). Idempotent (a later call with ``fsdp1=True`` adds the FSDP1
    names); returns the ``module.name`` entries now bound to this library's objects."""
    with _LOCK:
        # Import every target first: a module imported while torch.distributed.fsdp is already
        # patched (pipelining, the legacy path) would bind our objects at its import, and those
        # would then be "restored" by unpatch_torch().
        modules = []
        for modname, names in TARGETS + (FSDP1_TARGETS if fsdp1 else ()):
            try:
                importlib.import_module(modname)
            except ImportError:  # an older torch without this module: nothing to rebind there
                continue
            modules.append((sys.modules[modname], modname, names))
        fresh = [(modname, name) for mod, modname, names in modules for name in names
                 if name in vars(mod) and (modname, name) not in _SAVED]
        for modname, name in fresh:
            _SAVED[(modname, name)] = vars(sys.modules[modname])[name]
        for modname, name in fresh:
            setattr(sys.modules[modname], name, _ours(name))
        FSDPModule._get_fsdp_state = _get_fsdp_state  # type: ignore[attr-defined]  # (torchtitan's torchft path)
        return patched_names()


def unpatch_torch() -> None:
    """Put back exactly the objects ``patch_torch()`` replaced. Idempotent."""
    with _LOCK:
        for (modname, name), original in _SAVED.items():
            setattr(sys.modules[modname], name, original)
        _SAVED.clear()
        if "_get_fsdp_state" in vars(FSDPModule):
            del FSDPModule._get_fsdp_state  # type: ignore[attr-defined]


def is_patched() -> bool:
    return bool(_SAVED)


def patched_names() -> list[str]:
    """``module.name`` of every torch name currently bound to this library (empty when unpatched)."""
    return [f"{modname}.{name}" for modname, name in _SAVED]


# --- what torch code reads of fully_shard.state(module) -----------------------------------------
@dataclasses.dataclass(frozen=True)
class MeshInfoView:
    """A unit's mesh with the attribute names of torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo``."""

    mesh: DeviceMesh
    shard_mesh_dim: int | None
    replicate_mesh_dim: int | None
    shard_process_group: Any
    shard_mesh_size: int
    shard_mesh_rank: int
    replicate_process_group: Any
    replicate_mesh_size: int
    replicate_mesh_rank: int

    @classmethod
    def of(cls, info: MeshInfo) -> MeshInfoView:
        hsdp = info.replicate_group is not None
        rep_rank = info.mesh.get_local_rank(0) if hsdp else 0
        ddp = hsdp and info.mesh.ndim == 1  # dp_mesh_dims replicate only: torch's DDPMeshInfo has no shard dim
        return cls(info.mesh, None if ddp else 1 if hsdp else 0, 0 if hsdp else None, info.shard_group,
                   info.shard_world, info.shard_rank, info.replicate_group, info.replicate_world, rep_rank)


class GroupView:
    """torch's ``FSDPParamGroup`` as torch's pipelining uses it: ``post_backward()`` and ``mesh_info``
    (one per group of the unit: several with per-parameter meshes)."""

    def __init__(self, state: FSDPState, group: ParamGroup) -> None:
        self._state = state
        self._group = group

    @property
    def mesh_info(self) -> MeshInfoView:
        return MeshInfoView.of(self._group.mesh_info)

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        return self._state.modules

    def post_backward(self) -> None:
        """Reduce-scatter (or, with sync off, keep accumulating) this group's unsharded gradients and
        reshard if ``reshard_after_backward``: what a post-backward hook does."""
        self._state.post_backward(only=self._group)

    @property
    def _all_reduce_hook(self) -> Callable[[Any], None] | None:
        """torchtitan's torchft path sets torch's private ``FSDPParamGroup._all_reduce_hook`` per group:
        this group's ``set_all_reduce_hook`` hook."""
        return self._group.reducer.settings.all_reduce_hook

    @_all_reduce_hook.setter
    def _all_reduce_hook(self, hook: Callable[[Any], None] | None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(f"_all_reduce_hook expects a callable hook(tensor) or None, got {type(hook).__name__}")
        self._group.reducer.settings.all_reduce_hook = hook


class StateView:
    """torch's ``FSDPState`` as torch code reads it (``fully_shard.state(module)``)."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    @property
    def _fsdp_param_group(self) -> GroupView | None:
        """The unit's one group; with several (per-parameter meshes) an AssertionError, as torch's."""
        groups = self._fsdp_param_groups
        if len(groups) > 1:
            raise AssertionError(f"this fully_shard unit has {len(groups)} parameter groups (per-parameter "
                                 "meshes); use _fsdp_param_groups")
        return groups[0] if groups else None

    @property
    def _fsdp_param_groups(self) -> list[GroupView]:
        return [GroupView(self._state, group) for group in self._state.groups]

    @property
    def _is_root(self) -> bool | None:
        return self._state.is_root if self._state.root is not None else None

    @property
    def _state_ctx(self) -> _StateContextView:
        return _StateContextView(self._state)

    def _root_post_backward_final_callback(self) -> None:
        """End of backward, run by hand (pipelining's REDUCE_GRAD): reduce what is left, reshard,
        finish the reductions (on the root's ``set_is_last_backward``)."""
        root = self._state.root
        if root is None:
            return
        owner = next((s for s in root.states if s.is_root), self._state)
        owner.root_final_callback()


def _get_fsdp_state(module: FSDPModule) -> StateView:
    """torch's private ``FSDPModule._get_fsdp_state()`` (torchtitan's torchft path reads the param groups
    through it): our unit's view, while patched."""
    return StateView(module._fsdp)


class _StateContextView:
    def __init__(self, state: FSDPState) -> None:
        self._state = state

    @property
    def all_states(self) -> list[StateView]:
        root = self._state.root
        return [StateView(s) for s in root.states] if root is not None else [StateView(self._state)]
