"""Every collective of the distributed Muon step: row all-to-alls to and from owners, gather mode, plan check.

Each call records what it moved in an ``ExchangeStats`` (calls and bytes per collective), so tests and
benchmarks count the optimizer's traffic without a dispatcher hook. Bytes are per rank: ``sent`` is what
leaves this rank for other ranks, ``received`` what arrives from them (the own segment of an all-to-all is
a local copy and counts for neither; an all-gather counts ``(W - 1)`` chunks each way, what a ring moves).
bf16 payloads travel as int16 (bit-identical; backends without bf16 collectives accept it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import collectives, trace

__all__ = ["ExchangeStats", "PendingRows", "all_gather_rows", "all_to_all_rows", "check_same_plan"]


@dataclass
class ExchangeStats:
    """Calls and bytes per collective name (``"all_to_all"``, ``"all_gather"``, ``"plan_check"``)."""

    calls: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)
    received: Counter[str] = field(default_factory=Counter)

    def add(self, name: str, sent: int, received: int) -> None:
        self.calls[name] += 1
        self.sent[name] += sent
        self.received[name] += received

    def clear(self) -> None:
        self.calls.clear()
        self.sent.clear()
        self.received.clear()

    def total_sent(self, *, exclude: Sequence[str] = ("plan_check",)) -> int:
        return sum(v for k, v in self.sent.items() if k not in exclude)

    def total_received(self, *, exclude: Sequence[str] = ("plan_check",)) -> int:
        return sum(v for k, v in self.received.items() if k not in exclude)


class PendingRows:
    """An issued collective: ``wait()`` returns its output tensor (in the caller's dtype)."""

    def __init__(self, work: Any, out: torch.Tensor, dtype: torch.dtype) -> None:
        self._work = work
        self._out = out
        self._dtype = dtype

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._out.view(self._dtype) if self._out.dtype != self._dtype else self._out


def _observed(name: str, sent: int, world: int) -> None:
    """The profiler's record of an optimizer collective (``fully_shard.profile``: the step summary)."""
    trace.emit_if_observed(trace.EventKind.OPTIMIZER_COLLECTIVE, trace.OPTIMIZER_UNIT, trace.Phase.OPTIMIZER,
                           nbytes=sent, group_size=world, issued_as=name)


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t


def all_to_all_rows(send: torch.Tensor, *, send_splits: Sequence[int], recv_splits: Sequence[int],
                    group: dist.ProcessGroup, stats: ExchangeStats, async_op: bool = True) -> PendingRows:
    """One ``all_to_all_single`` over ``group`` of a flat buffer: ``send_splits[r]`` elements go to rank
    ``r``, ``recv_splits[r]`` arrive from it (concatenated in rank order)."""
    rank = dist.get_rank(group)
    size = send.element_size()
    out = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    sent = (sum(send_splits) - send_splits[rank]) * size
    stats.add("all_to_all", sent, (sum(recv_splits) - recv_splits[rank]) * size)
    _observed("all_to_all", sent, dist.get_world_size(group))
    work = dist.all_to_all_single(_wire(out), _wire(send.contiguous()), output_split_sizes=list(recv_splits),
                                  input_split_sizes=list(send_splits), group=group, async_op=async_op)
    return PendingRows(work, _wire(out), send.dtype)


def all_gather_rows(local: torch.Tensor, *, chunk: int, group: dist.ProcessGroup, stats: ExchangeStats,
                    async_op: bool = True) -> PendingRows:
    """All-gather a flat buffer padded to ``chunk`` elements per rank; the output is ``[W, chunk]``."""
    world = dist.get_world_size(group)
    if local.numel() > chunk:
        raise ValueError(f"all_gather_rows: expected at most chunk={chunk} elements, found {local.numel()}. "
                         "Fix: pass the largest rank's element count as chunk.")
    padded = torch.zeros(chunk, dtype=local.dtype, device=local.device)
    padded[:local.numel()] = local.reshape(-1)
    out = torch.empty(world * chunk, dtype=local.dtype, device=local.device)
    nbytes = (world - 1) * chunk * local.element_size()
    stats.add("all_gather", nbytes, nbytes)
    _observed("all_gather", nbytes, world)
    work = collectives.all_gather_into(_wire(out), _wire(padded), group, async_op=async_op)
    return PendingRows(work, out.view(world, chunk), local.dtype)


def check_same_plan(digest: str, *, group: dist.ProcessGroup, stats: ExchangeStats, what: str) -> None:
    """Raise unless every rank of ``group`` built the plan with this ``digest`` (once per new plan)."""
    world = dist.get_world_size(group)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    stats.add("plan_check", 0, 0)
    if len(set(digests)) != 1:
        ranks = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(
            f"{what}: the Muon owner plan differs across ranks (expected one plan on all {world} ranks, found "
            f"ranks {ranks} disagreeing with rank 0). Fix: build the optimizer from the same parameters, in the "
            "same order and with the same shapes, on every rank.")
