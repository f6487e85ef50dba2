"""compat: opt-in ``patch_torch()`` makes code that imports torch's FSDP2 names run on this library.

Frameworks (torchtitan, torchtune, accelerate, Lightning) import ``fully_shard`` and friends from
``torch.distributed.fsdp`` themselves, so "change one import" cannot reach them. ``patch_torch()``
rebinds those names, in torch's own modules, to this library's objects; ``unpatch_torch()`` puts back
exactly what was there. Nothing happens on import: only an explicit call patches. This is the one
library file that touches torch's FSDP modules, and only to rebind names (see design/compat.md).

Call ``patch_torch()`` before the framework is imported: a module that already ran
``from torch.distributed.fsdp import fully_shard`` holds torch's object in its own namespace (the
torch modules in the table below that do so are rebound too).

Names touched (each only where torch 2.13 defines it; module -> names):

=====================================================  =============================================
``torch.distributed.fsdp``                              fully_shard, FSDPModule, UnshardHandle,
                                                        MixedPrecisionPolicy, OffloadPolicy,
                                                        CPUOffloadPolicy, register_fsdp_forward_method,
                                                        share_comm_ctx
``torch.distributed.fsdp._fully_shard`` (package)       the same eight
``torch.distributed._composable.fsdp``                  fully_shard, FSDPModule, MixedPrecisionPolicy,
                                                        OffloadPolicy, CPUOffloadPolicy,
                                                        register_fsdp_forward_method
``torch.distributed._composable.fsdp.fully_shard``      fully_shard, FSDPModule, UnshardHandle,
                                                        register_fsdp_forward_method
``torch.distributed.pipelining.stage``                  fully_shard, FSDPModule (bound at its import)
``torch.distributed.pipelining.schedules``              FSDPModule, UnshardHandle (bound at its import)
=====================================================  =============================================

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
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..core import api
from ..core.group import ParamGroup
from ..core.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from ..core.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..core.state import FSDPState, get_state
from ..parallel.mesh import MeshInfo

__all__ = ["GroupView", "MeshInfoView", "StateView", "fully_shard", "is_patched", "patch_torch", "patched_names",
           "unpatch_torch"]

_PUBLIC = ("fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy", "register_fsdp_forward_method", "share_comm_ctx")
TARGETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch.distributed.fsdp", _PUBLIC),
    ("torch.distributed.fsdp._fully_shard", _PUBLIC),
    ("torch.distributed._composable.fsdp", ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
                                            "CPUOffloadPolicy", "register_fsdp_forward_method")),
    ("torch.distributed._composable.fsdp.fully_shard", ("fully_shard", "FSDPModule", "UnshardHandle",
                                                        "register_fsdp_forward_method")),
    ("torch.distributed.pipelining.stage", ("fully_shard", "FSDPModule")),
    ("torch.distributed.pipelining.schedules", ("FSDPModule", "UnshardHandle")),
)

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
        "CPUOffloadPolicy": CPUOffloadPolicy, "register_fsdp_forward_method": register_fsdp_forward_method}
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
        return patched_names()


def unpatch_torch() -> None:
    """Put back exactly the objects ``patch_torch()`` replaced. Idempotent."""
    with _LOCK:
        for (modname, name), original in _SAVED.items():
            setattr(sys.modules[modname], name, original)
        _SAVED.clear()


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


class _StateContextView:
    def __init__(self, state: FSDPState) -> None:
        self._state = state

    @property
    def all_states(self) -> list[StateView]:
        root = self._state.root
        return [StateView(s) for s in root.states] if root is not None else [StateView(self._state)]
