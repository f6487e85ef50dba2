"""The adapter to the library's units: a model's parameter groups, and one group's full values in the wanted dtypes.

Everything this package knows of the core is here (design/weights.md). ``units_of`` finds the groups
(lazily initialized, resharded, so each module slot holds its sharded DTensor as ``state_dict`` shows
it). ``unit_values`` gathers one group's shards with one packed all-gather over the group's shard group
(``gather.all_gather_chunks``), each shard cast to the wanted dtype as it is written into the buffer
(casting commutes with gathering, so the values are exact, and a bf16 export of fp32 weights moves half
the bytes); the full tensors are cut out of the gathered buffer straight into new tensors, which the
caller may hand out as they are. Not the hooks' unshard path (``ParamGroup.unshard``): that one writes
into the module's own unsharded parameters, freed at reshard, so every value would be copied once more,
and it moves ``param_dtype`` (int8 for ``QuantizedAllGather``). A parameter that is a TP/EP DTensor once
gathered is made whole over its TP/EP mesh by ``gather.full_values`` (one more collective per unit and
mesh dim); a tensor-subclass parameter (``fsdp_pre_all_gather``) by its own ``full_tensor()``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
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
            group.reshard()
            out.append(Unit(group, {id(p.sharded_param): p for p in group.params}))
    return out


def wire_dtype(have: torch.dtype, want: torch.dtype) -> torch.dtype:
    """The dtype to gather in for a value held in ``have`` and wanted in ``want``: the narrower one (the cast
    is elementwise, so before or after the gather gives the same values)."""
    return want if want.itemsize <= have.itemsize else have


def unit_values(unit: Unit, dtypes: Mapping[int, torch.dtype], *, full_precision: Collection[int] = (),
                scratch: gather.Scratch | None = None, keep: bool = True) -> dict[int, torch.Tensor]:
    """The full value of each of the unit's parameters (new plain tensors the caller owns, keyed like
    ``unit.params``) in ``dtypes[key]``, or its own dtype for ``full_precision`` keys (LoRA merges): one
    packed all-gather over the unit's shard group, plus one per TP/EP mesh dim. ``keep=False``: the same
    collectives, no values (a rank that receives nothing; returns ``{}``). ``scratch``: the gathered
    buffer, shared by the units of one iteration."""
    group = unit.group
    device = group.device
    values: dict[int, torch.Tensor] = {}
    want: dict[int, torch.dtype] = {}
    chunked: list[tuple[int, gather.Chunked]] = []
    spmd = []  # (key, spec) of parameters whose gathered value is a DTensor on a TP/EP mesh
    for key, p in unit.params.items():
        sharded = p.sharded_param
        want[key] = p.orig_dtype if key in full_precision else dtypes[key]
        if p.extension is not None:  # a tensor subclass: its own ops make it whole
            full = sharded.full_tensor()
            if keep:
                values[key] = full.to(want[key], copy=True)
            continue
        local = p.sharded_local.detach()
        wire = wire_dtype(local.dtype, want[key])
        if p.spec.is_dtensor:
            spmd.append((key, p.spec))
        if p.layout.replicated:
            if keep or p.spec.is_dtensor:
                values[key] = local.to(device=device, dtype=wire, copy=True)
        else:
            chunked.append((key, gather.Chunked(local, p.shard_dim, p.unsharded_shape[p.shard_dim], wire)))
    fulls = gather.all_gather_chunks([c for _, c in chunked], group.mesh_info.shard_group, device=device,
                                     scratch=scratch, keep=keep or bool(spmd))
    for (key, _), full in zip(chunked, fulls):
        values[key] = full
    if spmd:
        tp = []
        for key, spec in spmd:
            assert spec.unsharded_mesh is not None and spec.unsharded is not None
            p = unit.params[key]
            v = values.pop(key)
            tp.append(DTensor.from_local(v, spec.unsharded_mesh, spec.unsharded, run_check=False,
                                         shape=torch.Size(p.global_shape),
                                         stride=torch.empty(p.global_shape, device="meta").stride()))
        for (key, _), full in zip(spmd, gather.full_values(tp, scratch=scratch, keep=keep)):
            values[key] = full
    if not keep:
        return {}
    for key, v in values.items():
        if v.dtype != want[key]:  # gathered in the narrower dtype (an up-cast asked for)
            values[key] = v.to(want[key])
    return values
