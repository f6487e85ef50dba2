"""A stand-in for ``torch.cuda`` that runs the library's CUDA branch on CPU and fails on every stream race.

``fully_shard.comm.streams.stand_in(device)`` makes the contexts created inside it take the
accelerator branch on this object: its streams, events, ``current_stream`` and ``stream(...)``. The
stand-in is also a ``TorchDispatchMode``: every aten op (c10d collectives included) runs on the
current simulated stream, and every storage it touches is a *block* with the stream it was allocated
on, its last write and its last read per stream. Streams keep vector clocks: an op ticks its stream;
``record_event`` copies the stream's clock into the event; ``wait_event`` / ``wait_stream`` merge a
clock in; a host ``synchronize`` merges into every stream's view of the host. ``a`` happens before a
point of stream ``S`` when ``S``'s clock has reached it.

What it checks (design/streams.md, "The stream stand-in"):

* the caching allocator's rule: a block freed while allocated on stream ``S`` may go to the next
  allocation on ``S`` at once; every use of it on another stream must happen before that allocation
  (``S`` waited on an event recorded after the use). A block's free is its storage's real
  deallocation (a weak reference to the storage: views, autograd and c10d keep it alive as on CUDA);
* data races: a read or write on stream ``B`` of a block last written on stream ``A`` (and a write
  after a read) must happen after that write (read).

Each violation names the block (the op that allocated it, its shape and dtype) and both streams.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Clock = dict["SimStream", int]
Point = tuple["SimStream", int]  # (stream, its sequence number)


def _merge(into: Clock, other: Clock) -> None:
    for stream, seq in other.items():
        if into.get(stream, 0) < seq:
            into[stream] = seq


class SimStream:
    """A stream: a name and a vector clock of what it has waited for (itself included)."""

    def __init__(self, device: StreamStandIn, name: str) -> None:
        self.device = device
        self.name = name
        self.clock: Clock = {self: 0}

    def __repr__(self) -> str:
        return self.name

    def tick(self) -> int:
        self.clock[self] += 1
        return self.clock[self]

    def reaches(self, point: Point) -> bool:
        """Whether ``point`` happens before this stream's next op. A host op happens before every op
        enqueued after it; the host reaches a stream's op once it synchronized with it."""
        stream, seq = point
        host = self.device.host_stream
        if stream is self or (stream is host and self is not host):
            return True
        return self.clock.get(stream, 0) >= seq or host.clock.get(stream, 0) >= seq

    # torch.cuda.Stream's interface, as CommContext uses it
    def wait_stream(self, other: SimStream) -> None:
        self.device.log.append(Wait(self.name, other.name, None, 0))
        _merge(self.clock, other.clock)

    def wait_event(self, event: SimEvent) -> None:
        on = event.stream
        lag = on.clock[on] - event.clock.get(on, 0) if on is not None else 0
        self.device.log.append(Wait(self.name, on.name if on is not None else "-", id(event), lag))
        _merge(self.clock, event.clock)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else SimEvent(self.device)
        event.record(self)
        return event

    def synchronize(self) -> None:
        _merge(self.device.host_stream.clock, self.clock)

    def query(self) -> bool:
        return True


class SimEvent:
    """An event: the clock of the stream it was recorded on, at that point."""

    def __init__(self, device: StreamStandIn, **_: Any) -> None:
        self.device = device
        self.clock: Clock = {}
        self.stream: SimStream | None = None

    def record(self, stream: SimStream | None = None) -> None:
        self.stream = stream if stream is not None else self.device.current
        self.clock = dict(self.stream.clock)

    def wait(self, stream: SimStream | None = None) -> None:
        (stream if stream is not None else self.device.current).wait_event(self)

    def synchronize(self) -> None:
        _merge(self.device.host_stream.clock, self.clock)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: SimEvent) -> float:
        return 0.0


@dataclass(frozen=True)
class Wait:
    """One ``wait_stream`` (``event`` None) or ``wait_event`` of stream ``waiter`` on stream ``on``;
    ``lag``: ops issued on ``on`` after the event when it was waited."""

    waiter: str
    on: str
    event: int | None
    lag: int


@dataclass(eq=False)
class Block:
    """One storage: where it was allocated, its last write and its last read on each stream."""

    name: str
    stream: SimStream
    host: bool = False  # host memory (CPU offload): ops on it run on the host, copies to it are DMAs
    last_write: Point | None = None
    reads: dict[SimStream, int] = field(default_factory=dict)

    def uses(self) -> list[Point]:
        points = list(self.reads.items())
        if self.last_write is not None:
            points.append(self.last_write)
        return points


class StreamStandIn(TorchDispatchMode):
    """``with StreamStandIn() as device, streams.stand_in(device): ...``; then ``device.violations``."""

    def __init__(self) -> None:
        super().__init__()
        self.default = SimStream(self, "compute")
        self.current = self.default
        self.host_stream = SimStream(self, "host")  # host ops; its clock: what the host synchronized with
        self.blocks: dict[int, Block] = {}  # id(storage) -> block, while the storage lives
        self.freed: dict[SimStream, list[Block]] = {}  # freed, not yet checked against an allocation
        self.violations: list[str] = []
        self.log: list[Wait] = []  # every wait, for tests that check when a stream waited
        self._names = itertools.count()
        self._lock = threading.Lock()  # storages may die in a backend's thread

    # --- torch.cuda's interface, as CommContext uses it -------------------------------------------
    def Stream(self, device: Any = None, priority: int = 0) -> SimStream:  # torch.cuda.Stream
        names = ("all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce")
        n = next(self._names)
        return SimStream(self, names[n] if n < len(names) else f"side{n}")

    def Event(self, **kwargs: Any) -> SimEvent:  # torch.cuda.Event
        return SimEvent(self, **kwargs)

    def current_stream(self, device: Any = None) -> SimStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self, device: Any = None) -> None:
        for stream in {s for b in self.blocks.values() for s, _ in b.uses()}:
            stream.synchronize()

    def mark_host(self, tensors: list[torch.Tensor]) -> None:
        """These tensors live in host memory (CPU offload's shards): ops on them run on the host."""
        for t in tensors:
            local = _plain(t)
            if local is not None:
                block, _ = self._block(local, self.default, "host")
                block.host = True

    # --- the checks ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise with every violation seen so far."""
        if self.violations:
            raise AssertionError(f"{len(self.violations)} stream violation(s):\n" + "\n".join(self.violations[:20]))

    def _block(self, t: torch.Tensor, stream: SimStream, name: str) -> tuple[Block, bool]:
        """The block of ``t``'s storage; a storage first seen is taken as allocated on ``stream`` (an
        argument seen first inside a collective is the backend's own temporary, made on its stream)."""
        storage = t.untyped_storage()
        key = id(storage)
        block = self.blocks.get(key)
        if block is not None:
            return block, False
        block = Block(f"{name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}", stream)
        self.blocks[key] = block
        weakref.finalize(storage, self._free, key)
        return block, True

    def _free(self, key: int) -> None:
        with self._lock:
            block = self.blocks.pop(key, None)
            if block is not None:
                self.freed.setdefault(block.stream, []).append(block)

    def _allocated_on(self, stream: SimStream, seq: int) -> None:
        """The caching allocator may hand this allocation a block freed on ``stream``: every other
        stream's use of those blocks must happen before it."""
        with self._lock:
            freed, self.freed[stream] = self.freed.get(stream, []), []
        for block in freed:
            for point in block.uses():
                if point[0] is not stream and not stream.reaches(point):
                    self.violations.append(
                        f"{block.name} (allocated on {block.stream}) was freed and may be reallocated on "
                        f"{stream} while {point[0]} may still use it (op {point[1]} on {point[0]} is not "
                        f"ordered before {stream}'s op {seq}): keep it alive until {stream} waits for {point[0]}")

    def _use(self, block: Block, stream: SimStream, seq: int, write: bool, op: str) -> None:
        if block.last_write is not None and not stream.reaches(block.last_write):
            self.violations.append(f"{op} on {stream} {'writes' if write else 'reads'} {block.name} while "
                                   f"{block.last_write[0]}'s write of it may still run (not waited)")
        if write:
            for other, seq_read in block.reads.items():
                if not stream.reaches((other, seq_read)):
                    self.violations.append(f"{op} on {stream} writes {block.name} while {other} may still "
                                           "read it (not waited)")
            block.last_write = (stream, seq)
            block.reads = {}
        else:
            block.reads[stream] = seq

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.returns and all(
                r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view: no data touched
        op = str(func.overloadpacket.__name__)
        flat_args = [b for b in (_plain(t) for t in tree_flatten((args, kwargs))[0]) if b is not None]
        arg_blocks = [self.blocks.get(id(t.untyped_storage())) for t in flat_args]
        moving = op == "_to_copy" and "device" in kwargs  # a copy between host and device: a DMA on the stream
        host_op = not moving and bool(arg_blocks) and all(b is not None and b.host for b in arg_blocks)
        stream = self.host_stream if host_op else self.current
        seq = stream.tick()
        written: set[int] = set()
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    written |= {id(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten((args, kwargs))[0]:
            local = _plain(t)
            if local is not None:
                block, _ = self._block(local, stream, op)
                self._use(block, stream, seq, id(t) in written, op)
        source_host = bool(arg_blocks) and arg_blocks[0] is not None and arg_blocks[0].host
        # outputs: views and in-place results alias an argument (seen above); the rest are new blocks
        aliased = schema is not None and any(r.alias_info is not None for r in schema.returns)
        allocated = False
        for t in ([] if aliased else tree_flatten(out)[0]):
            local = _plain(t)
            if local is not None:
                block, new = self._block(local, stream, op)
                block.host = (not source_host) if moving else host_op
                allocated |= new
                self._use(block, stream, seq, True, op)
        if moving and not kwargs.get("non_blocking", False):
            _merge(self.host_stream.clock, stream.clock)  # a blocking copy: the host waited for the stream
        if allocated and not host_op:
            self._allocated_on(stream, seq)
        return out


def _plain(t: Any) -> torch.Tensor | None:
    """The tensor whose storage an op touches (a DTensor's local tensor), or None."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if not isinstance(t, torch.Tensor) or t.is_meta or t.untyped_storage().nbytes() == 0:
        return None
    return t
