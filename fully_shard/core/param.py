"""ShardedParam: one parameter's sharded DTensor form and its reusable unsharded form.

See design/param-lifecycle.md. The sharded form is an ``nn.Parameter`` wrapping a DTensor whose local
tensor is this rank's unpadded ``torch.chunk`` shard (placement ``Shard(0)``; ``Replicate()`` for
0-dim parameters). The unsharded form is one ``nn.Parameter`` object kept for the module's lifetime;
its storage is allocated on unshard and freed (resized to 0) on reshard, so autograd's saved
references stay valid while the memory is returned between uses. A DTensor parameter on a TP/EP mesh
is sharded locally, on the combined mesh (spmd.py, design/2d-params.md); its unsharded form is that
TP DTensor again, wrapping the same reusable storage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from ..parallel import local_dtensor
from ..parallel.mesh import MeshInfo
from ..parallel.spmd import ParamSpec, local_grad, spec_of
from . import extension, grad_mode, registry
from .layout import DimZeroLayout, contiguous_stride


def dtype_name(dtype: torch.dtype) -> str:
    short = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
    return short.get(dtype, str(dtype).replace("torch.", ""))


class ShardedParam:
    """One managed parameter: owns its sharded DTensor and its unsharded storage."""

    def __init__(self, module: nn.Module, name: str, fqn: str, param: nn.Parameter, mesh_info: MeshInfo,
                 storage_device: torch.device, *, pin_memory: bool = False, offload: bool = False,
                 shard_dim: int = 0, param_dtype: torch.dtype | None = None) -> None:
        self.module = module
        self.name = name
        self.slots: list[tuple[nn.Module, str]] = [(module, name)]  # every (module, attr) holding it
        self.local_fqn = fqn  # relative to the module fully_shard was called on
        self.fqn = fqn  # relative to the root, once the root is known (lazy init)
        self.mesh_info = mesh_info
        self.storage_device = storage_device  # where the shard lives (CPU under offload)
        self.pin_memory = pin_memory
        # CPU offload: the shard and its grad live on the host; every unshard copies it to the device and
        # every reduce copies the grad back (even where both are the CPU: tests run that path on CPU)
        self.offload = offload
        # the unit policy's param_dtype for this parameter (param_dtype_override_fn applied once, at
        # fully_shard()); None: its own dtype
        self.param_dtype = param_dtype
        self.global_shape = tuple(param.shape)  # of the DTensor (the whole parameter)
        # Sharding along dim d uses the dim-0 layout of the tensor with d moved to the front.
        self.shard_dim = shard_dim if self.global_shape else 0
        # What FSDP shards and gathers: the parameter, or a TP DTensor's local tensor (spmd.py).
        self.spec: ParamSpec
        self.spec, data = spec_of(param, fqn, mesh_info, self.shard_dim)
        self.unsharded_shape = tuple(data.shape)
        moved = list(self.unsharded_shape)
        if moved:
            moved.insert(0, moved.pop(self.shard_dim))
        self.layout = DimZeroLayout(tuple(moved), mesh_info.shard_world)
        # this rank's shard in the communication layout, read on every unshard and reduce (the rank is fixed)
        rank = mesh_info.shard_rank
        self.local_numel = self.layout.local_numel(rank)
        self.local_shape = self.layout.local_shape(rank)
        self.local_stride = contiguous_stride(self.local_shape)
        self.padding_numel = self.layout.padding_numel(rank)  # (the copy-in pads with zeros shared by size)
        self.unsharded_param: nn.Parameter | None = None
        self._unsharded_padded: torch.Tensor | None = None  # owns the unsharded storage
        # same storage, own version counter; for a Shard(0) parameter shaped as its gathered rows
        # ``(world, padded shard)``, where the copy-out writes (one tensor object, not one more view)
        self._unsharded_write: torch.Tensor | None = None
        # the storage (one Python object, resized in place) and its allocated size: a group's GatherPlan
        # allocates it before each copy-out and frees it at reshard
        self.unsharded_storage: torch.UntypedStorage | None = None
        self.unsharded_nbytes = 0
        self.unsharded_accumulated_grad: torch.Tensor | None = None  # no-sync accumulation
        # an nn.Parameter wrapping a DTensor; its requires_grad is the one flag (``requires_grad``)
        self.sharded_param: DTensor = self._make_sharded(data, param.requires_grad)
        # A tensor subclass with fsdp_pre/post_all_gather builds its own unsharded form (extension.py)
        self.extension: extension.Extension | None = extension.detect(self)

    # --- sharded form -------------------------------------------------------------------------
    def _make_sharded(self, data: torch.Tensor, requires_grad: bool) -> DTensor:
        data = data.detach()
        if isinstance(data, DTensor):  # already on the FSDP mesh: re-shard its full value
            data = data.full_tensor()
        start, end = self.layout.row_range(self.mesh_info.shard_rank)
        if extension.has_hooks(data) and not self.layout.replicated and self.shard_dim == 0:
            local = extension.own_rows(data, self.mesh_info.shard_rank, self.layout.chunk_rows, start, end,
                                       self.storage_device)  # a subclass: the ops torch's fully_shard uses
        else:
            local = data if self.layout.replicated else self.unmoved(self.moved(data)[start:end])
            local = (local if local.is_meta else local.to(self.storage_device)).contiguous().clone()
        if self.pin_memory and local.device.type == "cpu" and torch.accelerator.is_available():
            local = local.pin_memory()  # CPU offload: pinned host memory for async H2D/D2H copies
        return self._wrap_local(local, requires_grad)

    def _wrap_local(self, local: torch.Tensor, requires_grad: bool) -> DTensor:
        placements = self.spec.replicated if self.layout.replicated else self.spec.sharded
        dtensor = self._dtensor(local, self.spec.mesh, placements)
        return nn.Parameter(dtensor, requires_grad=requires_grad)  # type: ignore[return-value]

    def _dtensor(self, local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
        """``local`` as this parameter's DTensor on ``mesh`` (its global shape, contiguous strides)."""
        return local_dtensor.wrap(local, mesh, placements, shape=torch.Size(self.global_shape),
                                  stride=contiguous_stride(self.global_shape))

    def moved(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (this parameter's shape) with the shard dim first: the communication layout."""
        return t.movedim(self.shard_dim, 0) if self.shard_dim else t

    def unmoved(self, t: torch.Tensor) -> torch.Tensor:
        return t.movedim(0, self.shard_dim) if self.shard_dim else t

    @property
    def requires_grad(self) -> bool:
        """The sharded parameter's own flag, read at every use: the user may freeze or unfreeze it
        (``requires_grad_``) between steps, as torch's FSDP2 allows (design/param-lifecycle.md)."""
        return self.sharded_param.requires_grad

    @property
    def orig_dtype(self) -> torch.dtype:
        return self.sharded_param.dtype

    @property
    def sharded_local(self) -> torch.Tensor:
        """This rank's unpadded shard (a plain tensor): the DTensor's local tensor itself (``to_local()``
        of a Parameter makes a new view per call)."""
        return local_dtensor.local_of(self.sharded_param)

    def adopt_module_param(self) -> None:
        """Re-read the sharded parameter if the module's slot now holds another DTensor Parameter
        (``module.to_empty()`` and ``module.to(dtype)`` swap or replace it)."""
        current = self.module._parameters.get(self.name)
        if isinstance(current, DTensor) and current is not self.sharded_param:
            self.sharded_param = current
        local = self.sharded_local
        unpinned = (self.pin_memory and local.device.type == "cpu" and torch.accelerator.is_available()
                    and not local.is_pinned())  # e.g. model.to(dtype) made new, pageable host shards
        if not local.is_meta and (local.device != self.storage_device or unpinned):
            # e.g. meta init + CPU offload: to_empty(device="cuda") put the shard on the device. Swap
            # in place so the Parameter object (which an optimizer may already hold) stays the same.
            host = local.detach().to(self.storage_device)
            if self.pin_memory and host.device.type == "cpu" and torch.accelerator.is_available():
                host = host.pin_memory()
            torch.utils.swap_tensors(self.sharded_param, self._wrap_local(host, self.sharded_param.requires_grad))

    def set_new_grad(self, local_grad: torch.Tensor) -> bool:
        """``set_sharded_grad`` plus ``run_post_accumulate_grad_hooks`` where both have nothing but the
        assignment to do: assign it and return True; else False, with nothing done. The caller has
        checked what does not change between steps (``reduce_plan.grad_views``: ``Shard(0)``, no offload,
        ``local_grad`` on the storage device); here: no grad yet, the parameter's dtype, no hooks."""
        sharded = self.sharded_param
        if (sharded.grad is not None or local_grad.dtype != sharded.dtype
                or getattr(sharded, "_post_accumulate_grad_hooks", None)):
            return False
        grad = local_dtensor.like(local_grad, sharded)  # the parameter's mesh and placements
        sharded.grad = grad
        registry.announce_grad(grad, sharded.placements, local_dtensor.local_of(grad))
        return True

    def set_sharded_grad(self, local_grad: torch.Tensor) -> bool:
        """Assign (or accumulate into) ``.grad`` of the sharded parameter as a DTensor. True when the
        grad was copied to the host asynchronously: the caller records an event after it and the end of
        backward synchronizes it before anything on the host reads it (``Reducer.finish``).

        ``local_grad`` is in the communication layout (shard dim first); it is moved back here. Under
        CPU offload the copy is asynchronous only where nothing on the host reads it before that sync
        (as torch): pinned memory, no accumulation into an existing grad, no post-accumulate hooks."""
        sharded = self.sharded_param
        if self.shard_dim:  # Shard(d > 0): as torch
            local_grad = self.unmoved(local_grad).contiguous()
        if local_grad.dtype != sharded.dtype:
            local_grad = local_grad.to(sharded.dtype)
        existing = sharded.grad
        accumulate = isinstance(existing, DTensor)
        asynchronous = False
        if self.offload or local_grad.device != self.storage_device:
            asynchronous = self.pin_memory and not accumulate and not self._post_accumulate_hooks()
            local_grad = local_grad.to(self.storage_device, non_blocking=asynchronous, copy=True)
        if not accumulate:
            grad = local_dtensor.like(local_grad, self.sharded_param)  # the parameter's mesh and placements
            self.sharded_param.grad = grad
            # e.g. the optimizer step's check, done where it is known
            registry.announce_grad(grad, self.sharded_param.placements, local_dtensor.local_of(grad))
        else:
            with grad_mode.no_grad():
                local_dtensor.local_of(existing).add_(local_grad)  # type: ignore[arg-type]
        return asynchronous

    def _post_accumulate_hooks(self) -> list[Any]:
        """The hooks registered with ``register_post_accumulate_grad_hook`` on the sharded parameter
        (torch keeps them in this attribute)."""
        return list((getattr(self.sharded_param, "_post_accumulate_grad_hooks", None) or {}).values())

    def run_post_accumulate_grad_hooks(self) -> None:
        """Call the hooks registered with ``register_post_accumulate_grad_hook`` on the sharded
        parameter: autograd never accumulates into it (it does into the unsharded one), so they run
        here, once its sharded ``.grad`` is assigned."""
        if getattr(self.sharded_param, "_post_accumulate_grad_hooks", None):  # (usually None: no list built)
            for hook in self._post_accumulate_hooks():
                hook(self.sharded_param)

    # --- unsharded form -----------------------------------------------------------------------
    def init_unsharded(self, dtype: torch.dtype, device: torch.device) -> None:
        """Create the unsharded Parameter object once (again at a new ``dtype``); its storage stays freed
        until the group's all-gather allocates it (``GatherPlan.copy_out``)."""
        if self.extension is not None:  # the post-hook creates it at the first unshard
            return
        if self._unsharded_padded is not None and self._unsharded_padded.dtype == dtype:
            return
        numel = self.layout.numel if self.shard_dim != 0 else self.layout.padded_numel
        padded = torch.empty(numel, dtype=dtype, device=device)
        if self.staged_gather and not self.layout.replicated:  # Shard(d > 0): contiguous, like torch
            view = padded.view(self.unsharded_shape)
        else:
            view = padded[:self.layout.numel].view(self.layout.shape)
        self._unsharded_padded = padded
        storage = padded.untyped_storage()
        # a new tensor on the same storage (not a view: no base kept, its own version counter), in the
        # shape the copy-out writes
        rows = (padded.shape if self.staged_gather
                else (self.layout.world, self.layout.padded_shard_numel))
        self._unsharded_write = padded.new_empty(0).set_(storage, 0, rows, contiguous_stride(tuple(rows)))
        self.unsharded_storage = storage
        self.unsharded_nbytes = storage.nbytes()
        self.unsharded_param = nn.Parameter(self._as_unsharded(view), requires_grad=self.requires_grad)
        storage.resize_(0)

    def _as_unsharded(self, view: torch.Tensor) -> torch.Tensor:
        """The tensor registered for forward: ``view`` itself, or for a TP parameter the TP DTensor whose
        local tensor is ``view`` (so freeing/reallocating ``view``'s storage is seen through it)."""
        if not self.spec.is_dtensor:
            return view
        assert self.spec.unsharded_mesh is not None and self.spec.unsharded is not None
        with torch.no_grad():
            return self._dtensor(view, self.spec.unsharded_mesh, self.spec.unsharded)

    @property
    def staged_gather(self) -> bool:
        """The gathered rows cannot be the unsharded storage itself: a replicated (0-dim) parameter
        (one slot per rank) or ``Shard(d > 0)`` (the rows are the shard dim; the unsharded parameter
        is kept contiguous in its own layout, as torch's). The copy-out goes through a staging buffer."""
        return self.layout.replicated or self.shard_dim != 0

    @property
    def unsharded_write(self) -> torch.Tensor:
        """The padded unsharded storage, written without bumping autograd versions: ``(world, padded
        shard)`` rows for a ``Shard(0)`` parameter, flat for a staged one (``staged_gather``)."""
        assert self._unsharded_write is not None, f"{self.fqn}: unsharded form used before init"
        return self._unsharded_write

    def unsharded_allocated(self) -> bool:
        if self.extension is not None:
            return self.extension.allocated()
        return self.unsharded_storage is not None and self.unsharded_storage.size() > 0

    # --- registration -------------------------------------------------------------------------
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Pop the gradient autograd accumulated on the unsharded parameter (plus no-sync sums); a TP
        DTensor gradient comes back as its local tensor in the parameter's TP placements."""
        unsharded = self.unsharded_param
        grad = None
        if unsharded is not None:
            grad = unsharded.grad
            unsharded.grad = None
        if grad is not None and type(grad) is not torch.Tensor:  # (a plain grad is its own local tensor)
            grad = local_grad(grad, self.spec)
        acc = self.unsharded_accumulated_grad
        self.unsharded_accumulated_grad = None
        if acc is None:
            return grad
        return acc if grad is None else acc.add_(grad)

    def stash_unsharded_grad(self, dtype: torch.dtype) -> None:
        """No-sync step: move the fresh unsharded gradient into a ``dtype`` accumulator."""
        grad = self.unsharded_param.grad if self.unsharded_param is not None else None
        if grad is None:
            return
        self.unsharded_param.grad = None  # type: ignore[union-attr]
        grad = local_grad(grad, self.spec)
        if self.unsharded_accumulated_grad is None:
            self.unsharded_accumulated_grad = grad.to(dtype, copy=grad.dtype == dtype)
        else:
            self.unsharded_accumulated_grad.add_(grad)

    def __repr__(self) -> str:
        return self.describe(self.fqn)

    def describe(self, fqn: str) -> str:
        """``blocks.0.up.weight f32[157@shard/2, 60] SHARDED`` (UNSHARDED: allocated and registered; a storage
        ``set_keep_unsharded_storage`` keeps after reshard is not in use)."""
        registered = self.unsharded_param is not None and self.module._parameters.get(self.name) is self.unsharded_param
        state = "UNSHARDED" if registered and self.unsharded_allocated() else "SHARDED"
        dims = [str(size) for size in self.global_shape]
        if self.layout.replicated:
            dims = ["@replicate"]
        else:
            dims[self.shard_dim] += f"@shard/{self.mesh_info.shard_world}"
        tp = ""
        if self.spec.is_dtensor:  # e.g. "blocks.0.up.weight f32[64@shard/2@tp/2, 32] SHARDED"
            mesh, placements = self.spec.unsharded_mesh, self.spec.unsharded
            assert mesh is not None and placements is not None
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            for i, (name, p) in enumerate(zip(names, placements)):
                d = getattr(p, "dim", None)
                if i not in self.spec.dp_dims and d is not None and not self.layout.replicated:
                    dims[d] += f"@{name}/{mesh.size(i)}"
            tp = f" {self.spec.describe()}"
        return f"{fqn} {dtype_name(self.orig_dtype)}[{', '.join(dims)}] {state}{tp}"
