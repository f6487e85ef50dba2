"""A stand-in for ``torch.cuda`` that runs the library's CUDA branch on CPU and reports every stream race it models.

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
  (``S`` waited on an event recorded after the use). A block is freed when its storage is really
  deallocated (a weak reference to the storage: views, autograd and c10d keep it alive as on CUDA)
  or resized to 0 bytes (``untyped_storage().resize_(0)``, how unsharded parameters are freed); a
  resize from 0 bytes is an allocation on the current stream;
* data races: a read or write on stream ``B`` of a block last written on stream ``A`` (and a write
  after a read) must happen after that write (read).

Host memory (CPU offload's shards, ``pin_memory=True`` tensors): ops whose tensors are all host memory
run on the host; a ``_to_copy`` with a ``device`` and no dtype change is a DMA between host and device
memory on the current stream (the stand-in's device memory is CPU memory too, so it cannot tell
``.to(device)`` from ``.to("cpu")``: such a copy moves the block to the other side); a blocking one
(and a blocking ``copy_`` between the two sides) also makes the host wait for the stream.

Each violation names the block (the op that allocated it, its shape and dtype) and both streams.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
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
        """True only when the host knows every op enqueued so far is done (it synchronized with them);
        a real GPU may finish sooner, so code that acts on True never races here either."""
        return self.device.host_stream.clock.get(self, 0) >= self.clock[self]


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
        """True when never recorded, or once the host synchronized with the recorded point (as
        ``SimStream.query``)."""
        on = self.stream
        return on is None or self.device.host_stream.clock.get(on, 0) >= self.clock.get(on, 0)

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
    pinned: bool = False  # allocated with pin_memory=True (or by pin_memory())
    last_write: Point | None = None
    reads: dict[SimStream, int] = field(default_factory=dict)

    def uses(self) -> list[Point]:
        points = list(self.reads.items())
        if self.last_write is not None:
            points.append(self.last_write)
        return points


@dataclass(frozen=True)
class Communicated:
    """A tensor argument of a c10d collective as it was issued: the op, the argument's name, its storage."""

    op: str
    arg: str
    storage: weakref.ref[torch.UntypedStorage]


class StreamStandIn(TorchDispatchMode):
    """``with StreamStandIn() as device, streams.stand_in(device): ...``; then ``device.violations``."""

    def __init__(self) -> None:
        super().__init__()
        self.default = SimStream(self, "compute")
        self.current = self.default
        self.host_stream = SimStream(self, "host")  # host ops; its clock: what the host synchronized with
        self.blocks: dict[int, Block] = {}  # id(storage) -> block, while the storage lives and has bytes
        self.freed: dict[SimStream, list[Block]] = {}  # freed, not yet checked against an allocation
        self.violations: list[str] = []
        self.log: list[Wait] = []  # every wait, for tests that check when a stream waited
        self.communicated: list[Communicated] = []  # every collective's tensor arguments, in issue order
        self._names = itertools.count()
        self._lock = threading.Lock()  # storages may die in a backend's thread
        self._watched: dict[int, weakref.ref[torch.UntypedStorage]] = {}  # storages with a finalizer

    def __enter__(self) -> StreamStandIn:
        _RESIZE.push(self)
        try:
            super().__enter__()
        except BaseException:
            _RESIZE.pop(self)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _RESIZE.pop(self)

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
        with self._lock:  # (a backend's thread may free a storage meanwhile)
            streams = {s for b in self.blocks.values() for s, _ in b.uses()}
            streams |= {s for freed in self.freed.values() for b in freed for s, _ in b.uses()}
        for stream in streams | {self.default, self.current}:
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
        block = self.blocks.get(id(storage))
        if block is not None:
            return block, False
        block = Block(f"{name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}", stream)
        self._track(storage, block)
        return block, True

    def _track(self, storage: torch.UntypedStorage, block: Block) -> None:
        """``block`` is ``storage``'s now; its deallocation will free the block (one finalizer per storage)."""
        key = id(storage)
        with self._lock:
            self.blocks[key] = block
            ref = self._watched.get(key)
            new = ref is None or ref() is not storage
            if new:
                self._watched[key] = weakref.ref(storage)
        if new:
            weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)
            block = self.blocks.pop(key, None)
            if block is not None:
                self.freed.setdefault(block.stream, []).append(block)

    def resized(self, storage: torch.UntypedStorage, before: int, after: int) -> None:
        """``storage.resize_`` from ``before`` to ``after`` bytes: to 0 frees its block (returned to the
        stream it was allocated on), from 0 allocates one on the current stream, between two sizes
        copies the old bytes into a new block on the current stream and frees the old one."""
        if before == after:
            return
        stream = self.current
        with self._lock:
            block = self.blocks.pop(id(storage), None)
        seq = stream.clock[stream]
        if block is not None and after > 0:  # a reallocation reads the old bytes
            seq = stream.tick()
            self._use(block, stream, seq, False, "resize_")
        if block is not None:
            with self._lock:
                self.freed.setdefault(block.stream, []).append(block)
        if after > 0:
            new = Block(f"resize_ storage of {after} bytes", stream)
            if before > 0:
                new.last_write = (stream, seq)
            self._track(storage, new)
            self._allocated_on(stream, seq)

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
        op = str(func.overloadpacket.__name__)
        if op == "is_pinned":
            block = self._known(args[0])
            return block is not None and block.pinned
        pinned = op == "_pin_memory" or bool(kwargs.get("pin_memory"))
        if op == "_pin_memory":  # no pinned allocator on a CPU build: a host copy that is pinned
            out = args[0].clone()
        elif pinned:
            out = func(*args, **{**kwargs, "pin_memory": False})
        else:
            out = func(*args, **kwargs)
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.returns and all(
                r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view: no data touched
        flat_args = [b for b in (_plain(t) for t in tree_flatten((args, kwargs))[0]) if b is not None]
        arg_blocks = [self.blocks.get(id(t.untyped_storage())) for t in flat_args]
        source_host = bool(arg_blocks) and arg_blocks[0] is not None and arg_blocks[0].host
        # a copy between host and device: a DMA on the stream (a dtype change is a cast on one side)
        moving = (op == "_to_copy" and "device" in kwargs and bool(flat_args)
                  and kwargs.get("dtype") in (None, flat_args[0].dtype))
        crossing = op == "copy_" and len(arg_blocks) == 2 and None not in arg_blocks and (
            arg_blocks[0].host != arg_blocks[1].host)  # type: ignore[union-attr]
        host_op = not moving and bool(arg_blocks) and all(b is not None and b.host for b in arg_blocks)
        stream = self.host_stream if host_op else self.current
        seq = stream.tick()
        written: set[int] = set()
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if arg.alias_info is not None and arg.alias_info.is_write:
                    written |= {id(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}
                if func.namespace == "c10d":
                    self.communicated += [Communicated(op, arg.name, weakref.ref(local.untyped_storage()))
                                          for local in map(_plain, tree_flatten(value)[0]) if local is not None]
        for t in tree_flatten((args, kwargs))[0]:
            local = _plain(t)
            if local is not None:
                block, _ = self._block(local, stream, op)
                self._use(block, stream, seq, id(t) in written, op)
        # outputs: views and in-place results alias an argument (seen above); the rest are new blocks
        aliased = schema is not None and any(r.alias_info is not None for r in schema.returns)
        allocated = False
        for t in ([] if aliased else tree_flatten(out)[0]):
            local = _plain(t)
            if local is not None:
                block, new = self._block(local, stream, op)
                block.host = pinned or ((not source_host) if moving else host_op)
                block.pinned = pinned
                allocated |= new and not block.host
                self._use(block, stream, seq, True, op)
        if (moving or crossing) and not kwargs.get("non_blocking", args[2] if crossing and len(args) > 2 else False):
            _merge(self.host_stream.clock, stream.clock)  # a blocking copy: the host waited for the stream
        if allocated:
            self._allocated_on(stream, seq)
        return out

    def _known(self, t: Any) -> Block | None:
        local = _plain(t)
        return None if local is None else self.blocks.get(id(local.untyped_storage()))


class _ResizeWatch:
    """While a stand-in is active, ``torch.UntypedStorage.resize_`` reports to it (``resize_`` is a
    storage method, not an aten op: no dispatch mode sees it)."""

    def __init__(self) -> None:
        self.active: list[StreamStandIn] = []
        self.original: Callable[..., Any] | None = None  # set while patched

    def push(self, device: StreamStandIn) -> None:
        if not self.active:
            assert "resize_" not in vars(torch.UntypedStorage), "UntypedStorage.resize_ is patched already"
            original = self.original = torch.UntypedStorage.resize_
            active = self.active

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                before = storage.nbytes()
                result = original(storage, size)
                if active:
                    active[-1].resized(storage, before, storage.nbytes())
                return result

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self.active.append(device)

    def pop(self, device: StreamStandIn) -> None:
        if device in self.active:
            self.active.remove(device)
        if not self.active and self.original is not None:
            del torch.UntypedStorage.resize_  # (inherited from torch._C.StorageBase again)
            self.original = None


_RESIZE = _ResizeWatch()


def _plain(t: Any) -> torch.Tensor | None:
    """The tensor whose storage an op touches (a DTensor's local tensor), or None."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if not isinstance(t, torch.Tensor) or t.is_meta or t.untyped_storage().nbytes() == 0:
        return None
    return t
