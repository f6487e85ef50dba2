"""iter_full: the model's full weights as ``(name, tensor)`` pairs, gathered one unit at a time.

A collective over the model's ranks. Units (parameter groups) are taken in state_dict order of their
first entry; each is gathered once (unshard.py: one packed all-gather of its shards, cast to the wanted
dtype), cut into new tensors that are yielded as they are, and the gathered buffer is reused for the
next unit, so about one unit's gathered weights are held at once (design/weights.md "The memory
bound"). Entries outside every unit (buffers, ignored_params, parameters of modules no unit holds) are
yielded where the state_dict has them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..checkpoint.hf_keys import COPY, STACK, TRANSPOSE, KeyMap, RenameSpec
from . import gather, lora, naming, unshard
from .errors import WeightSyncError

__all__ = ["iter_full"]


def iter_full(model: nn.Module, *, dtype: torch.dtype | None = None, key_map: KeyMap | RenameSpec = None,
              rank: int | None = None, merge_lora: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(name, full tensor)`` for every parameter and persistent buffer of the unsharded model.

    Collective over the model's ranks: every rank must iterate to the end (or close the iterator) in
    step. Names are the plain module's ``state_dict()`` keys (no wrapper prefixes; a tied weight once,
    under its first name; non-persistent buffers not at all), through ``key_map`` when given (what
    ``checkpoint.save_hf``/``load_hf`` take: a ``KeyMap`` or a rename; fused tensors are cut back, stacked
    experts unstacked per expert). Each tensor is a new contiguous tensor (the caller may keep it) on the
    device the unit is gathered on, cast to ``dtype`` (default: its own dtype).

    One all-gather per parameter group (not per parameter), of its shards cast to ``dtype`` first; a
    group's parameters that are TP/EP DTensors take one more per mesh dim that shards them. Memory: at
    most about twice the largest group's gathered bytes beyond the model (design/weights.md).

    ``rank=r``: only global rank ``r`` gets tensors; the others run the same collectives and get
    ``(name, None)``. ``merge_lora=True`` (peft models): the LoRA adapters merged into the weights, named
    as ``merge_and_unload()`` names them; the trainer's weights are not changed.
    """
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise WeightSyncError(f"iter_full: rank must be a global rank (int >= 0) or None, found {rank!r}")
    if rank is not None and dist.is_available() and dist.is_initialized() and rank >= dist.get_world_size():
        raise WeightSyncError(f"iter_full: rank={rank} is not a rank of this job (world size "
                              f"{dist.get_world_size()}); fix: pass a global rank that holds the model")
    plan = naming.plan(model, key_map=key_map, dtype=dtype, merge_lora=merge_lora)
    return iterate(model, plan, rank=rank)


def iterate(model: nn.Module, plan: naming.Plan, *, rank: int | None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """``iter_full`` for a plan already made (the Sender's full send)."""
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    steps = _steps(plan, unshard.units_of(model))
    return _generate(plan, steps, keep=rank is None or rank == me)


@dataclass
class _Step:
    """One unit gathered with the entries it holds, or one entry outside every unit (``unit`` None)."""

    unit: unshard.Unit | None
    entries: list[naming.Entry] = field(default_factory=list)


def _steps(plan: naming.Plan, units: list[unshard.Unit]) -> list[_Step]:
    """The order of gathering: each unit at its first entry in state_dict order (decided from the model's
    structure alone, so the same on every rank)."""
    owner = {key: u for u in units for key in u.params}
    steps: list[_Step] = []
    by_unit: dict[int, _Step] = {}
    for e in plan.entries:
        unit = owner.get(id(e.tensor))
        if unit is None:
            if not e.hidden:
                steps.append(_Step(None, [e]))
            continue
        if id(unit) not in by_unit:
            by_unit[id(unit)] = _Step(unit)
            steps.append(by_unit[id(unit)])
        by_unit[id(unit)].entries.append(e)
    # a LoRA layer's adapter tensors must be at hand when its base weight is gathered
    for e in plan.entries:
        if e.lora is None:
            continue
        home = owner.get(id(e.tensor))
        for relative in e.lora.tensors:
            adapter = next(a for a in plan.entries if a.hidden and a.key.endswith("." + relative)
                           and a.key.startswith(e.key[: -len("base_layer.weight")]))
            where = owner.get(id(adapter.tensor))
            if where is not None and where is not home:
                raise WeightSyncError(
                    f"merge_lora=True: LoRA layer {e.lora.path!r}: adapter tensor {adapter.key!r} is in fully_shard "
                    f"unit {where.label!r}, its base weight in {home.label if home else 'no unit'!r}; both must be "
                    "at hand together; fix: shard the module holding the LoRA layer (e.g. the decoder layer) as one "
                    "unit")
    return steps


def _dtypes(plan: naming.Plan, entries: list[naming.Entry]) -> dict[int, torch.dtype]:
    out = {}
    for e in entries:
        wanted = [plan.outputs[i].dtype for i, _ in plan.links_of.get(e.name, [])]
        out[id(e.tensor)] = wanted[0] if wanted else e.tensor.dtype
    return out


def _generate(plan: naming.Plan, steps: list[_Step], *, keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    assembly = _Assembly(plan, keep)
    scratch = gather.Scratch()  # the gathered buffer, shared by the units (freed with the generator)
    for step in steps:
        if step.unit is None:
            (e,) = step.entries
            plain = e.tensor.detach()
            if isinstance(plain, DTensor):  # a DTensor no unit manages (e.g. TP only): gathered into a new tensor
                yield from assembly.add(e, gather.full_values([plain])[0], owned=True)
            else:
                yield from assembly.add(e, plain, owned=False)
            continue
        lora_ids = {id(e.tensor) for e in step.entries if e.lora is not None or e.hidden}
        values = unshard.unit_values(step.unit, _dtypes(plan, step.entries), full_precision=lora_ids,
                                     scratch=scratch, keep=keep)
        for e in step.entries:
            if e.hidden:
                continue
            value: torch.Tensor | None = values.pop(id(e.tensor), None)  # (the consumer decides how long it lives)
            if value is not None and e.lora is not None:
                value = lora.merge(e.lora, value, _adapters(e, step, values, plan))
            yield from assembly.add(e, value, owned=True)
            del value
        del values


def _adapters(e: naming.Entry, step: _Step, values: dict[int, torch.Tensor],
              plan: naming.Plan) -> dict[str, torch.Tensor]:
    """The full values of a LoRA layer's adapter tensors (relative names)."""
    assert e.lora is not None
    base = e.key[: -len("base_layer.weight")]
    out = {}
    for a in plan.entries:
        if a.hidden and a.key.startswith(base) and a.key[len(base):] in e.lora.tensors:
            value = values.get(id(a.tensor))
            if value is None:  # not sharded by fully_shard
                value = a.tensor.detach()
                if isinstance(value, DTensor):
                    value = gather.full_values([value])[0]
            out[a.key[len(base):]] = value
    return out


class _Assembly:
    """Turns entries' full values into the yielded tensors through their links. Every yielded tensor is a new
    contiguous tensor: an ``owned`` value (made for this iteration, referenced nowhere else) that is exactly
    one output is yielded as it is; anything else is copied (cast, cut, joined) into a new tensor."""

    def __init__(self, plan: naming.Plan, keep: bool) -> None:
        self.plan = plan
        self.keep = keep
        self.partial: dict[int, tuple[torch.Tensor | None, int]] = {}  # output -> (its buffer, links done)

    def add(self, e: naming.Entry, value: torch.Tensor | None, *,
            owned: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        links = self.plan.links_of.get(e.name, [])
        for i, link in links:
            out = self.plan.outputs[i]
            if not self.keep or value is None:
                done = self.partial.get(i, (None, 0))[1] + 1
                self.partial[i] = (None, done)
                if done == len(out.links):
                    del self.partial[i]
                    yield out.name, None
                continue
            if (owned and len(links) == 1 and len(out.links) == 1 and link.op == COPY
                    and tuple(value.shape) == out.shape and value.dtype == out.dtype and value.is_contiguous()):
                yield out.name, value  # (a single link of the whole tensor: its box is all of it)
                continue
            piece = value[link.model_box.slices()] if value.dim() else value
            if link.op == TRANSPOSE:
                piece = piece.t()
            elif link.op == STACK:
                piece = piece.squeeze(link.dim)
            if len(out.links) == 1:
                tensor = torch.empty(out.shape, dtype=out.dtype, device=value.device)
                tensor.copy_(piece.reshape(out.shape))
                yield out.name, tensor
                continue
            buffer, done = self.partial.get(i, (None, 0))
            if buffer is None:
                buffer = torch.empty(out.shape, dtype=out.dtype, device=value.device)
            buffer[link.hf_box.slices()] = piece
            if done + 1 == len(out.links):
                self.partial.pop(i, None)
                yield out.name, buffer
            else:
                self.partial[i] = (buffer, done + 1)
