"""The adapter to the library's unshard path: a model's units, and one unit's full values while gathered.

Everything this package knows of the core is here (design/weights.md). A unit (one ``ParamGroup``) is
gathered with the hooks' own entry points, ``ParamGroup.unshard`` + ``wait_for_unshard``, read, and
freed with ``reshard`` (``gather_unit``/``release_unit``: a rename in the core costs a line here). That
path moves ``param_dtype`` values, so it is used when they are the exact values wanted: no mixed
precision, or a requested dtype equal to ``param_dtype`` (the copy-in casts elementwise, so gathering
then casting equals casting then gathering). Otherwise (mixed precision to another dtype, int8
all-gathers, LoRA layers under mixed precision) the unit's shards are gathered by ``gather.py`` in the
wanted dtype, again one collective for the unit. A parameter that is a TP/EP DTensor once gathered is
made whole over its TP/EP mesh by ``gather.full_values`` (one more collective per unit and mesh dim).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core.group import ParamGroup
from ..core.param import ShardedParam
from ..core.state import states_under
from . import gather


@dataclass
class Unit:
    """One parameter group of a fully_shard unit: its sharded parameters, keyed by the sharded DTensor's id."""

    group: ParamGroup
    params: dict[int, ShardedParam]

    @property
    def label(self) -> str:
        return self.group.fqn or "<root>"


def units_of(model: nn.Module) -> list[Unit]:
    """Every parameter group under ``model`` in module order, lazily initialized and resharded (so each
    module slot holds its sharded DTensor, as ``state_dict`` shows it)."""
    found = list(states_under(model))
    for _, state in found:
        state.lazy_init()  # (no-op once a forward ran; the first state becomes the root of those below)
    out = []
    for _, state in found:
        for group in state.groups:
            release_unit(group)
            out.append(Unit(group, {id(p.sharded_param): p for p in group.params}))
    return out


def gather_unit(group: ParamGroup) -> None:
    """The library's unshard path: issue the unit's all-gather and register the gathered parameters."""
    group.unshard()
    group.wait_for_unshard()


def release_unit(group: ParamGroup) -> None:
    """Free the gathered parameters, registering the sharded DTensors again."""
    group.reshard()


def _exact(unit: Unit, dtypes: Mapping[int, torch.dtype], full_precision: Collection[int]) -> bool:
    """Whether the unshard path gives exactly the values wanted (see the module docstring)."""
    group = unit.group
    if getattr(group, "blocks", None) is not None:  # QuantizedAllGather: int8 on the wire
        return False
    gathered = group.param_dtype
    for key, p in unit.params.items():
        if p.extension is not None:
            return False
        if gathered != p.orig_dtype and (gathered != dtypes[key] or key in full_precision):
            return False
    return True


@contextlib.contextmanager
def unit_values(unit: Unit, dtypes: Mapping[int, torch.dtype], *,
                full_precision: Collection[int] = ()) -> Iterator[dict[int, torch.Tensor]]:
    """The full value of each of the unit's parameters (plain tensors, keyed like ``unit.params``) while
    the unit is gathered; freed on exit. A value may be a view of the gathered storage (copy what you
    keep) and is in ``dtypes[key]`` or, from the unshard path, in ``param_dtype`` (cast it to
    ``dtypes[key]``: exact). ``full_precision``: parameters needed in their own dtype (LoRA merges)."""
    group = unit.group
    if _exact(unit, dtypes, full_precision):
        gather_unit(group)
        try:
            values: dict[int, torch.Tensor] = {}
            spmd: list[tuple[int, DTensor]] = []
            for key, p in unit.params.items():
                value = p.unsharded_param
                assert value is not None, f"{p.fqn}: gathered without an unsharded parameter"
                if isinstance(value, DTensor):
                    spmd.append((key, value.detach()))  # type: ignore[arg-type]
                else:
                    values[key] = value.detach()
            for (key, _), full in zip(spmd, gather.full_values([v for _, v in spmd])):
                values[key] = full
            yield values
        finally:
            release_unit(group)
        return
    yield _gathered_shards(unit, dtypes, full_precision)


def _gathered_shards(unit: Unit, dtypes: Mapping[int, torch.dtype],
                     full_precision: Collection[int]) -> dict[int, torch.Tensor]:
    """The fallback: the unit's sharded values (cast to the wanted dtype first) gathered with one packed
    all-gather over the unit's shard group, then made whole over TP/EP meshes."""
    group = unit.group
    device = group.device
    values: dict[int, torch.Tensor] = {}
    chunked: list[tuple[int, gather.Chunked]] = []
    for key, p in unit.params.items():
        sharded = p.sharded_param
        if p.extension is not None:  # a tensor subclass: its own ops make it whole
            values[key] = sharded.full_tensor().to(dtypes[key])
            continue
        dtype = p.orig_dtype if key in full_precision else dtypes[key]
        local = sharded.to_local().detach().to(device=device, dtype=dtype)
        if p.layout.replicated:
            values[key] = local
        else:
            chunked.append((key, gather.Chunked(local, p.shard_dim, p.unsharded_shape[p.shard_dim])))
    fulls = gather.all_gather_chunks([c for _, c in chunked], group.mesh_info.shard_group)
    spmd: list[tuple[int, DTensor]] = []
    for (key, _), full in zip(chunked, fulls):
        values[key] = full
    for key, p in unit.params.items():
        spec = p.spec
        if spec.is_dtensor and key in values and p.extension is None:
            assert spec.unsharded_mesh is not None and spec.unsharded is not None
            v = values[key]
            spmd.append((key, DTensor.from_local(v, spec.unsharded_mesh, spec.unsharded, run_check=False,
                                                 shape=torch.Size(p.global_shape),
                                                 stride=torch.empty(p.global_shape, device="meta").stride())))
    for (key, _), full in zip(spmd, gather.full_values([v for _, v in spmd])):
        values[key] = full
    return values
