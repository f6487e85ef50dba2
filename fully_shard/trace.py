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


class EventKind(enum.Enum):
    ALL_GATHER = "all_gather"  # collective issued (unshard started)
    UNSHARD = "unshard"  # unsharded params ready for compute (all-gather waited + copied out)
    RESHARD = "reshard"  # unsharded params freed (or reduced to a partial shard)
    REDUCE_SCATTER = "reduce_scatter"  # gradient reduce-scatter issued
    ALL_REDUCE = "all_reduce"  # HSDP gradient all-reduce across replicas issued
    REDUCE_DONE = "reduce_done"  # reduced sharded gradients assigned to .grad


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    EXPLICIT = "explicit"  # user called unshard()/reshard() outside forward/backward


@dataclass
class Event:
    kind: EventKind
    fqn: str  # the FSDP unit's module FQN ("" for the root)
    phase: Phase
    nbytes: int = 0
    group_size: int = 0  # ranks taking part in the collective (0 when no collective)
    t_start: float = field(default_factory=time.perf_counter)
    t_end: float = 0.0  # filled by observers that time the collective's completion
    exposed_s: float = 0.0  # time the caller blocked waiting for this event's collective
    prefetch: bool = False

    def short(self) -> str:
        """``"unshard blocks.0"``: compact form for order assertions."""
        return f"{self.kind.value} {self.fqn or '<root>'}"


Observer = Callable[[Event], None]
_observers: list[Observer] = []


def emit(event: Event) -> None:
    for observer in _observers:
        observer(event)


def enabled() -> bool:
    return bool(_observers)


@contextlib.contextmanager
def observe(observer: Observer) -> Iterator[None]:
    """Call ``observer(event)`` for every runtime event inside the block."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


@contextlib.contextmanager
def record() -> Iterator[list[Event]]:
    """Collect the events of the block into a list: ``with record() as events: ...``."""
    events: list[Event] = []
    with observe(events.append):
        yield events
