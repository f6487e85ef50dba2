"""FSDP1's optimizer state dicts: ``optim_state_dict`` keyed by parameter FQN, ``optim_state_dict_to_load`` back to ids.

Under the model's state-dict type: FULL gives plain full tensors (gathered one at a time; CPU and rank 0
only as ``FullOptimStateDictConfig`` says), SHARDED gives DTensors laid out like their parameters (DCP
saves and loads them), LOCAL this rank's shards as plain tensors. ``optim_state_dict_to_load`` takes
ours or torch FSDP1's (same FQN keys; FSDP1 lists a group's parameters in flat-parameter order and gives
every parameter of a flat parameter the same ``step``: both are read by name, not position) and returns
what ``optim.load_state_dict`` takes, each state tensor cut to this rank's shard. The FQN bookkeeping is
checkpoint/state_dict.py's (one mechanism for both APIs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...checkpoint.state_dict import (
    broadcast_optimizer_state,
    get_optimizer_state_dict,
    torch_optimizer_state,
)
from ...checkpoint.views import describe, from_local_like, optimizer_params
from ...comm import collectives
from ...optim.originals import rebind_originals
from .options import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = ["full_optim_state_dict", "optim_state_dict", "optim_state_dict_to_load", "sharded_config"]


def sharded_config() -> ShardedOptimStateDictConfig:
    return ShardedOptimStateDictConfig()


def _check_given(optim: torch.optim.Optimizer, given: dict[str, Any] | None) -> None:
    """``optim_state_dict=`` must be ``optim.state_dict()`` (what torch's DCP passes): the state is read
    from ``optim`` itself, so another dict would be silently ignored."""
    if given is None:
        return
    groups = given.get("param_groups", [])
    ids = [i for g in groups for i in g.get("params", [])]
    mine = sum(len(g["params"]) for g in optim.param_groups)
    if len(groups) != len(optim.param_groups) or any(not isinstance(i, int) for i in ids) or len(ids) != mine:
        raise NotImplementedError(
            "FSDP.optim_state_dict(model, optim, optim_state_dict=...): only optim.state_dict() itself is accepted "
            f"(id-keyed, {len(optim.param_groups)} group(s), {mine} parameter(s)); the state is read from optim. "
            "Fix: pass optim_state_dict=None.")


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, given: dict[str, Any] | None,
                     settings: StateDictSettings) -> dict[str, Any]:
    """``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn]}]}`` (module docstring)."""
    rebind_originals(optim)
    _check_given(optim, given)
    config = settings.optim_state_dict_config
    cpu = bool(config.offload_to_cpu)
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT:
        rank0_only = isinstance(config, FullOptimStateDictConfig) and config.rank0_only
        return get_optimizer_state_dict(model, optim, full=True, cpu_offload=cpu, rank0_only=rank0_only)
    osd = get_optimizer_state_dict(model, optim, full=False, cpu_offload=cpu)
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        for values in osd["state"].values():
            for name, value in values.items():
                if isinstance(value, DTensor):
                    values[name] = value.to_local()
    return osd


def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, *, rank0_only: bool) -> dict[str, Any]:
    """FSDP1's legacy ``full_optim_state_dict``: full tensors on the CPU, rank 0 only by default."""
    settings = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                 FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only))
    return optim_state_dict(model, optim, None, settings)


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any],
                             settings: StateDictSettings, *, load_directly: bool = False) -> dict[str, Any]:
    """The id-keyed state dict ``optim.load_state_dict`` takes for the FQN-keyed ``osd`` (checked
    against the optimizer's parameters: a dict of another model raises naming the keys)."""
    rebind_originals(optim)
    config = settings.optim_state_dict_config
    if (settings.state_dict_type is StateDictType.FULL_STATE_DICT and isinstance(config, FullOptimStateDictConfig)
            and config.rank0_only):
        osd = broadcast_optimizer_state(osd)  # rank 0 holds it; the other ranks get it one tensor at a time
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        osd = _local_as_dtensors(model, optim, osd)
    osd = _sharded_tensors_gathered(osd)
    out = torch_optimizer_state(model, optim, osd, strict=True)
    if load_directly:
        optim.load_state_dict(out)
    return out


def _local_as_dtensors(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any]) -> dict[str, Any]:
    """LOCAL_STATE_DICT: each plain state tensor of the parameter's local shard shape as a DTensor."""
    params = {fqn: p for group in optimizer_params(model, optim) for fqn, p in group}
    state: dict[str, dict[str, Any]] = {}
    for fqn, values in osd.get("state", {}).items():
        p = params.get(fqn)
        out = dict(values)
        if isinstance(p, DTensor):
            local_shape = tuple(describe(fqn, p).local.shape)
            for name, value in values.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and name != "step" \
                        and tuple(value.shape) == local_shape:
                    out[name] = from_local_like(p, value.to(p.device), tuple(p.shape))
        state[fqn] = out
    return {**osd, "state": state}


def _is_sharded_tensor(value: Any) -> bool:
    """torch's legacy ``ShardedTensor`` (duck-typed: design/private-torch.md), as DCP's
    ``load_sharded_optimizer_state_dict`` gives the optimizer's state (Lightning's FSDP1 resume path)."""
    return callable(getattr(value, "local_shards", None)) and callable(getattr(value, "metadata", None))


def _sharded_tensors_gathered(osd: dict[str, Any]) -> dict[str, Any]:
    """Every ``ShardedTensor`` state value as the full tensor it shards (torch's FSDP1 gathers them too before
    cutting this rank's shard). Collective on the default group, in sorted (FQN, name) order on every rank."""
    state = osd.get("state", {})
    found = sorted((fqn, name) for fqn, values in state.items() if isinstance(values, dict)
                   for name, value in values.items() if _is_sharded_tensor(value))
    if not found:
        return osd
    out = {fqn: dict(values) if isinstance(values, dict) else values for fqn, values in state.items()}
    for fqn, name in found:
        out[fqn][name] = _full_of(state[fqn][name], where=f"optimizer state {fqn!r} {name!r}")
    return {**osd, "state": out}


def _full_of(sharded: Any, *, where: str) -> torch.Tensor:
    """The full tensor of one ``ShardedTensor``: every rank's local shards, flattened in metadata order and
    padded to one length, all-gathered; each shard then copied to its offsets (exact: no arithmetic)."""
    meta = sharded.metadata()
    world, me = dist.get_world_size(), dist.get_rank()
    ranks = [s.placement.rank() for s in meta.shards_metadata]
    if any(r >= world for r in ranks):
        raise ValueError(f"FSDP.optim_state_dict_to_load: {where} is a ShardedTensor placed on ranks {ranks}, "
                         f"expected ranks of the default group (world size {world}). Fix: load it with dp_pg=None.")
    local = {tuple(s.metadata.shard_offsets): s.tensor for s in sharded.local_shards()}
    numels = [sum(math.prod(s.shard_sizes) for s, r in zip(meta.shards_metadata, ranks) if r == rank)
              for rank in range(world)]
    dtype = meta.tensor_properties.dtype
    device = next(iter(local.values())).device if local else torch.device("cpu")
    mine = [local[tuple(s.shard_offsets)].reshape(-1) for s, r in zip(meta.shards_metadata, ranks) if r == me]
    buffer = torch.zeros(max(numels), dtype=dtype, device=device)
    if mine:
        torch.cat(mine, out=buffer[: numels[me]])
    out = torch.empty(world * buffer.numel(), dtype=dtype, device=device)
    group = dist.group.WORLD
    assert group is not None  # initialized: get_world_size above
    collectives.all_gather_into(out, buffer, group)
    gathered = out.view(world, -1)
    full = torch.empty(tuple(meta.size), dtype=dtype, device=device)
    offsets = [0] * world
    for s, r in zip(meta.shards_metadata, ranks):
        n = math.prod(s.shard_sizes)
        index = tuple(slice(o, o + k) for o, k in zip(s.shard_offsets, s.shard_sizes))
        full[index] = gathered[r][offsets[r]: offsets[r] + n].view(tuple(s.shard_sizes))
        offsets[r] += n
    return full
