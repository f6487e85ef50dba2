"""Observable runtime events: every unshard, reshard, reduce and wait a ParamGroup performs.

Tests assert their order; the profiler (profile.py) times them. With no observer registered the cost
is one truthiness check per event (see design/streams.md, "Observing the order").
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


class EventKind(enum.Enum):
    ALL_GATHER = "all_gather"  # collective issued (unshard started)
    UNSHARD = "unshard"  # unsharded params ready for compute (all-gather waited + copied out)
    RESHARD = "reshard"  # unsharded params freed (or reduced to a partial shard)
    REDUCE_SCATTER = "reduce_scatter"  # gradient reduce-scatter issued
    ALL_REDUCE = "all_reduce"  # HSDP gradient all-reduce across replicas issued
    REDUCE_DONE = "reduce_done"  # reduced sharded gradients assigned to .grad
    OPTIMIZER_COLLECTIVE = "optimizer_collective"  # issued by an optimizer step (Muon's row exchange)


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    EXPLICIT = "explicit"  # user called unshard()/reshard() outside forward/backward
    OPTIMIZER = "optimizer"  # inside optimizer.step()


@dataclass
class CollectiveTiming:
    """When one collective finished and how long its consumer waited for it; made only while observed.

    CPU: ``t_done`` is set by the c10d work's future callback when the collective completed and
    ``exposed_s`` is the host time blocked in ``Pending.wait``. Accelerator: ``start``/``end`` are
    timing events around the collective on its stream and ``reached`` is one recorded on the consumer
    stream where it waits; the profiler turns them into seconds after a synchronize.
    """

    t_issue: float = field(default_factory=time.perf_counter)
    t_done: float = 0.0  # CPU: perf_counter when the work completed (0 if the backend has no future)
    t_wait: float = 0.0  # perf_counter when the consumer began waiting (0: never waited)
    exposed_s: float = 0.0  # CPU: host time blocked in the wait
    start: Any = None  # accelerator timing events (see above)
    end: Any = None
    reached: Any = None


@dataclass
class TraceEvent:
    """One runtime event of one unit (not a device event: ``torch.Event`` is that)."""

    kind: EventKind
    fqn: str  # the FSDP unit's module FQN ("" for the root)
    phase: Phase
    nbytes: int = 0
    group_size: int = 0  # ranks taking part in the collective (0 when no collective)
    t_start: float = field(default_factory=time.perf_counter)
    t_end: float = 0.0  # filled by observers that time the collective's completion
    exposed_s: float = 0.0  # time the caller blocked waiting for this event's collective
    prefetch: bool = False
    issued_as: str = ""  # the collective issued when it is not ``kind`` (gloo's in-place reduce-scatter: all_reduce)
    timing: CollectiveTiming | None = None  # ALL_GATHER / REDUCE_SCATTER / ALL_REDUCE while observed

    def short(self) -> str:
        """``"unshard blocks.0"``: compact form for order assertions."""
        return f"{self.kind.value} {self.fqn or '<root>'}"


OPTIMIZER_UNIT = "<optimizer>"  # the fqn of optimizer collectives' events

Observer = Callable[[TraceEvent], None]
# The registered observers. The runtime's hot path reads this list's truth value itself (no call into this
# file per event while nobody observes); only ``observe`` changes it.
observers: list[Observer] = []


def emit(event: TraceEvent) -> None:
    for observer in observers:
        observer(event)


def enabled() -> bool:
    return bool(observers)


def emit_if_observed(kind: EventKind, fqn: str, phase: Phase, **fields: Any) -> TraceEvent | None:
    """Build and emit the event only while an observer is registered (else one truthiness check)."""
    if not observers:
        return None
    event = TraceEvent(kind, fqn, phase, **fields)
    emit(event)
    return event


@contextlib.contextmanager
def observe(observer: Observer) -> Iterator[None]:
    """Call ``observer(event)`` for every runtime event inside the block."""
    observers.append(observer)
    try:
        yield
    finally:
        observers.remove(observer)


@contextlib.contextmanager
def record() -> Iterator[list[TraceEvent]]:
    """Collect the events of the block into a list: ``with record() as events: ...``."""
    events: list[TraceEvent] = []
    with observe(events.append):
        yield events
