"""Control-plane collectives for checkpointing: JSON exchange and collective failure agreement.

Messages travel as UTF-8 JSON in uint8 tensors (never pickle). Without an initialized process group
everything degrades to a one-rank no-op, so save/load/consolidate also work in a plain single process.
``phase`` is the rule that keeps errors from hanging a job: every phase of save/load runs inside
``with comm.phase(what):``, which ends with every rank agreeing; if any rank failed, every rank raises
the same CheckpointError naming the failing rank.
"""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .errors import CheckpointError


class Comm:
    """The default process group (or a single process) as seen by the checkpoint code."""

    def __init__(self) -> None:
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        self.device = torch.device("cpu")
        if self.on and "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())

    @classmethod
    def single(cls) -> Comm:
        """A one-rank view, for single-process tools (consolidate) even inside a distributed job."""
        comm = cls.__new__(cls)
        comm.on, comm.rank, comm.world, comm.device = False, 0, 1, torch.device("cpu")
        return comm

    def all_gather_json(self, obj: Any) -> list[Any]:
        data = json.dumps(obj, allow_nan=False).encode()
        if not self.on or self.world == 1:
            return [json.loads(data)]
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        buf = buf.to(self.device)
        out = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(out, buf)
        return [json.loads(bytes(o[: int(s.item())].cpu().numpy())) for o, s in zip(out, sizes)]

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        if not self.on or self.world == 1:
            return obj
        data = json.dumps(obj, allow_nan=False).encode() if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.rank == src and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        buf = buf.to(self.device)
        dist.broadcast(buf, src)
        return json.loads(bytes(buf.cpu().numpy()))

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` (same shape/dtype on every rank) in place, as raw bytes (any dtype)."""
        if not self.on or self.world == 1 or tensor.numel() == 0:
            return
        flat = tensor.reshape(-1)
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            raise ValueError("broadcast_tensor needs a contiguous tensor")
        raw = flat.view(torch.uint8)
        moved = raw.to(self.device)
        dist.broadcast(moved, src)
        if moved is not raw:
            raw.copy_(moved)

    def any_true(self, flag: bool) -> bool:
        if not self.on or self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def agree(self, error: BaseException | None, phase: str) -> None:
        """Collective: raise the same CheckpointError on every rank if any rank's ``error`` is set."""
        if not self.any_true(error is not None):
            return
        message = None
        if error is not None:
            message = str(error) if isinstance(error, CheckpointError) else (
                f"{type(error).__name__}: {error}\n{''.join(traceback.format_exception(error)[-3:])}")
        messages = self.all_gather_json(message)
        failed = [(r, m) for r, m in enumerate(messages) if m is not None]
        first_rank, first = failed[0]
        ranks = ", ".join(str(r) for r, _ in failed)
        text = f"{phase} failed on rank(s) {ranks}; rank {first_rank} reports:\n{first}"
        raise CheckpointError(text) from error

    @contextlib.contextmanager
    def phase(self, what: str, on_error: Callable[[], None] | None = None) -> Iterator[None]:
        """Run the body, then agree across ranks: if it raised on any rank, raise on every rank (collective).

        ``on_error`` runs on every rank before the common CheckpointError propagates (cleanup). Only
        ``Exception`` is converted: ``KeyboardInterrupt`` and ``SystemExit`` propagate unchanged on the
        rank that got them, without another collective, because an interrupt means "stop now" and must
        not wait for peers; those peers then fail in their next collective (the job is going down).
        """
        error: Exception | None = None
        try:
            yield
        except Exception as e:
            error = e
        try:
            self.agree(error, what)
        except CheckpointError:
            if on_error is not None:
                on_error()
            raise

    def barrier(self) -> None:
        if self.on and self.world > 1:
            self.any_true(False)
