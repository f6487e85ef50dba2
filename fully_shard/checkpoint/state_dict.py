"""Model and optimizer state dicts keyed by parameter FQN: sharded (DTensor) and full forms, get and set.

The sharded form is what the model and optimizer hold (DTensors sharded along dim 0, plain tensors for
buffers and unmanaged parameters) and costs no communication. The full form gathers one tensor at a
time (bounded memory), optionally to CPU and optionally kept on rank 0 only. Optimizer state is keyed by
the parameter's FQN instead of torch's integer ids, so it survives re-wrapping and re-sharding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..parallel import local_dtensor
from .codec import ST_TO_TORCH, Encoder, decode, st_dtype
from .control import Control
from .errors import CheckpointError, Signature, check_structure
from .views import View, describe, ensure_sharded, group_hyper, optimizer_params, shard_like, state_is_sharded

OptimStateDict = dict[str, Any]  # {"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn]}]}


def gather_full(value: torch.Tensor, *, cpu_offload: bool = False) -> torch.Tensor:
    """``value`` as a plain full tensor (a DTensor is gathered: collective over its mesh), a copy where
    the gather would alias the live shard; on the CPU with ``cpu_offload``."""
    out = value.full_tensor() if isinstance(value, DTensor) else value.detach()
    if isinstance(value, DTensor) and out.numel() and out.data_ptr() == value.to_local().data_ptr():
        out = out.clone()  # a one-rank shard group (NO_SHARD) gathers to the live shard: snapshot it
    return out.cpu() if cpu_offload else out


def offload_to_cpu(value: torch.Tensor) -> torch.Tensor:
    """``value`` with its local tensor on the CPU (a DTensor stays a DTensor, laid out as before)."""
    if isinstance(value, DTensor):
        return local_dtensor.wrap(value.to_local().cpu(), value.device_mesh, tuple(value.placements),
                                  shape=value.shape, stride=value.stride())
    return value.detach().cpu()


def get_model_state_dict(model: nn.Module, *, full: bool = False, cpu_offload: bool = False,
                         rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict keyed by FQN.

    ``full=False`` (sharded): DTensors as held, no communication. ``full=True``: plain full tensors,
    gathered one at a time (collective: call on every rank); ``rank0_only`` leaves other ranks an empty
    dict; ``cpu_offload`` moves each tensor to CPU as soon as it is gathered.
    """
    if rank0_only and not full:
        raise ValueError("rank0_only=True needs full=True (a sharded state dict lives on every rank)")
    keep = not rank0_only or Control().rank == 0
    ensure_sharded(model)
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for fqn, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in done:
            if full:
                done[id(tensor)] = gather_full(tensor, cpu_offload=cpu_offload)
            else:
                done[id(tensor)] = offload_to_cpu(tensor) if cpu_offload else tensor.detach()
        if keep:
            out[fqn] = done[id(tensor)]
    return out


def _signature(tensor: torch.Tensor) -> Signature:
    return str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape)


def _check_structure(control: Control, expected: dict[str, Signature], found: dict[str, Signature] | None, strict: bool,
                     what: str, check_dtype: bool) -> None:
    with control.phase(what):
        if found is None:
            return
        if not check_dtype:
            found = {k: (expected[k][0] if k in expected else v[0], v[1]) for k, v in found.items()}
        check_structure(expected, found, strict=strict, title=f"{what} does not match the model:",
                        fix="pass a state dict of this model (strict=False ignores missing/unexpected keys, "
                            "not shapes)")


def set_model_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], *, full: bool = False,
                         strict: bool = True) -> None:
    """Copy ``state_dict`` into the model in place.

    ``full=False``: each rank passes its sharded dict (DTensors like the model's, or plain full tensors).
    ``full=True``: rank 0's dict of full tensors is broadcast one tensor at a time and each rank keeps its
    rows (other ranks may pass ``{}``). Collective for ``full=True``. Shapes must match; dtypes are cast.
    """
    control = Control()
    ensure_sharded(model)
    targets = model.state_dict(keep_vars=True)
    expected = {k: _signature(v) for k, v in targets.items()}
    source_rank0 = full and control.world > 1
    found = None if source_rank0 and control.rank != 0 else {k: _signature(v) for k, v in state_dict.items()}
    _check_structure(control, expected, found, strict, "state dict", check_dtype=False)
    present = (control.broadcast_json(sorted(state_dict) if control.rank == 0 else None) if source_rank0
               else list(state_dict))
    present_set = set(present)
    copied: set[int] = set()
    with torch.no_grad():
        for fqn, target in targets.items():
            if fqn not in present_set or id(target) in copied:
                continue
            copied.add(id(target))
            view = describe(fqn, target)
            if source_rank0:
                buf = torch.empty(view.shape, dtype=target.dtype)
                if control.rank == 0:
                    buf.copy_(state_dict[fqn].detach())
                control.broadcast_tensor(buf)
                value: torch.Tensor = buf
            else:
                value = state_dict[fqn]
            _copy_into(view, value)


def _copy_into(view: View, value: torch.Tensor) -> None:
    if isinstance(value, DTensor):
        if isinstance(view.tensor, DTensor) and value.placements == view.tensor.placements \
                and value.device_mesh == view.tensor.device_mesh:
            view.local.copy_(value.to_local())
            return
        value = value.full_tensor()
    view.local.copy_(value[view.held.slices()])


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False,
                             cpu_offload: bool = False, rank0_only: bool = False) -> OptimStateDict:
    """``{"state": {fqn: {name: value}}, "param_groups": [{hyperparameters, "params": [fqn, ...]}]}``.

    Same modes as get_model_state_dict; state tensors are sharded like their parameter (DTensors) unless
    ``full=True`` gathers them.
    """
    if rank0_only and not full:
        raise ValueError("rank0_only=True needs full=True (a sharded state dict lives on every rank)")
    keep = not rank0_only or Control().rank == 0
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group, entries in zip(optimizer.param_groups, optimizer_params(model, optimizer)):
        groups.append({**group_hyper(group), "params": [fqn for fqn, _ in entries]})
        for fqn, p in entries:
            values = {}
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    value = gather_full(value, cpu_offload=cpu_offload) if full else (
                        offload_to_cpu(value) if cpu_offload else value)
                values[name] = value
            if values:
                state[fqn] = values
    return {"state": state, "param_groups": groups} if keep else {}


def _group_problem(saved: list[list[str]], current: list[list[str]]) -> str | None:
    if [set(g) for g in saved] == [set(g) for g in current]:
        return None
    lines = [f"optimizer has {len(current)} param group(s), the saved state has {len(saved)}:"]
    for i in range(max(len(saved), len(current))):
        s = set(saved[i]) if i < len(saved) else set()
        c = set(current[i]) if i < len(current) else set()
        if s != c:
            lines.append(f"    group {i}: missing in saved state {sorted(c - s)[:10]}, unexpected {sorted(s - c)[:10]}")
    return "\n".join(lines)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, osd: OptimStateDict,
                         strict: bool = True, saved_sharded: set[tuple[str, str]] | None = None,
                         copy: bool = True) -> None:
    """Load an FQN-keyed optimizer state dict (values: DTensors like the params, or plain full tensors).

    With ``copy`` the optimizer gets private copies (torch's load_state_dict would keep references, so
    two optimizers loaded from one dict would silently share and corrupt each other's moments).
    """
    optimizer.load_state_dict(torch_optimizer_state(model, optimizer, osd, strict, saved_sharded, copy))


def _state_problem(groups: list[list[tuple[str, torch.Tensor]]], optimizer: torch.optim.Optimizer,
                   osd: OptimStateDict) -> str | None:
    """Under strict: a parameter whose optimizer already has state must get the same state names."""
    saved = osd.get("state", {})
    for entries in groups:
        for fqn, p in entries:
            existing = sorted(optimizer.state.get(p, {}))
            if existing and saved and sorted(saved.get(fqn, {})) != existing:
                return (f"  {fqn}: the optimizer holds state {existing}, the saved state has "
                        f"{sorted(saved.get(fqn, {}))}")
    return None


def torch_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, osd: OptimStateDict,
                          strict: bool = True, saved_sharded: set[tuple[str, str]] | None = None,
                          copy: bool = True) -> dict[str, Any]:
    """The checked, id-keyed state dict that ``optimizer.load_state_dict`` takes for ``osd`` (no side effect)."""
    groups = optimizer_params(model, optimizer)
    current = [[fqn for fqn, _ in g] for g in groups]
    saved_groups = osd.get("param_groups", [])
    saved = [list(g.get("params", [])) for g in saved_groups]
    problem = _group_problem(saved, current)
    known = {fqn for g in current for fqn in g}
    unexpected = sorted(set(osd.get("state", {})) - known)
    if strict and (problem or unexpected):
        raise CheckpointError(
            "optimizer state does not match the optimizer's parameters (keyed by FQN):\n"
            f"  {problem or ''}{'' if not unexpected else f'  state for unknown parameters: {unexpected[:10]}'}\n"
            "  fix: build the optimizer with the same parameter groups as when saving, or load with strict=False")
    names_problem = _state_problem(groups, optimizer, osd) if strict else None
    if names_problem:
        raise CheckpointError(f"optimizer state names do not match the optimizer's:\n{names_problem}\n  fix: load "
                              "state saved from the same optimizer class, or load with strict=False")
    ids: dict[str, int] = {}
    new_groups = []
    for group, entries in zip(optimizer.param_groups, groups):
        names = {fqn for fqn, _ in entries}
        match = max(range(len(saved)), key=lambda j: len(names & set(saved[j])), default=None)
        source = saved_groups[match] if match is not None and names & set(saved[match]) else group
        for fqn, _ in entries:
            ids[fqn] = len(ids)
        new_groups.append({**group_hyper(source), "params": [ids[fqn] for fqn, _ in entries]})
    state: dict[int, dict[str, Any]] = {}
    for entries in groups:
        for fqn, p in entries:
            values = osd.get("state", {}).get(fqn)
            if not values:
                continue
            existing = optimizer.state.get(p, {})
            out: dict[str, Any] = {}
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    hint = None if saved_sharded is None else (fqn, name) in saved_sharded
                    if isinstance(value, DTensor):
                        same = isinstance(p, DTensor) and value.device_mesh == p.device_mesh \
                            and value.placements == p.placements
                        value = (value.detach().clone() if copy else value) if same else value.full_tensor()
                    elif state_is_sharded(p, name, tuple(value.shape), hint, existing.get(name)):
                        value = shard_like(p, value)  # type: ignore[arg-type]
                    elif copy:
                        value = value.detach().clone()
                out[name] = value
            state[ids[fqn]] = out
    return {"state": state, "param_groups": new_groups}


def broadcast_optimizer_state(state_dict: OptimStateDict) -> OptimStateDict:
    """Rank 0's FQN-keyed optimizer state dict of plain full tensors on every rank (broadcast one tensor at
    a time; other ranks' ``state_dict`` is ignored). Collective."""
    control = Control()
    if control.world == 1:
        return state_dict
    skeleton: Any = None
    encoder = Encoder("t/")
    with control.phase("set_optimizer_state_dict(full=True)"):
        if control.rank == 0:
            for fqn, values in state_dict.get("state", {}).items():
                for name, value in values.items():
                    if isinstance(value, DTensor):
                        raise CheckpointError(f"state[{fqn!r}][{name!r}] is a DTensor; full=True expects plain "
                                              "full tensors on rank 0; fix: pass full=False for sharded dicts")
            skeleton = encoder.encode({"state": state_dict.get("state", {}),
                                       "param_groups": state_dict.get("param_groups", [])}, "optimizer state")
            skeleton = {"tree": skeleton, "tensors": [[n, st_dtype(t.dtype, n), list(t.shape)]
                                                      for n, t in encoder.tensors.items()]}
    skeleton = control.broadcast_json(skeleton)
    received: dict[str, torch.Tensor] = {}
    for name, dtype, shape in skeleton["tensors"]:
        buf = encoder.tensors[name].contiguous().clone() if control.rank == 0 else \
            torch.empty(shape, dtype=ST_TO_TORCH[dtype])
        control.broadcast_tensor(buf)
        received[name] = buf
    out: OptimStateDict = decode(skeleton["tree"], received.__getitem__)
    return out


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: OptimStateDict, *,
                             full: bool = False, strict: bool = True) -> None:
    """Load an FQN-keyed optimizer state dict (see get_optimizer_state_dict).

    ``full=True``: rank 0's dict of full tensors is broadcast one tensor at a time and sharded like each
    parameter (other ranks may pass ``{}``); collective.
    """
    control = Control()
    if full:
        state_dict = broadcast_optimizer_state(state_dict)
    with control.phase("set_optimizer_state_dict"):
        load_optimizer_state(model, optimizer, state_dict, strict)
