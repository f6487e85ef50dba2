"""The cache behind the optimizer's local stand-in, and the bulk checks that prove it still holds.

See design/optimizer-step.md (Cache). optimizer.py builds a ``LocalGroup`` per param group the first
time it goes local (views of our shards, their state entries mirrored as local tensors); every step
``proven_local_grads`` / ``collect_local_grads``, ``LocalGroup.entries_unchanged`` and ``StateSnapshot``
re-validate it by identity, in bulk (``map`` over C getters), and ``check_entries`` / ``mirror``
repair what changed. The gradient proof (``prove_grad``) is how a gradient, once checked or made by
the library, is read in one lookup afterwards.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["TOKEN_ATTR", "LocalGroup", "LocalState", "Slot", "StateSnapshot", "check_entries", "grad_of", "is_",
           "collect_local_grads", "mirror", "prove_grad", "proven_local_grads", "same", "token_of"]

TOKEN_ATTR = "_fully_shard_view_token"  # an int: cheap to pickle and deepcopy, unlike the view itself
# On a DTensor gradient this module checked: (its parameter's placements object, its local tensor).
_GRAD_PROOF_ATTR = "_fully_shard_local_grad"
# State entries kept as plain tensors by the DTensor path (a scalar step count), passed through as is.
_SCALAR_KEYS = frozenset({"step"})


# --- the local stand-in, cached per optimizer and re-validated every step --------------------------
# The per-step checks read their columns in bulk (map over C getters): a Python loop per parameter
# would cost about as much as a plain step's own per-parameter work (design/optimizer-step.md, Cache).
is_, _is_not = operator.is_, operator.is_not
grad_of = operator.attrgetter("grad")
_proof_of_grad = operator.attrgetter(f"grad.{_GRAD_PROOF_ATTR}")
token_of = operator.attrgetter(TOKEN_ATTR)
_placements_of = operator.attrgetter("placements")
_shape_of, _dtype_of = operator.attrgetter("shape"), operator.attrgetter("dtype")
_first, _second = operator.itemgetter(0), operator.itemgetter(1)



@dataclass(eq=False, slots=True)
class Slot:
    """One of our parameters in a local group: its cached shard view and the state entry it mirrors."""

    param: torch.Tensor
    token: int
    local: torch.Tensor
    placements: tuple[Any, ...]
    entry: dict[str, Any] | None = None  # the real state entry whose local tensors local_state holds
    values: tuple[Any, ...] = ()  # its values then, compared by identity each step


@dataclass(eq=False)
class LocalGroup:
    params: list[torch.Tensor]  # the real group's list, and a copy of its contents
    contents: tuple[torch.Tensor, ...]
    keys: frozenset[str]
    local_params: list[torch.Tensor]  # handed to step(): ours replaced by their views
    slots: list[Slot]
    mirrored: bool = False  # every slot's entry was checked (then ``entries``, ``lengths`` and ``columns`` hold it)
    # step_lists: the state key per _init_group list (None: the group's lists are handed over via .grad)
    ready_keys: tuple[str | None, ...] | None = None
    ready_result: bool = False  # _init_group's return value for this group (has_complex / has_sparse_grad)
    ready_states: tuple[tuple[Any, ...], ...] | None = None  # local state tensors per list, while mirrored
    # the slots' columns, compared in bulk each step
    ours: tuple[torch.Tensor, ...] = field(init=False)
    tokens: tuple[int, ...] = field(init=False)
    views: tuple[torch.Tensor, ...] = field(init=False)
    placements: tuple[tuple[Any, ...], ...] = field(init=False)
    shapes: tuple[torch.Size, ...] = field(init=False)
    dtypes: tuple[torch.dtype, ...] = field(init=False)
    entries: tuple[dict[str, Any], ...] = ()
    lengths: tuple[int, ...] = ()
    columns: tuple[tuple[Callable[[dict[str, Any]], Any], tuple[Any, ...]], ...] = ()  # (getter, values) per key

    def __post_init__(self) -> None:
        self.ours = tuple(slot.param for slot in self.slots)
        self.tokens = tuple(slot.token for slot in self.slots)
        self.views = tuple(slot.local for slot in self.slots)
        self.placements = tuple(slot.placements for slot in self.slots)
        self.shapes = tuple(map(_shape_of, self.views))
        self.dtypes = tuple(map(_dtype_of, self.views))
        self.remember_entries(self.mirrored)

    def remember_entries(self, mirrored: bool) -> None:
        """After every slot's entry was checked (``mirrored``): keep them as columns to compare in bulk."""
        self.mirrored = mirrored
        if mirrored and self.keys:
            self.entries = tuple(slot.entry for slot in self.slots)  # type: ignore[misc]  # all set when mirrored
            self.lengths = tuple(map(len, self.entries))
            self.columns = tuple((operator.itemgetter(k), tuple(map(operator.itemgetter(k), self.entries)))
                                 for k in self.keys)

    def entries_unchanged(self) -> bool:
        """The remembered entries still hold the same keys and value objects (a user or a checkpoint
        loader may have replaced ``state[p]["exp_avg"]``). Valid while the plan's snapshot matches."""
        if not self.mirrored or tuple(map(len, self.entries)) != self.lengths:
            return False
        try:
            return all(all(map(is_, map(getter, self.entries), values)) for getter, values in self.columns)
        except KeyError:
            return False


@dataclass(eq=False, slots=True)
class StateSnapshot:
    """The real ``optimizer.state``'s keys and entries as the last pre-hook left them: when they are the
    same objects again, each cached slot's entry is still ``state[param]``, proven without a lookup per
    parameter (a DTensor key's ``__hash__`` is Python-level)."""

    state: dict[Any, dict[str, Any]]
    keys: tuple[Any, ...]
    entries: tuple[dict[str, Any], ...]

    @classmethod
    def of(cls, state: dict[Any, dict[str, Any]]) -> StateSnapshot:
        return cls(state, tuple(state), tuple(state.values()))

    def matches(self, state: dict[Any, dict[str, Any]]) -> bool:
        return (state is self.state and len(state) == len(self.keys) and all(map(is_, state, self.keys))
                and all(map(is_, state.values(), self.entries)))




class _GradProof(tuple):  # type: ignore[type-arg]
    """(a parameter's placements object, the local tensor of a DTensor gradient), set on that gradient.
    A deep copy or a pickle of the gradient gets None instead: its local tensor is another object."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        return type(None), ()


def proven_local_grads(cached: LocalGroup) -> tuple[tuple[torch.Tensor, ...], bool] | None:
    """The common case in one pass: every parameter's gradient already carries its proof (one C-level
    ``grad.<proof>`` lookup per parameter); None otherwise (then ``collect_local_grads`` sorts it out)."""
    try:
        proofs = tuple(map(_proof_of_grad, cached.ours))
    except AttributeError:  # a parameter without a gradient, or a gradient without a proof
        return None
    try:
        if all(map(is_, map(_first, proofs), cached.placements)):
            return tuple(map(_second, proofs)), True
    except TypeError:  # a proof attribute that is not ours (None after a deepcopy)
        pass
    return None


def prove_grad(grad: DTensor, placements: tuple[Any, ...], local: torch.Tensor) -> None:
    """Mark a DTensor gradient the library made for a parameter with ``placements`` (its local tensor
    ``local`` has the parameter's local shape and dtype) as checked: the step then reads it in one lookup."""
    setattr(grad, _GRAD_PROOF_ATTR, _GradProof((placements, local)))


def collect_local_grads(cached: LocalGroup,
                 grads: tuple[Any, ...]) -> tuple[tuple[torch.Tensor | None, ...], bool] | None:
    """The gradients' local tensors (None for a parameter without one) and whether every parameter has
    one; None if a gradient is not a DTensor laid out like its parameter.

    A gradient checked once carries the proof on itself (``_GRAD_PROOF_ATTR``: its parameter's
    placements object and its local tensor, which it holds anyway), so a gradient that outlives the
    step (``zero_grad(set_to_none=False)``, accumulation) is not checked again. ``swap_tensors`` on a
    gradient swaps its ``__dict__`` with its contents, so the proof stays with the local it names; a
    copy does not inherit it (``_GradProof``)."""
    proofs: tuple[Any, ...] = tuple(map(getattr, grads, repeat(_GRAD_PROOF_ATTR), repeat(None)))
    try:
        if all(map(is_, map(_first, proofs), cached.placements)):
            return tuple(map(_second, proofs)), True
    except TypeError:  # a gradient without a proof, or a parameter without a gradient
        pass
    if all(map(is_, proofs, repeat(None))) and all(map(is_, map(type, grads), repeat(DTensor))):
        # new gradients (zero_grad() set them to None): check them in bulk
        if tuple(map(_placements_of, grads)) != cached.placements:
            return None
        local_grads = tuple(map(DTensor.to_local, grads))
        if tuple(map(_shape_of, local_grads)) != cached.shapes or tuple(map(_dtype_of, local_grads)) != cached.dtypes:
            return None  # what the views' .grad setter would refuse (the ready path has no setter)
        for grad, new_proof in zip(grads, map(_GradProof, zip(cached.placements, local_grads))):
            setattr(grad, _GRAD_PROOF_ATTR, new_proof)
        return local_grads, True
    mixed: list[torch.Tensor | None] = []
    for grad, proof, placements, view in zip(grads, proofs, cached.placements, cached.views):
        if grad is None or (proof is not None and proof[0] is placements):
            mixed.append(None if grad is None else proof[1])
            continue
        if type(grad) is not DTensor or not same(grad.placements, placements):
            return None
        local_grad = grad.to_local()
        if local_grad.shape != view.shape or local_grad.dtype != view.dtype:
            return None
        setattr(grad, _GRAD_PROOF_ATTR, _GradProof((placements, local_grad)))
        mixed.append(local_grad)
    return tuple(mixed), all(map(_is_not, mixed, repeat(None)))


def check_entries(cached: LocalGroup, grads: tuple[Any, ...], keys: frozenset[str],
                   state: dict[Any, dict[str, Any]], local_state: LocalState) -> bool:
    """Per slot with a gradient: its state entry and values are the ones mirrored (else mirror them)."""
    mirrored = True
    for slot, grad in zip(cached.slots, grads):
        if grad is None:
            mirrored = False  # not checked: a later step with a gradient must look again
            continue
        entry = state.get(slot.param)
        if entry is None or len(entry) != len(slot.values):
            return False
        if (entry is not slot.entry or not all(map(is_, entry.values(), slot.values))) and \
                not mirror(slot, entry, keys, local_state):
            return False
    cached.remember_entries(mirrored)
    return True




def mirror(slot: Slot, entry: dict[str, Any], keys: frozenset[str], local_state: LocalState) -> bool:
    """Put the local tensors of ``entry`` (a DTensor state entry) in ``local_state`` for ``slot``."""
    if entry.keys() != keys:
        return False
    local_entry: dict[str, Any] = {}
    for k, v in entry.items():
        if isinstance(v, DTensor):
            if not same(v.placements, slot.placements):
                return False
            v = v.to_local()
            if v.shape != slot.local.shape:
                return False
        elif isinstance(v, torch.Tensor) and k not in _SCALAR_KEYS:
            return False
        local_entry[k] = v
    slot.entry, slot.values = entry, tuple(entry.values())
    local_state[slot.local] = local_entry
    return True


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a is b or a == b


class LocalState(dict):  # type: ignore[type-arg]
    """The view's ``state``: the local entries of our shards; any other key reads (and lazily creates,
    as the real defaultdict would) the real optimizer's entry, so plain parameters share their state."""

    def __init__(self, real: dict[Any, dict[str, Any]]) -> None:
        super().__init__()
        self.real = real

    def __missing__(self, key: Any) -> dict[str, Any]:
        return self.real[key]
