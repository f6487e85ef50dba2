"""Where collectives run and in what order: dedicated streams + events on accelerators, async work on CPU.

See design/streams.md. One ``CommContext`` per root holds the streams and tells the whole stream protocol
of the two directions, each as a verb pair the core calls with its data callbacks: ``all_gather`` /
``finish_all_gather`` and ``reduce_scatter`` (+ ``all_reduce_replicas`` for HSDP) / ``finish_reduce`` (+
``run_hook``); ``start_forward``, ``end_forward`` and ``end_backward`` are the iteration's bookkeeping. Each
verb has two branches: the accelerator's (streams, events) and the CPU's (the host runs in order, the
collective is issued asynchronously), so the stream stand-in (tests/distributed/stream_standin.py) drives
exactly this code. It also holds the two pieces of cross-stream memory bookkeeping that replace
``record_stream``:

* ``all_gather_state``: the previous all-gather buffer and the event recorded after its copy-out.
  The next unshard makes the copy-in stream wait on that event before dropping the buffer, which
  bounds the buffers in flight to two and keeps the caching allocator from reusing one too early.
* ``reduce_scatter_states``: the reduce-scatter inputs in flight (allocated on the compute stream),
  each with the event recorded after its collective; the compute stream waits on it before dropping
  it, when more than ``set_reduce_scatter_max_input_buffers`` would be held, and at the end of backward.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from . import trace


@dataclass
class Pending:
    """A collective in flight: its future (CPU; the work handle where the backend has none) or an event
    on its stream (accelerator).

    On CPU only the future is kept, not the work: the backend holds the work, and with it the
    collective's input and its own temporaries, until the collective is done, then drops them in its
    thread. So a reduce-scatter input is freed when its collective ends, not when it is waited
    (design/streams.md)."""

    work: dist.Work | None = None
    future: torch.futures.Future[Any] | None = None
    event: Any = None  # torch.Event recorded on the collective's stream after it was issued
    waited: bool = False
    timing: trace.CollectiveTiming | None = None  # only while a trace observer is registered
    held: Any = None  # what the collective's input was read from, kept alive until waited (a k-partial block)

    def wait(self, ctx: CommContext) -> None:
        if self.waited:
            return
        timing = self.timing
        t0 = time.perf_counter() if timing is not None else 0.0
        if timing is not None and self.event is not None:
            timing.reached = ctx.timing_event(ctx.current_stream())
        if self.future is not None:
            self.future.wait()
        elif self.work is not None:
            self.work.wait()
        if self.event is not None:
            ctx.current_stream().wait_event(self.event)
        if timing is not None:
            timing.t_wait = t0
            timing.exposed_s = time.perf_counter() - t0
        self.waited = True
        self.held = None  # (the consumer now follows the copy-in that read it: free to reuse)

    def done(self) -> bool:
        if self.future is not None:
            return bool(self.future.done())
        if self.work is not None:
            return bool(self.work.is_completed())
        if self.event is not None:
            return bool(self.event.query())
        return True


_NO_STREAM = contextlib.nullcontext()  # stateless: one object serves every (nested) use
_stand_in: Any = None  # a device module standing in for torch.cuda (tests; see ``stand_in``)


@contextlib.contextmanager
def stand_in(device_module: Any) -> Iterator[None]:
    """Contexts created inside the block take the accelerator branch on ``device_module`` (an object
    with torch.cuda's ``Stream``, ``Event``, ``current_stream`` and ``stream``) whatever their device:
    the CUDA branch's stream and buffer ordering runs on CPU tensors and gloo, through a stand-in that
    simulates the streams and checks the caching allocator's rule (tests/distributed/stream_standin.py,
    design/streams.md)."""
    global _stand_in
    previous, _stand_in = _stand_in, device_module
    try:
        yield
    finally:
        _stand_in = previous


class CommContext:
    """The streams of one root, the order an all-gather and a reduce follow on them (the verbs), and the
    cross-stream buffer bookkeeping shared by all groups under the root."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accelerated = device.type != "cpu" or _stand_in is not None
        self.all_gather_state: tuple[torch.Tensor, Any] | None = None
        # the reduce-scatter inputs in flight, oldest first: (buffer, event after its collective)
        self.reduce_scatter_states: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()
        self.copy_in_ordered = False  # the copy-in stream waited on compute this iteration (order_copy_in)
        self.grad_offload_event: Any = None  # after the last asynchronous grad copy to the host (offload)
        self.post_optim_event: Any = None  # set_post_optim_event: waited once by the next copy-in
        self.active_reduction: Any = None  # finalize_backward(async_op=True)'s handle until waited (core/finalize.py)
        if self.accelerated:
            mod = _stand_in if _stand_in is not None else torch.get_device_module(device)
            # Higher priority for the all-gather streams so the next unit's params arrive first.
            self.all_gather_copy_in_stream = mod.Stream(device=device, priority=-1)
            self.all_gather_stream = mod.Stream(device=device, priority=-1)
            self.reduce_scatter_stream = mod.Stream(device=device, priority=-1)
            self.all_reduce_stream = mod.Stream(device=device)
            self._mod = mod

    # --- the all-gather --------------------------------------------------------------------------
    def all_gather(self, copy_in: Callable[[], torch.Tensor],
                   collective: Callable[[torch.Tensor, bool], dist.Work | None], *, after: Any = None,
                   prepare: Callable[[], bool] | None = None, hold: Any = None) -> tuple[torch.Tensor, Pending]:
        """Issue one all-gather; returns the gathered buffer and what ``finish_all_gather`` waits on.

        In order: the copy-in follows the optimizer step that updated the shards (once per iteration:
        ``order_copy_in``); ``prepare()`` runs on compute (a tensor-subclass unit's first unshard: its
        pre-hooks and the every-rank layout check) and where it returns True the copy-in follows compute
        too; on the copy-in stream the previous gathered buffer is let go once
        its copy-out has read it, ``after`` (an event recorded on compute: the k-partial block's write) is
        waited, and ``copy_in()`` allocates the buffer and writes this rank's segment; the all-gather stream
        waits for the copy-in and ``collective(buffer, async_op)`` is issued there, an event marking its end.
        ``hold`` (what the copy-in read) stays alive until the all-gather is waited. On CPU the host runs the
        copy-in in order and the collective is issued asynchronously."""
        if not self.accelerated:
            self.order_copy_in(None)
            if prepare is not None:
                prepare()
            out = copy_in()
            timing = trace.CollectiveTiming() if trace.observers else None
            pending = self.issued(collective(out, True), timing)
        else:
            copy_in_stream = self.all_gather_copy_in_stream
            self.order_copy_in(copy_in_stream)
            if prepare is not None and prepare():
                copy_in_stream.wait_stream(self.current_stream())
            with self._mod.stream(copy_in_stream):
                self.release_all_gather_buffer()
                if after is not None:
                    copy_in_stream.wait_event(after)
                out = copy_in()
            self.all_gather_stream.wait_stream(copy_in_stream)
            pending = self.issue("all_gather", partial(collective, out))
        pending.held = hold
        return out, pending

    def finish_all_gather(self, out: torch.Tensor, pending: Pending, copy_out: Callable[[torch.Tensor], None], *,
                          hold: bool, event: trace.TraceEvent | None = None) -> float:
        """Wait for an all-gather (the compute stream on accelerators, the host on CPU), run
        ``copy_out(buffer)``, then let the buffer go once the copy-in stream has seen the copy-out
        (accelerators; on CPU it is dropped at once: nothing else reads it). ``hold`` (forward, where the
        next unit's all-gather follows): the buffer is kept until that all-gather's copy-in instead, so
        its collective need not wait for this copy-out; backward and explicit unshards hold nothing, so
        no gathered buffer outlives the backward into the optimizer step (as torch). While observed,
        returns the seconds the host blocked in the wait and fills ``event`` (the all-gather's trace
        event)."""
        timed = event is not None or bool(trace.observers)  # (the clock is read only for an observer)
        t0 = time.perf_counter() if timed else 0.0
        pending.wait(self)
        exposed = time.perf_counter() - t0 if timed else 0.0
        if event is not None:
            event.t_end = time.perf_counter()
            event.exposed_s = exposed
        copy_out(out)
        if self.accelerated:
            self.all_gather_state = (out, self.current_stream().record_event())
            if not hold:
                self.release_all_gather_buffer()
        return exposed

    def compute_event(self) -> Any:
        """An event after the work queued on compute so far, for a later copy-in to wait on (``after``);
        None on CPU."""
        return self.current_stream().record_event() if self.accelerated else None

    # --- the reduce --------------------------------------------------------------------------------
    def reduce_scatter(self, copy_in: Callable[[], torch.Tensor],
                       collective: Callable[[torch.Tensor, torch.Tensor | None, bool], dist.Work | None], *,
                       output: Callable[[], torch.Tensor] | None = None,
                       keep_inputs: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, Pending]:
        """Issue one reduce-scatter; returns its input, its output (None: written in place into the input,
        gloo's all-reduce) and what ``finish_reduce`` waits on.

        In order: held reduce-scatter inputs beyond ``keep_inputs`` are let go once compute has waited on
        their collectives (the caching allocator may hand their blocks to the copy-in at once);
        ``copy_in()`` allocates and packs the input on compute; the reduce-scatter stream waits for it,
        ``output()`` is allocated there (None: the collective reduces the input in place) and
        ``collective(input, output, async_op)`` issued there, an event marking its end; the input is held
        until compute has waited on that event. On CPU the host runs in order and the collective is
        issued asynchronously."""
        if self.reduce_scatter_states:  # (accelerators)
            self.release_reduce_scatter_inputs(keep=keep_inputs)
        inp = copy_in()
        if not self.accelerated:
            out = output() if output is not None else None
            timing = trace.CollectiveTiming() if trace.observers else None
            return inp, out, self.issued(collective(inp, out, True), timing)
        stream = self.reduce_scatter_stream
        stream.wait_stream(self.current_stream())
        with self._mod.stream(stream):
            out = output() if output is not None else None
        pending = self.issue("reduce_scatter", lambda async_op: collective(inp, out, async_op))
        self.reduce_scatter_states.append((inp, pending.event))  # until its collective is done
        return inp, out, pending

    def all_reduce_replicas(self, reduce_scatter: Pending, accumulate: Callable[[], torch.Tensor | None],
                            collective: Callable[[torch.Tensor, bool], dist.Work | None]) -> tuple[
                                torch.Tensor | None, Pending | None]:
        """HSDP: the replicas' all-reduce of a reduce-scattered shard, issued as soon as its reduce-scatter
        is done, on its own stream, so it overlaps the next unit's backward. ``accumulate()`` runs on the
        reduce-scatter stream after the reduce-scatter (which wrote both operands of a partial sum under
        ``set_requires_all_reduce(False)``) and returns the shard to all-reduce, or None to keep summing;
        the all-reduce stream then waits for it and ``collective(shard, async_op)`` is issued there. On CPU,
        where nothing else orders one collective after another, the host waits for the reduce-scatter."""
        self.order_after("all_reduce", reduce_scatter)  # (CPU: the host waits, so accumulate sees it)
        if not self.accelerated:
            output = accumulate()
            return (None, None) if output is None else (output, self.issue("all_reduce", partial(collective, output)))
        with self._mod.stream(self.reduce_scatter_stream):
            output = accumulate()
        if output is None:
            return None, None
        self.all_reduce_stream.wait_stream(self.reduce_scatter_stream)
        return output, self.issue("all_reduce", partial(collective, output))

    def finish_reduce(self, reduce_scatter: Pending, all_reduce: Pending | None) -> None:
        """Wait for one reduce's collectives (the compute stream on accelerators, the host on CPU)."""
        reduce_scatter.wait(self)
        if all_reduce is not None:
            all_reduce.wait(self)

    def run_hook(self, hook: Callable[[], None], stream: Any = None) -> None:
        """Run ``hook()`` on ``stream`` (default: the all-reduce stream) after compute, and compute after
        it (``set_all_reduce_hook``); on CPU on the host."""
        if not self.accelerated:
            hook()
            return
        stream = stream or self.all_reduce_stream
        stream.wait_stream(self.current_stream())
        with self._mod.stream(stream):
            hook()
        self.current_stream().wait_stream(stream)

    # --- the iteration's bookkeeping --------------------------------------------------------------
    def start_forward(self) -> None:
        """The root's forward begins: its first copy-in orders after compute (the optimizer step) again."""
        self.copy_in_ordered = False

    def end_forward(self) -> None:
        """The root's forward ended: let go of the last gathered buffer (not held through the head and
        the loss, as torch)."""
        self.release_all_gather_buffer()

    def end_backward(self, *, reduces_finished: bool, step_ended: bool) -> None:
        """A backward ended. ``reduces_finished``: every reduce it issued was finished, so the held
        reduce-scatter inputs go (not held through the optimizer step, as torch) and the host waits for
        the gradients' copies to it (CPU offload) before anything on it reads them. ``step_ended``: the
        step's backward (not one inside a list unit's open pass): the next copy-in orders after compute
        again."""
        if reduces_finished:
            self.release_reduce_scatter_inputs()
            self.sync_grad_offload()
        if step_ended:
            self.copy_in_ordered = False

    # --- stream helpers (no-ops on CPU) ---------------------------------------------------------
    def current_stream(self) -> Any:
        return self._mod.current_stream(self.device) if self.accelerated else None

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Run the block on ``stream``; ``None`` (CPU): a shared null context, no generator per call."""
        if stream is None:
            return _NO_STREAM
        return self._mod.stream(stream)  # type: ignore[no-any-return]

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        if waiter is not None:
            waiter.wait_stream(waitee)

    def record_event(self, stream: Any) -> Any:
        return stream.record_event() if stream is not None else None

    def timing_event(self, stream: Any) -> Any:
        """A timing-enabled event recorded on ``stream`` (tracing only; accelerators only)."""
        return stream.record_event(self._mod.Event(enable_timing=True))

    def order_after(self, stream_name: str, pending: Pending) -> None:
        """Order what is issued next on the named stream after ``pending``'s collective: an event wait
        on accelerators (the host goes on); on CPU, where nothing else orders work, the host waits."""
        if not self.accelerated:
            pending.wait(self)
        elif pending.event is not None:
            self.stream(stream_name).wait_event(pending.event)

    def order_copy_in(self, copy_in_stream: Any) -> None:
        """Order all-gather copy-ins after the optimizer step that updated the shards, once per
        iteration (torch waits once, too: later copy-ins, backward prefetches included, would only
        queue behind unrelated compute): after the compute stream, or after ``set_post_optim_event``'s
        event only. On CPU the host already runs the step first; the event (``torch.Event`` or any
        object with ``synchronize()`` or ``wait()``) is waited on the host. ``start_forward`` and
        ``end_backward(step_ended=True)`` re-arm it."""
        if self.copy_in_ordered:
            return
        self.copy_in_ordered = True
        event, self.post_optim_event = self.post_optim_event, None
        if event is None:
            self.wait_stream(copy_in_stream, self.current_stream())
        elif self.accelerated:
            copy_in_stream.wait_event(event)
        else:
            (getattr(event, "synchronize", None) or event.wait)()

    def stream(self, name: str) -> Any:
        """``all_gather_copy_in`` | ``all_gather`` | ``reduce_scatter`` | ``all_reduce`` (None on CPU)."""
        return getattr(self, f"{name}_stream") if self.accelerated else None

    # --- the two pieces of bookkeeping ------------------------------------------------------------
    def release_all_gather_buffer(self) -> None:
        """Before a new all-gather buffer is allocated: let go of the previous one once its copy-out
        (on the compute stream) has finished reading it."""
        if self.all_gather_state is not None:
            _, event = self.all_gather_state
            if event is not None:
                self.stream("all_gather_copy_in").wait_event(event)
            self.all_gather_state = None

    def release_reduce_scatter_inputs(self, *, keep: int = 0) -> None:
        """Let go of the oldest held reduce-scatter inputs until ``keep`` remain, each once the compute
        stream (which allocated it) has waited on the event after its collective: the caching
        allocator may hand a freed block to the next compute allocation at once."""
        while len(self.reduce_scatter_states) > keep:
            _, event = self.reduce_scatter_states.popleft()
            if event is not None:
                self.current_stream().wait_event(event)

    def hold_grad_offload_event(self) -> None:
        """CPU offload: grads were just copied to the host asynchronously on the current stream."""
        self.grad_offload_event = self.record_event(self.current_stream())

    def sync_grad_offload(self) -> None:
        """End of backward: the host waits for the grads' copies before anything on it reads them (the
        optimizer step, accumulation) or overwrites the shards the last all-gather copied from."""
        event, self.grad_offload_event = self.grad_offload_event, None
        if event is not None:
            event.synchronize()

    def discard_in_flight(self) -> None:
        """``reset_iter_state``: drop the held buffers once the streams that read them are done."""
        self.release_all_gather_buffer()
        self.release_reduce_scatter_inputs()
        self.sync_grad_offload()
        self.post_optim_event = None
        self.copy_in_ordered = False

    @staticmethod
    def issued(work: dist.Work | None, timing: trace.CollectiveTiming | None) -> Pending:
        """CPU: what to wait on for ``work``, a collective just issued with ``async_op=True`` (``issue``'s
        CPU branch, for a caller that issued it itself; ``timing`` made before it was issued, while
        observed)."""
        if work is None:
            return Pending(timing=timing)
        try:
            future: torch.futures.Future[Any] | None = work.get_future()
        except RuntimeError:  # a backend without futures: keep the work handle
            future = None
        if timing is not None:
            _time_completion(future, timing)
        return Pending(work=work if future is None else None, future=future, timing=timing)

    def issue(self, stream_name: str, fn: Callable[[bool], dist.Work | None]) -> Pending:
        """Issue ``fn(async_op)`` on the named stream; return what to wait on before using its output.

        On accelerators the collective is issued synchronously inside the stream (the backend orders
        its own stream after it) and an event marks completion; on CPU it is issued with
        ``async_op=True`` and the work handle is waited just before use, so it overlaps compute.
        """
        timing = trace.CollectiveTiming() if trace.observers else None
        if not self.accelerated:
            return self.issued(fn(True), timing)
        stream = self.stream(stream_name)
        with self.on(stream):
            if timing is None:
                fn(False)
                return Pending(event=self.record_event(stream))
            timing.start = self.timing_event(stream)
            fn(False)
            timing.end = self.timing_event(stream)
            return Pending(event=timing.end, timing=timing)


def _time_completion(future: torch.futures.Future[Any] | None, timing: trace.CollectiveTiming) -> None:
    """Tracing on CPU: stamp ``timing.t_done`` from the backend's thread when the work completes."""
    def done(_: Any) -> None:
        timing.t_done = time.perf_counter()

    if future is not None:  # else the profiler uses the wait's end
        future.add_done_callback(done)
