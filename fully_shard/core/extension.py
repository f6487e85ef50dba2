"""The tensor-subclass all-gather extension: ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``.

See design/tensor-subclass-extension.md. A managed parameter whose local tensor defines both hooks is
gathered through them, with torch 2.13's contract:

- ``fsdp_pre_all_gather(mesh)`` or ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module,
  mp_policy)`` (told apart by ``inspect.signature``) returns ``(inputs, metadata)``: any number of
  tensors of any dtypes, each gathered along dim 0 in the unit's one all-gather (packed as bytes
  when the dtypes of the unit differ);
- ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)`` gets each gathered input
  (shape ``(world * rows, *rest)``). The first call returns ``(unsharded, inner_tensors)`` and its
  result becomes the unsharded parameter, kept for the module's lifetime; every later call gets
  ``out=`` that parameter and updates it in place;
- reshard frees the gathered outputs and the inner tensors by resizing their storage to 0; unshard
  resizes them back before the copy-out.

Unlike torch, the layout rule (an unevenly sharded parameter's inputs have the padded shard shape,
and every rank gathers the same shapes and dtypes) is checked at each unit's first unshard (which
every rank reaches in the same order) on every rank from every rank's answer (one small control
collective per unit), so a bad subclass raises the same error on every rank instead of an error on
some and a hang on the others.
"""

from __future__ import annotations

import enum
import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .layout import contiguous_stride

if TYPE_CHECKING:
    from ..parallel.mesh import MeshInfo
    from .layout import DimZeroLayout
    from .policy import MixedPrecisionPolicy


class ExtendedParam(Protocol):
    """What an ``Extension`` reads of its parameter (a ``ShardedParam``, param.py, which owns it), and
    the one attribute it writes: the unsharded parameter built by the first post-hook."""

    unsharded_param: nn.Parameter | None

    @property
    def fqn(self) -> str: ...
    @property
    def layout(self) -> DimZeroLayout: ...
    @property
    def shard_dim(self) -> int: ...
    @property
    def global_shape(self) -> tuple[int, ...]: ...
    @property
    def mesh_info(self) -> MeshInfo: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def sharded_param(self) -> torch.Tensor: ...
    @property
    def requires_grad(self) -> bool: ...


PRE_HOOK = "fsdp_pre_all_gather"
POST_HOOK = "fsdp_post_all_gather"


class PreHookForm(enum.Enum):
    """Which of torch's two ``fsdp_pre_all_gather`` signatures a subclass defines."""

    MESH = 1  # fsdp_pre_all_gather(mesh): the original form, kept by torch for compatibility
    FULL = 5  # fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)


@dataclass(frozen=True)
class InputSpec:
    """One all-gather input of one rank: its shape and dtype (every rank must give the same)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')}{list(self.shape)}"


def has_hooks(local: torch.Tensor) -> bool:
    return hasattr(local, PRE_HOOK) or hasattr(local, POST_HOOK)


def own_rows(data: torch.Tensor, rank: int, chunk_rows: int, start: int, end: int,
             device: torch.device) -> torch.Tensor:
    """This rank's rows ``[start, end)`` of a subclass tensor, in storage of its own on ``device``,
    through the ops torch's fully_shard calls on it: ``torch.split`` (``torch.chunk``'s rows, the same as
    the plain slice) and ``new_zeros`` + ``copy_``. Subclasses such as torchao's NF4 implement
    ``aten.split`` but only a whole-tensor ``aten.slice``, and re-quantize in ``clone``."""
    chunks = torch.split(data, chunk_rows, dim=0) if chunk_rows else ()
    rows = chunks[rank] if rank < len(chunks) else data[start:end]
    if rows.is_meta:
        return rows
    rows = rows.to(device)
    owned = rows.new_zeros(rows.shape)
    owned.copy_(rows)
    return owned


def detect(param: ExtendedParam) -> Extension | None:
    """The extension of ``param`` if its local tensor defines the hooks (both, or a clear error)."""
    local = param.sharded_param._local_tensor  # type: ignore[attr-defined]  # DTensor's local, no copy
    if not has_hooks(local):
        return None
    name = type(local).__name__
    if not (hasattr(local, PRE_HOOK) and hasattr(local, POST_HOOK)):
        missing = POST_HOOK if hasattr(local, PRE_HOOK) else PRE_HOOK
        raise TypeError(f"{param.fqn}: {name} defines one all-gather hook but not {missing}. Fix: define both "
                        f"{PRE_HOOK} and {POST_HOOK} (torch 2.13's extension contract), or neither.")
    n = len(inspect.signature(getattr(local, PRE_HOOK)).parameters)
    forms = {f.value: f for f in PreHookForm}
    if n not in forms:
        raise TypeError(
            f"{param.fqn}: {name}.{PRE_HOOK}{inspect.signature(getattr(local, PRE_HOOK))} takes {n} arguments; "
            f"expected 1 (mesh) or 5 (mesh, outer_size, outer_stride, module, mp_policy). Fix: use one of "
            "torch 2.13's two signatures.")
    if param.layout.replicated or param.shard_dim != 0:
        raise NotImplementedError(
            f"{param.fqn}: the {name} all-gather extension needs a parameter of at least 1 dim sharded on dim 0; "
            f"found shape {list(param.global_shape)} sharded on dim {param.shard_dim}. Fix: shard it on dim 0.")
    return Extension(param, forms[n])


def _shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh the all-gather runs over (the shard axis of an HSDP mesh), as torch passes it."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    return mesh[names[-1]] if names else mesh


class Extension:
    """One parameter's extension state: the hooks, its input layout, the gathered outputs it keeps and
    the inner tensors of its unsharded form (both freed by storage resize between unshards)."""

    def __init__(self, param: ExtendedParam, form: PreHookForm) -> None:
        self.param = param
        self.form = form
        self.specs: tuple[InputSpec, ...] | None = None  # fixed at the first unshard (every rank agreed)
        self.outputs: list[torch.Tensor] = []  # 1-D, world * input numel each; storage freed when resharded
        self.inner: tuple[torch.Tensor, ...] = ()  # the post-hook's unsharded inner tensors
        self.metadata: Any = None
        self.world = param.mesh_info.shard_world

    @property
    def type_name(self) -> str:
        return type(self.param.sharded_param._local_tensor).__name__  # type: ignore[attr-defined]

    @property
    def padded_shard_shape(self) -> tuple[int, ...]:
        return (self.param.layout.chunk_rows, *self.param.global_shape[1:])

    # --- pre-hook --------------------------------------------------------------------------------------
    def pre_all_gather(self, mp_policy: MixedPrecisionPolicy, device: torch.device) -> list[torch.Tensor]:
        """Call the pre-hook on this rank's shard (moved to ``device`` under CPU offload); keep the
        metadata for the post-hook and return the inputs."""
        local = self.param.sharded_param._local_tensor  # type: ignore[attr-defined]
        if local.device != device:
            local = local.to(device, non_blocking=True)
        mesh = _shard_mesh(self.param.mesh_info.mesh)
        hook = getattr(local, PRE_HOOK)
        if self.form is PreHookForm.MESH:
            result = hook(mesh)
        else:
            size = torch.Size(self.param.global_shape)
            result = hook(mesh, size, contiguous_stride(size), self.param.module, mp_policy)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"{self.param.fqn}: {self.type_name}.{PRE_HOOK} returned {type(result).__name__}; "
                            "expected a tuple (inputs, metadata). Fix: return (tuple_of_tensors, metadata).")
        inputs, self.metadata = result
        return list(inputs)

    def answer(self, inputs: list[torch.Tensor] | str) -> tuple[Any, ...]:
        """This rank's answer for the every-rank layout check at the first unshard: the input specs the
        pre-hook gave (or the error it raised), small enough to exchange with one control collective."""
        specs = inputs if isinstance(inputs, str) else tuple(InputSpec(tuple(t.shape), t.dtype) for t in inputs)
        return (self.param.fqn, self.param.layout.local_rows(self.param.mesh_info.shard_rank), specs)

    def layout_error(self, answers: list[tuple[Any, ...]]) -> str | None:
        """The verdict every rank computes from every rank's ``probe`` answer (``answers[r]``)."""
        fqn = self.param.fqn
        padded = self.padded_shard_shape
        where = (f"{fqn} ({self.type_name}, global shape {list(self.param.global_shape)}, sharded over "
                 f"{self.world} ranks, padded shard {list(padded)})")
        for rank, (_, rows, specs) in enumerate(answers):
            if isinstance(specs, str):
                return f"{where}: {PRE_HOOK} raised on rank {rank}: {specs}"
            if rows != padded[0] and any(s.shape != padded for s in specs):
                return (f"{where}: on rank {rank} (a shard of {rows} rows, fewer than the padded {padded[0]}) "
                        f"{PRE_HOOK} returned inputs {[str(s) for s in specs]}; an unevenly sharded parameter's "
                        f"all-gather inputs must each have the padded shard shape {list(padded)} (torch 2.13's "
                        "rule). Fix: pad the inputs to that shape in the 5-argument pre-hook (from outer_size "
                        "and mesh.size()), or make dim 0 divisible by the shard world size.")
        first = answers[0][2]
        if any(a[2] != first for a in answers):
            found = "; ".join(f"rank {r}: {[str(s) for s in a[2]]}" for r, a in enumerate(answers))
            return (f"{where}: {PRE_HOOK} returned different input shapes or dtypes on different ranks ({found}); "
                    "one all-gather needs equal inputs on every rank. Fix: return inputs of the same shapes and "
                    "dtypes on every rank (pad a shorter shard to the padded shard shape).")
        return None

    def check_inputs(self, inputs: list[torch.Tensor]) -> None:
        """Each unshard: the pre-hook still returns the layout every rank agreed on at the first unshard."""
        found = tuple(InputSpec(tuple(t.shape), t.dtype) for t in inputs)
        if found != self.specs:
            raise RuntimeError(
                f"{self.param.fqn}: {self.type_name}.{PRE_HOOK} returned {[str(s) for s in found]}, but at the "
                f"first unshard it returned {[str(s) for s in self.specs or ()]}; the all-gather layout is fixed "
                "then. Fix: return the same shapes and dtypes on every call.")

    # --- gathered outputs and the unsharded form ---------------------------------------------------------
    def init_outputs(self, device: torch.device) -> None:
        assert self.specs is not None
        self.outputs = [torch.empty(self.world * s.numel, dtype=s.dtype, device=device) for s in self.specs]

    def output_rows(self, as_bytes: bool) -> list[torch.Tensor]:
        """``(world, input numel)`` views of the gathered outputs (``uint8`` when packed as bytes) to
        copy out into; through ``.data``, so the copy bumps no version counter autograd may have saved."""
        rows = [t.data.view(self.world, -1) for t in self.outputs]
        return [r.view(torch.uint8) for r in rows] if as_bytes else rows

    def post_all_gather(self, param_dtype: torch.dtype) -> None:
        """Build the unsharded parameter from the gathered outputs (first unshard), or update it in
        place with ``out=`` (every later one)."""
        assert self.specs is not None
        local = self.param.sharded_param._local_tensor  # type: ignore[attr-defined]
        outputs = tuple(t.view(-1, *s.shape[1:]) for t, s in zip(self.outputs, self.specs))
        hook = getattr(local, POST_HOOK)
        if self.param.unsharded_param is not None:
            hook(outputs, self.metadata, param_dtype, out=self.param.unsharded_param)
            self.metadata = None
            return
        result = hook(outputs, self.metadata, param_dtype)
        self.metadata = None
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
            raise TypeError(f"{self.param.fqn}: {self.type_name}.{POST_HOOK} without out= returned "
                            f"{type(result).__name__}; expected (unsharded_tensor, inner_tensors).")
        unsharded, self.inner = result[0], tuple(result[1])
        size = torch.Size(self.param.global_shape)
        if unsharded.shape != size or not unsharded.is_contiguous():
            unsharded = torch.as_strided(unsharded, size, contiguous_stride(size), storage_offset=0)
        self.param.unsharded_param = nn.Parameter(unsharded, requires_grad=self.param.requires_grad)

    def alloc(self) -> None:
        for t in (*self.outputs, *self.inner):
            storage = t.untyped_storage()
            nbytes = (int(t.storage_offset()) + t.numel()) * t.element_size()
            if storage.size() < nbytes:
                storage.resize_(nbytes)

    def free(self) -> None:
        for t in (*self.outputs, *self.inner):
            t.untyped_storage().resize_(0)

    def allocated(self) -> bool:
        return bool(self.outputs) and self.outputs[0].untyped_storage().size() > 0
