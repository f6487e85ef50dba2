"""RecoveryState: one rank's local shards and optimizer state, captured and applied on the training thread.

See design/fault-tolerance.md. torchft asks for a replica's state on its quorum thread while the training
thread runs forward and backward, and hands a healing replica the state its peer sent. Nothing FSDP does
may run there: ``model.state_dict()`` runs state-dict hooks that reshard units in the middle of a forward,
and DCP's optimizer state dict issues collectives. So this class

- **captures** on the training thread, at the start of every step (``capture``, before the quorum is
  started): references to the local shard of every parameter and to the local tensors of the optimizer
  state, a copy of every persistent buffer, the hyperparameters and the registered ``stateful`` objects'
  state dicts. No copy of the large part: between the capture and the commit vote the training thread
  only runs forward and backward, which write no parameter or optimizer state (a forward may write
  buffers: BatchNorm's running statistics, hence their copy), and torchft stops serving the state
  (``disallow_checkpoint``) inside ``should_commit``, before the optimizer step writes them. On
  accelerators an event recorded at the capture orders the transport's reads after the previous step's
  optimizer kernels.
- **serves** that capture to torchft's thread as it is (``state_dict``: a dict lookup and the event wait).
- **checks** what a peer sent on the training thread (``load_state_dict``, which torchft calls from
  ``should_commit`` or ``start_quorum``): format, shard layout (ShardLayout), every tensor's shape and
  dtype, the optimizer's param groups and state entries. Nothing is written then: the checked state is
  kept as pending, or the error is kept and reported to the manager (the group's commit vote fails).
- **applies** the pending state when the wrapper says so (``apply_pending``), by copying into the local
  tensors in place (``Tensor.copy_`` on ``to_local()`` views): no hook, no collective, no reshard. Entries
  the optimizer has not created yet are created like the ones it would create (``zeros_like`` of the
  parameter). Everything that can fail was checked before the first write: all or nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from ..core.registry import owner_of
from ..core.state import states_under
from .layout import ShardLayout, ShardLayoutError, dtype_name

__all__ = ["FORMAT", "RecoveryState", "Stateful"]

FORMAT = "fully_shard.ft/1"  # the wire format's name and version: a peer with another one is refused


class Stateful(Protocol):
    """What ``stateful=`` objects provide (an LR scheduler, a data loader's position): ``state_dict()``
    read at the capture, ``load_state_dict(d)`` called when a heal is applied (after the tensors)."""

    def state_dict(self) -> dict[str, Any]: ...  # pragma: no cover - protocol

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...  # pragma: no cover - protocol


@dataclass
class _Pending:
    """A received state that passed every check: what ``apply_pending`` writes."""

    tensors: list[torch.Tensor]
    groups: list[dict[str, Any]]
    entries: list[dict[str, dict[str, Any]] | None]
    stateful: dict[str, Any]


class RecoveryState:
    """One rank's recovery state for torchft: captured and applied on the training thread only."""

    def __init__(self, model: nn.Module, optimizer: Optimizer, *, group_rank: int, group_world_size: int,
                 stateful: Mapping[str, Any] | None = None,
                 report_error: Callable[[Exception], None] | None = None) -> None:
        self._model = model
        self._optimizer = optimizer
        self._group = (group_rank, group_world_size)
        self._stateful = dict(stateful or {})
        for name, obj in self._stateful.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"fault_tolerant(stateful={{{name!r}: {type(obj).__name__}}}): a stateful object "
                                "needs state_dict() and load_state_dict(). Fix: pass e.g. an LR scheduler.")
        self._report_error = report_error
        self._thread = threading.get_ident()
        self._served: dict[str, Any] | None = None
        self._event: Any = None
        self._pending: _Pending | None = None
        self.error: ShardLayoutError | None = None  # the last received state that did not fit
        self._read_model()

    # --- what is transferred ------------------------------------------------------------------------
    def _read_model(self) -> None:
        """The parameters and persistent buffers in a fixed order, the optimizer's params by index, and
        the layout of it all. Refuses what recovery cannot keep consistent."""
        params = list(self._model.named_parameters())
        for fqn, p in params:
            if p.requires_grad and owner_of(p) is None:
                raise ValueError(f"fault_tolerant: parameter {fqn!r} ({type(p).__name__}{list(p.shape)}) trains but "
                                 "is not sharded by fully_shard, so its gradient would not be averaged across "
                                 "replica groups and the replicas would drift apart. Fix: include its module in a "
                                 "fully_shard unit (fully_shard(model) on the root covers every parameter left).")
        buffers = []
        for prefix, module in self._model.named_modules():
            skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
            buffers += [(f"{prefix}.{n}" if prefix else n, b) for n, b in module._buffers.items()
                        if b is not None and n not in skip]
        index = {id(p): i for i, (_, p) in enumerate(params)}
        self._group_index: list[list[int]] = []
        for g, group in enumerate(self._optimizer.param_groups):
            missing = [p for p in group["params"] if id(p) not in index]
            if missing:
                raise ValueError(f"fault_tolerant: param group {g} of {type(self._optimizer).__name__} holds "
                                 f"{len(missing)} parameter(s) that are not the model's (e.g. "
                                 f"{type(missing[0]).__name__}{list(missing[0].shape)}); recovery transfers the "
                                 "model's parameters and their optimizer state only. Fix: build the optimizer from "
                                 "model.parameters() after fully_shard.")
            self._group_index.append([index[id(p)] for p in group["params"]])
        self._params = [p for _, p in params]
        self._buffers = [b for _, b in buffers]
        self.layout = ShardLayout.of([(f"param:{n}", p) for n, p in params] + [(f"buffer:{n}", b) for n, b in buffers],
                                     group_rank=self._group[0], group_world_size=self._group[1])
        self._wire_layout = self.layout.to_wire()

    def _locals(self) -> list[torch.Tensor]:
        return [p.to_local() if isinstance(p, DTensor) else p.detach() for p in self._params] + \
            [b.detach() for b in self._buffers]

    # --- capture (training thread) and serve (torchft's thread) -------------------------------------
    def capture(self) -> None:
        """Take references to everything transferred, as it is now (a step boundary)."""
        self._check_thread("capture")
        if any(p is not q for p, q in zip(self._params, self._model.parameters())):
            self._read_model()  # parameters were replaced (model.to_empty(), load_state_dict(assign=True))
        state = self._optimizer.state
        with torch.no_grad():
            # parameter shards by reference (only the optimizer step writes them); buffers copied: a forward
            # may write them (BatchNorm's running statistics) while torchft's thread serves this capture
            tensors = [p.to_local() if isinstance(p, DTensor) else p.detach() for p in self._params] + \
                [b.detach().clone() for b in self._buffers]
            entries: list[dict[str, dict[str, Any]] | None] = []
            for p in self._params:
                entry = state.get(p)
                if not entry:
                    entries.append(None)
                    continue
                sharded = {k: v.to_local() for k, v in entry.items() if isinstance(v, DTensor)}
                plain = {k: v for k, v in entry.items() if not isinstance(v, DTensor)}
                entries.append({"sharded": sharded, "plain": plain})
        groups = [{k: v for k, v in group.items() if k != "params"} for group in self._optimizer.param_groups]
        stateful = {name: obj.state_dict() for name, obj in self._stateful.items()}
        device = tensors[0].device if tensors else torch.device("cpu")
        self._event = torch.Event(device=device) if device.type not in ("cpu", "meta") else None
        if self._event is not None:
            self._event.record()
        self._served = {"format": FORMAT, "layout": self._wire_layout, "tensors": tensors,
                        "optimizer": {"groups": groups, "param_index": self._group_index, "entries": entries},
                        "stateful": stateful}

    def state_dict(self) -> dict[str, Any]:
        """torchft's ``state_dict`` callback (its quorum thread): the last capture, after the device work
        that wrote it. No FSDP call, no collective, no copy."""
        served = self._served
        if served is None:
            raise RuntimeError("fully_shard.ft: a peer asked for this replica's state before its first step "
                               "started (the state is captured in optimizer.zero_grad(), before the quorum).")
        if self._event is not None:
            self._event.synchronize()
        return served

    # --- check (training thread) and apply ----------------------------------------------------------
    def load_state_dict(self, received: Any) -> None:
        """torchft's ``load_state_dict`` callback: check ``received`` against this rank and keep it as
        pending; on a mismatch keep the error, report it to the manager and write nothing."""
        self._check_thread("load_state_dict")
        self._pending = None
        try:
            self._pending = self._checked(received)
            self.error = None
        except ShardLayoutError as e:
            self.error = e
            if self._report_error is not None:
                self._report_error(e)

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def drop_pending(self) -> None:
        self._pending = None

    def apply_pending(self) -> bool:
        """Write the pending state into this rank's tensors (in place), then capture again; False if
        nothing was pending."""
        self._check_thread("apply_pending")
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        self._check_units_sharded()
        state = self._optimizer.state
        with torch.no_grad():
            for dst, src in zip(self._locals(), pending.tensors):
                dst.copy_(src)
            for group, received in zip(self._optimizer.param_groups, pending.groups):
                group.update(received)
            for p, received_entry in zip(self._params, pending.entries):
                if received_entry is None:
                    state.pop(p, None)
                    continue
                entry = state[p]
                for k in set(entry) - set(received_entry["sharded"]) - set(received_entry["plain"]):
                    del entry[k]
                for k, t in received_entry["sharded"].items():
                    if not isinstance(entry.get(k), DTensor) or entry[k].dtype != t.dtype:
                        entry[k] = torch.zeros_like(p, dtype=t.dtype, memory_format=torch.preserve_format)
                    entry[k].to_local().copy_(t)
                for k, v in received_entry["plain"].items():
                    old = entry.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and not isinstance(old, DTensor) \
                            and old.shape == v.shape and old.dtype == v.dtype:
                        old.copy_(v)
                    else:
                        entry[k] = v.clone() if isinstance(v, torch.Tensor) else v
        for name, obj in self._stateful.items():
            obj.load_state_dict(pending.stateful[name])
        self.capture()
        return True

    def _checked(self, received: Any) -> _Pending:
        """Everything a write could trip on, before any write: raise ShardLayoutError naming it."""
        fix = ("Fix: shard the same model the same way in every replica group (the same parameters, mesh shape and "
               "shard_placement_fn, the same optimizer and param groups). Nothing was written: this rank's "
               "parameters and optimizer state are as they were.")
        where = f"replica group rank {self._group[0]} of {self._group[1]}"
        if not isinstance(received, Mapping) or received.get("format") != FORMAT:
            found = received.get("format") if isinstance(received, Mapping) else type(received).__name__
            raise ShardLayoutError(f"fully_shard.ft ({where}): the peer's state is not a {FORMAT!r} recovery state "
                                   f"(found format {found!r}). {fix}")
        try:
            theirs = ShardLayout.from_wire(received["layout"])
        except (KeyError, ValueError) as e:
            raise ShardLayoutError(f"fully_shard.ft ({where}): the peer's state has no readable shard layout ({e}). "
                                   f"{fix}") from None
        if theirs != self.layout:
            lines = "\n  ".join(self.layout.differences(theirs))
            raise ShardLayoutError(f"fully_shard.ft ({where}): cannot heal from the peer: its shards are laid out "
                                   f"differently from this rank's:\n  {lines}\n{fix}")
        names = [t.name for t in self.layout.tensors]
        tensors = received.get("tensors")
        if not isinstance(tensors, list) or len(tensors) != len(names):
            raise ShardLayoutError(f"fully_shard.ft ({where}): the peer sent {_count(tensors)} tensors for "
                                   f"{len(names)} layout entries. {fix}")
        for name, t, spec in zip(names, tensors, self.layout.tensors):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != spec.local_shape \
                    or dtype_name(t.dtype) != spec.dtype:
                found = f"{dtype_name(t.dtype)}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ShardLayoutError(f"fully_shard.ft ({where}): {name}: expected a local tensor "
                                       f"{spec.dtype}{list(spec.local_shape)}, received {found}. {fix}")
        optim = received.get("optimizer")
        if not isinstance(optim, Mapping):
            raise ShardLayoutError(f"fully_shard.ft ({where}): the peer's state has no optimizer state. {fix}")
        groups, index, entries = optim.get("groups"), optim.get("param_index"), optim.get("entries")
        if index != self._group_index or not isinstance(groups, list):
            raise ShardLayoutError(
                f"fully_shard.ft ({where}): the peer's optimizer has other param groups: parameter indices per "
                f"group {_groups_summary(index)}, this rank's {_groups_summary(self._group_index)}. {fix}")
        for g, (ours, theirs_group) in enumerate(zip(self._optimizer.param_groups, groups)):
            expected = set(ours) - {"params"}
            if not isinstance(theirs_group, Mapping) or set(theirs_group) != expected:
                found = sorted(theirs_group) if isinstance(theirs_group, Mapping) else type(theirs_group).__name__
                raise ShardLayoutError(f"fully_shard.ft ({where}): param group {g}: the peer's optimizer has the "
                                       f"options {found}, this rank's {sorted(expected)} (another optimizer "
                                       f"class or torch version?). {fix}")
        if not isinstance(entries, list) or len(entries) != len(self._params):
            raise ShardLayoutError(f"fully_shard.ft ({where}): the peer sent optimizer state for {_count(entries)} "
                                   f"parameters, this model has {len(self._params)}. {fix}")
        state = self._optimizer.state
        for name, p, entry in zip(names, self._params, entries):
            if entry is None:
                continue
            if not (isinstance(entry, Mapping) and isinstance(entry.get("sharded"), Mapping)
                    and isinstance(entry.get("plain"), Mapping)):
                raise ShardLayoutError(f"fully_shard.ft ({where}): {name}: unreadable optimizer state entry. {fix}")
            local_shape = tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
            ours_entry = state.get(p) or {}
            for k, t in entry["sharded"].items():
                if not isinstance(p, DTensor) or not isinstance(t, torch.Tensor) or tuple(t.shape) != local_shape:
                    found = f"{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ShardLayoutError(f"fully_shard.ft ({where}): {name}: optimizer state {k!r} received "
                                           f"as a shard of shape {found}; this rank's shard is {list(local_shape)}. "
                                           f"{fix}")
                mine = ours_entry.get(k)
                if mine is not None and (not isinstance(mine, DTensor) or mine.dtype != t.dtype):
                    raise ShardLayoutError(f"fully_shard.ft ({where}): {name}: optimizer state {k!r} received as "
                                           f"a {dtype_name(t.dtype)} shard, this rank holds {_describe(mine)}. {fix}")
        stateful = received.get("stateful")
        if not isinstance(stateful, Mapping) or set(stateful) != set(self._stateful):
            found = sorted(stateful) if isinstance(stateful, Mapping) else type(stateful).__name__
            raise ShardLayoutError(f"fully_shard.ft ({where}): the peer registered the stateful objects {found}, "
                                   f"this rank {sorted(self._stateful)}. {fix}")
        return _Pending(list(tensors), [dict(g) for g in groups], list(entries), dict(stateful))

    def _check_units_sharded(self) -> None:
        """Writes go to the sharded parameters: a unit holding unsharded parameters at a step boundary
        (``set_reshard_after_backward(False)`` left on) would keep using its stale unsharded copy."""
        for fqn, st in states_under(self._model):
            for group in st.groups:
                if group.state.name != "SHARDED":
                    raise RuntimeError(
                        f"fully_shard.ft: unit {fqn or '<root>'!r} is {group.state.name} at the step boundary, so a "
                        "heal written into its shards would not reach the unsharded parameters it computes with. "
                        "Fix: reshard after the last backward of a step (set_reshard_after_backward(True), "
                        "torch's default).")

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError(f"fully_shard.ft: RecoveryState.{what}() called on thread "
                               f"{threading.current_thread().name!r}, not the training thread that called "
                               "fault_tolerant(); the state may only be read or written there (design/"
                               "fault-tolerance.md). Fix: call optimizer.zero_grad()/step() on the training thread.")


def _count(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else f"no list ({type(value).__name__})"


def _groups_summary(index: Any) -> str:
    if not isinstance(index, list):
        return type(index).__name__
    return "[" + ", ".join(f"{len(g)} params" if isinstance(g, list) else "?" for g in index) + "]"


def _describe(value: Any) -> str:
    if isinstance(value, DTensor):
        return f"a {dtype_name(value.dtype)} DTensor"
    if isinstance(value, torch.Tensor):
        return f"a plain {dtype_name(value.dtype)} tensor"
    return type(value).__name__
