"""Materialize a meta-device model after fully_shard: allocate local shards only, initialize, verify.

The recipe (design/mixed-precision.md has the surrounding context)::

    with torch.device("meta"):
        model = build()                       # no memory
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)                        # shards are meta DTensors: still no memory
    materialize_meta_module(model, device=torch.device("cuda"))  # or "cpu"

``materialize_meta_module`` allocates every meta parameter and buffer on ``device`` like
``module.to_empty(device=...)`` (every rank allocates its own shards, never the full model) but leaves
already-real tensors alone and keeps each Parameter object (an optimizer may hold it), then initializes
each module that owns a formerly-meta parameter or buffer: ``init_fn(module)`` if given, else the
module's ``reset_parameters()``, else a known recipe for non-persistent buffers (transformers' rotary
embeddings: ``inv_freq`` is recomputed from the config). Anything left untouched is an error naming
its FQN — never uninitialized memory or NaNs.

Random initialization draws from a per-rank stream (forked; the caller's RNG is left as it was), so
the shards of one weight are not copies of each other, and every tensor that is *replicated* (a 0-dim
parameter, an HSDP shard's replicas, a plain buffer or ignored parameter) is then broadcast from the
first rank along its replicated mesh dimension(s) so all ranks agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..comm import collectives
from ..parallel.mesh import device_of, root_mesh
from .tree import join_fqn

__all__ = ["MaterializeReport", "broadcast_from_rank0", "default_init", "materialize_meta_module", "meta_tensor_names"]


@dataclass
class MaterializeReport:
    """What ``materialize_meta_module`` did: per-rank bytes allocated and how each module was set up."""

    local_bytes: int = 0  # bytes this rank allocated for formerly-meta tensors (its shards)
    global_bytes: int = 0  # bytes of the full (unsharded) tensors, for comparison
    initialized: dict[str, str] = field(default_factory=dict)  # module FQN -> "init_fn" | recipe name
    broadcast: list[str] = field(default_factory=list)  # replicated tensors synced from the first rank


def meta_tensor_names(module: nn.Module) -> list[str]:
    """FQNs of the parameters and buffers of ``module`` that are still on the meta device."""
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if p.is_meta]
    names += [n for n, b in module.named_buffers(remove_duplicate=False) if b.is_meta]
    return names


def materialize_meta_module(module: nn.Module, *, device: torch.device | str | None = None,
                            init_fn: Callable[[nn.Module], None] | None = None,
                            seed: int | None = None) -> MaterializeReport:
    """Allocate and initialize every meta parameter/buffer of ``module`` on ``device`` (default: the
    device of the mesh its sharded parameters live on, else the CPU).

    ``init_fn(m)`` is called once for each module ``m`` that directly owns a formerly-meta tensor
    (instead of ``m.reset_parameters()``); it must initialize all of ``m``'s own parameters and buffers
    (e.g. ``init_fn=hf_model._init_weights`` for a transformers model). ``seed`` seeds the per-rank
    initialization stream (default: ``torch.initial_seed()``), so runs are reproducible.
    Raises ``ValueError`` naming every tensor that nothing initialized.
    """
    device = torch.device(device) if device is not None else _default_device(module)
    report = MaterializeReport()
    owners = _meta_owners(module)
    if not owners:
        return report
    for mod in owners.values():
        _allocate(mod, device)
    versions = {}
    for mod_name, mod, _kind, name in _own_tensors(owners):
        t = _local(getattr(mod, name))
        with torch.no_grad():
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))  # loud if anything below forgets a tensor
        versions[(mod_name, name)] = _write_stamp(getattr(mod, name))
        report.local_bytes += t.numel() * t.element_size()
        report.global_bytes += getattr(mod, name).numel() * t.element_size()
    rank = dist.get_rank() if dist.is_initialized() else 0
    base = torch.initial_seed() if seed is None else seed
    devices = [device] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*DTensor random operators.*")
        torch.manual_seed((base * 1_000_003 + rank) % (2**63 - 1))
        for mod_name, mod in owners.items():
            report.initialized[mod_name] = _initialize(mod, init_fn)
    missing = []
    for mod_name, mod, kind, name in _own_tensors(owners):
        tensor = getattr(mod, name)
        fqn = join_fqn(mod_name, name)
        if tensor is None or tensor.is_meta:
            missing.append(f"{fqn} ({kind}, still meta)")
            continue
        before = versions[(mod_name, name)]
        if _write_stamp(tensor) == before:
            missing.append(f"{fqn} ({kind}, not written)")
    if missing:
        raise ValueError(
            "materialize_meta_module: these tensors were allocated but nothing initialized them (they "
            f"would hold garbage): {', '.join(missing)}. Fix: pass init_fn=... that sets every parameter "
            "and buffer of the module it is given, or give the owning module a reset_parameters() "
            "(non-persistent buffers such as rotary inv_freq need this too: they are not in any "
            "checkpoint).")
    report.broadcast = _sync_replicated(owners, _model_parallel_dims(module))
    return report


def _default_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        if isinstance(p, DTensor):
            return device_of(p.device_mesh)
    return torch.device("cpu")


def _meta_owners(module: nn.Module) -> dict[str, nn.Module]:
    """Modules that directly own a meta parameter or buffer, by FQN (each module once)."""
    owners: dict[str, nn.Module] = {}
    for name, mod in module.named_modules():
        own = list(mod._parameters.values()) + list(mod._buffers.values())
        if any(t is not None and t.is_meta for t in own):
            owners[name] = mod
    return owners


def _own_tensors(owners: dict[str, nn.Module]) -> list[tuple[str, nn.Module, str, str]]:
    """(module FQN, module, "param"|"buffer", name) for the tensors each owner holds directly; a tensor
    shared by several modules (tied weights) is listed once."""
    out, seen = [], set()
    for mod_name, mod in owners.items():
        for kind, table in (("param", mod._parameters), ("buffer", mod._buffers)):
            for name, t in table.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((mod_name, mod, kind, name))
    return out


def _allocate(mod: nn.Module, device: torch.device) -> None:
    """``to_empty`` for the meta tensors ``mod`` owns directly; parameters are swapped in place (the same
    object, which ShardedParam, tied modules and optimizers hold), buffers are replaced."""
    for p in list(mod._parameters.values()):
        if p is None or not p.is_meta:
            continue
        with torch.no_grad():
            empty = torch.empty_like(p, device=device)
        fresh = nn.Parameter(empty, requires_grad=p.requires_grad)
        for key, value in p.__dict__.items():  # user/library attributes survive the swap
            fresh.__dict__.setdefault(key, value)
        torch.utils.swap_tensors(p, fresh)  # meta -> device cannot go through .data
    for name, b in list(mod._buffers.items()):
        if b is not None and b.is_meta:
            mod._buffers[name] = torch.empty_like(b, device=device)


def default_init(module: nn.Module) -> str:
    """What ``materialize_meta_module`` does without ``init_fn``: ``module.reset_parameters()`` if
    it has one, and recomputing transformers-style rotary ``inv_freq`` buffers. Call it from your own
    ``init_fn`` for the modules you do not special-case. Returns the recipe used ("" if none applied).
    """
    recipe = ""
    with torch.no_grad():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
            recipe = "reset_parameters"
        if _is_hf_rotary(module):
            _reset_hf_rotary(module)
            recipe = "+".join(filter(None, [recipe, "rotary inv_freq"]))
    return recipe


def _initialize(mod: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> str:
    if init_fn is None:
        return default_init(mod) or "none"
    with torch.no_grad():
        init_fn(mod)
    return "init_fn"


def _is_hf_rotary(mod: nn.Module) -> bool:
    return "inv_freq" in mod._buffers and hasattr(mod, "config") and hasattr(mod, "rope_type")


def _reset_hf_rotary(mod: Any) -> None:
    """transformers' rotary embeddings compute ``inv_freq`` (non-persistent) from the config."""
    fn = None
    if mod.rope_type == "default":
        fn = getattr(mod, "compute_default_rope_parameters", None) or getattr(mod, "rope_init_fn", None)
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # type: ignore[import-not-found]

        fn = ROPE_INIT_FUNCTIONS[mod.rope_type]
    if fn is None:
        return
    inv_freq, scaling = fn(mod.config, mod.inv_freq.device)
    mod.inv_freq.copy_(inv_freq)
    if isinstance(getattr(mod, "original_inv_freq", None), torch.Tensor):
        mod.original_inv_freq.copy_(inv_freq)
    mod.attention_scaling = scaling


def _model_parallel_dims(module: nn.Module) -> dict[DeviceMesh, tuple[str, ...]]:
    """Per root mesh, the named dims some DTensor parameter of ``module`` lives on (FSDP's and TP's):
    a parameter on a sub-mesh that lacks one of them (a LayerNorm weight sharded over 'dp' only) is
    replicated across it, implicitly, and must agree there too. Dims no parameter uses (pipeline
    stages) are left alone."""
    dims: dict[DeviceMesh, list[str]] = {}
    for p in module.parameters():
        if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names:
            names = dims.setdefault(root_mesh(p.device_mesh), [])
            names += [n for n in p.device_mesh.mesh_dim_names if n not in names]
    return {root: tuple(names) for root, names in dims.items()}


def _sync_replicated(owners: dict[str, nn.Module], parallel_dims: dict[DeviceMesh, tuple[str, ...]]) -> list[str]:
    """Broadcast every replicated tensor (or replicated mesh dimension) from its first rank; a DTensor
    also over the model-parallel dims of its root mesh that its own mesh lacks (``_model_parallel_dims``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    synced = []
    for mod_name, mod, _kind, name in _own_tensors(owners):
        tensor = getattr(mod, name)
        fqn = join_fqn(mod_name, name)
        with torch.no_grad():
            if isinstance(tensor, DTensor):
                mesh = tensor.device_mesh
                groups = [mesh.get_group(d) for d, p in enumerate(tensor.placements)
                          if p.is_replicate() and mesh.size(d) > 1]
                root = root_mesh(mesh)
                groups += [root[n].get_group() for n in parallel_dims.get(root, ())
                           if n not in (mesh.mesh_dim_names or ()) and root[n].size() > 1]
                local = tensor.to_local()
                for group in groups:
                    collectives.broadcast(local, dist.get_global_rank(group, 0), group)
                if groups:
                    synced.append(fqn)
            else:
                broadcast_from_rank0(tensor)
                synced.append(fqn)
    return synced


def broadcast_from_rank0(tensor: torch.Tensor, what: str = "materialize_meta_module") -> None:
    """Broadcast a plain tensor from global rank 0, staging a CPU tensor on the accelerator for a
    backend without CPU support (NCCL). ``what`` names the caller in the error."""
    backend = str(dist.get_backend()).lower()
    if tensor.device.type == "cpu" and "gloo" not in backend:
        acc = torch.accelerator.current_accelerator()
        if acc is None:
            raise RuntimeError(
                f"{what} broadcasts replicated (non-DTensor) tensors from rank 0, but the "
                f"backend {backend!r} has no CPU support and no accelerator is present to stage them on. Fix: "
                "initialize the process group with a backend that supports CPU tensors, e.g. "
                "dist.init_process_group('gloo') or 'cpu:gloo,cuda:nccl'.")
        staged = tensor.to(acc)
        collectives.broadcast(staged, 0)
        tensor.copy_(staged.cpu())
    else:
        collectives.broadcast(tensor, 0)


def _write_stamp(t: torch.Tensor) -> tuple[int, int, int]:
    """Changes when ``t`` is replaced or written in place: an in-place op on a DTensor bumps the
    wrapper's version counter, a write through ``to_local()`` the local tensor's."""
    return (id(t), t._version, _local(t)._version)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
