"""The stream stand-in reports each race kind it models, on small raw-stream programs (no library code).

Each race is a pair: the program with the ordering missing must be reported (naming the block and both
streams), the same program with the ordering in place must not. Together with tests/core/test_streams.py
(which asserts the library's CUDA branch is reported clean) this shows the stand-in can fail.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import pytest
import torch

from tests.distributed.stream_standin import SimStream, StreamStandIn


def _run(program: Callable[[StreamStandIn, SimStream], None]) -> list[str]:
    """``program(device, side)`` under a fresh stand-in (``side``: a second stream); its violations."""
    with StreamStandIn() as device:
        program(device, device.Stream())
        gc.collect()
    return device.violations


def _pair(program: Callable[[StreamStandIn, SimStream, bool], None], *expected: str) -> None:
    """``program(..., ordered=False)`` is reported with ``expected`` in its one violation;
    ``ordered=True`` is clean."""
    racy = _run(lambda device, side: program(device, side, False))
    assert len(racy) == 1, racy
    for text in expected:
        assert text in racy[0], racy
    clean = _run(lambda device, side: program(device, side, True))
    assert clean == [], clean


def test_missing_wait_read_after_write_across_streams() -> None:
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        t = torch.empty(64)
        side.wait_stream(device.current)  # (the allocation on compute happens before side's write)
        with device.stream(side):
            t.fill_(1.0)
            done = side.record_event()
        if ordered:
            device.current.wait_event(done)
        t.sum()  # compute reads what side wrote

    _pair(program, "sum on compute reads empty float32[64]", "all_gather_copy_in's write of it may still run")


def test_free_before_the_other_streams_use_finished_allocator_reuse() -> None:
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        t = torch.ones(64)
        side.wait_stream(device.current)
        with device.stream(side):
            _ = t * 2  # side reads a block allocated on compute
            done = side.record_event()
        if ordered:
            device.current.wait_event(done)
        del t  # back to compute's pool ...
        gc.collect()
        torch.empty(64).fill_(0.0)  # ... and handed to compute's next allocation

    _pair(program, "ones float32[64] (allocated on compute) was freed and may be reallocated on compute",
          "all_gather_copy_in may still use it")


def test_event_recorded_before_the_op() -> None:
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        t = torch.empty(64)
        side.wait_stream(device.current)
        with device.stream(side):
            early = side.record_event()
            t.fill_(1.0)
            late = side.record_event()
        device.current.wait_event(late if ordered else early)
        t.sum()

    _pair(program, "sum on compute reads", "all_gather_copy_in's write of it may still run")


def test_write_after_read_across_streams() -> None:
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        t = torch.ones(64)
        side.wait_stream(device.current)
        with device.stream(side):
            _ = t * 2  # side reads t ...
        if ordered:
            device.current.wait_stream(side)
        t.fill_(3.0)  # ... compute overwrites it

    _pair(program, "fill_ on compute writes ones float32[64] while all_gather_copy_in may still read it")


def test_reuse_of_a_side_stream_block_across_streams() -> None:
    """A block allocated on a side stream (a gathered buffer), read on compute, freed: the side stream's next
    allocation may be it while compute still reads it."""
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        with device.stream(side):
            gathered = torch.ones(64)
            done = side.record_event()
        device.current.wait_event(done)
        _ = gathered * 2  # compute reads it
        if ordered:
            side.wait_event(device.current.record_event())
        del gathered
        gc.collect()
        with device.stream(side):
            torch.empty(64).fill_(0.0)

    _pair(program, "ones float32[64] (allocated on all_gather_copy_in) was freed and may be reallocated on "
          "all_gather_copy_in while compute may still use it")


def test_resize_to_zero_is_a_free() -> None:
    """``untyped_storage().resize_(0)`` frees the block (how unsharded parameters are freed): the same race as a
    ``del``, with the storage object still alive."""
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        t = torch.ones(64)
        side.wait_stream(device.current)
        with device.stream(side):
            _ = t * 2
        if ordered:
            device.current.wait_stream(side)
        t.untyped_storage().resize_(0)
        torch.empty(64).fill_(0.0)

    _pair(program, "ones float32[64] (allocated on compute) was freed", "all_gather_copy_in may still use it")


def test_resize_from_zero_is_an_allocation_on_the_current_stream() -> None:
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        t = torch.ones(64)
        storage = t.untyped_storage()
        storage.resize_(0)
        side.wait_stream(device.current)
        u = torch.ones(64)
        side.wait_stream(device.current)
        with device.stream(side):
            _ = u * 2
        if ordered:
            device.current.wait_stream(side)
        del u
        gc.collect()
        storage.resize_(64 * 4)  # compute allocates: it may get u's block
        t.fill_(1.0)  # (the new block: compute's own allocation, no race of its own)

    _pair(program, "ones float32[64] (allocated on compute) was freed", "may be reallocated on compute")


def test_resize_watch_is_removed_on_exit() -> None:
    with StreamStandIn():
        assert "resize_" in vars(torch.UntypedStorage)
    assert "resize_" not in vars(torch.UntypedStorage)
    t = torch.ones(4)
    t.untyped_storage().resize_(0)  # the original method again
    assert t.untyped_storage().nbytes() == 0


def test_host_reads_an_asynchronous_device_to_host_copy_before_synchronizing() -> None:
    """``pin_memory=True`` tensors are host memory (a CPU build has no pinned allocator: the stand-in makes
    them); a non-blocking copy into one is a DMA the host must synchronize with before reading it."""
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        grad = torch.ones(64)  # device memory
        host = torch.empty(64, pin_memory=True)
        assert host.is_pinned()
        host.copy_(grad, non_blocking=True)  # on compute
        copied = device.current.record_event()
        if ordered:
            copied.synchronize()
        host.sum()  # the optimizer step on the host

    _pair(program, "sum on host reads empty float32[64]", "compute's write of it may still run")


def test_a_dtype_cast_on_the_device_is_a_kernel_not_a_host_copy() -> None:
    """``.to(device, dtype=...)`` of device memory stays device memory, written on the current stream."""
    def program(device: StreamStandIn, side: SimStream, ordered: bool) -> None:
        t = torch.ones(64)
        cast = t.to(torch.device("cpu"), dtype=torch.bfloat16)  # (the stand-in's device is the CPU)
        if ordered:
            side.wait_stream(device.current)
        with device.stream(side):
            cast.mul_(2)

    _pair(program, "mul_ on all_gather_copy_in writes _to_copy bfloat16[64]", "compute's write of it")


def test_query_answers_from_the_clocks() -> None:
    with StreamStandIn() as device:
        side = device.Stream()
        idle = side.record_event()
        assert side.query() and idle.query() and device.Event().query()  # nothing enqueued / never recorded
        with device.stream(side):
            torch.ones(8).mul_(2)
        done = side.record_event()
        assert not side.query() and not done.query()  # enqueued, not synchronized with
        done.synchronize()
        assert done.query() and side.query()
        with device.stream(side):
            torch.ones(8).mul_(2)
        assert not side.query()
        side.synchronize()
        assert side.query()
    assert device.violations == []


def test_synchronize_reads_the_blocks_under_the_lock() -> None:
    """A backend's thread frees storages (the finalizer takes the lock): ``synchronize`` must not iterate the
    blocks meanwhile."""
    with StreamStandIn() as device:
        torch.ones(8)
        finished = threading.Event()
        with device._lock:
            thread = threading.Thread(target=lambda: (device.synchronize(), finished.set()))
            thread.start()
            assert not finished.wait(0.2)  # blocked on the lock
        thread.join(60)
    assert finished.is_set()


@pytest.mark.parametrize("ordered", [False, True])
def test_the_report_names_block_and_streams(ordered: bool) -> None:
    """``check()`` raises with the violations (what a failing test shows)."""
    def program(device: StreamStandIn, side: SimStream) -> None:
        t = torch.empty(16)
        side.wait_stream(device.current)
        with device.stream(side):
            t.fill_(1.0)
        if ordered:
            device.current.wait_stream(side)
        t.sum()

    with StreamStandIn() as device:
        program(device, device.Stream())
    if ordered:
        device.check()
    else:
        with pytest.raises(AssertionError, match=r"1 stream violation\(s\):\nsum on compute reads empty"):
            device.check()
