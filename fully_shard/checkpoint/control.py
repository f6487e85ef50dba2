"""Control-plane collectives for checkpointing: phases that agree on failure, arrive within a timeout, and JSON.

Messages travel as UTF-8 JSON in uint8 tensors (never pickle) over a separate gloo process group, so a
checkpoint call that times out never leaves the training process group with a half-issued collective.
Without an initialized process group everything degrades to a one-rank no-op, so save/load/consolidate
also work in a plain single process.

``phase`` is the rule that keeps errors from hanging a job: every phase of save/load runs inside
``with control.phase(what):``. At its end every rank reports to rank 0 (point to point, each wait bounded
by ``timeout``) its phase label and its error if any; rank 0 answers every rank with one verdict. So
every rank raises the same CheckpointError when any rank failed, when a rank did not arrive within the
timeout (naming the ranks), or when ranks are in different calls (a different path, save vs load).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from ..parallel.mesh import default_device
from .errors import CheckpointError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_MIN_WAIT_S = 0.05  # a message already in flight at the deadline still counts as arrived
_MESSAGE_BYTES = 2048  # a phase report or verdict fits in one message of this size (longer ones take two)

# (the default process group it was made for, the checkpoint's own gloo group)
_CONTROL: tuple[Any, dist.ProcessGroup] | None = None


def as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    """``timeout`` as a timedelta: seconds if a number, DEFAULT_TIMEOUT if None; must be positive."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    out = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
    if out.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return out


class Control:
    """The default process group (or a single process) as seen by the checkpoint code."""

    def __init__(self, timeout: datetime.timedelta | float | None = None) -> None:
        self.on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        self.timeout = as_timedelta(timeout)
        # of the default group, for broadcast_tensor (state dicts)
        self.device = default_device() if self.on else torch.device("cpu")

    @classmethod
    def single(cls) -> Control:
        """A one-rank view, for single-process tools (consolidate) even inside a distributed job."""
        control = cls.__new__(cls)
        control.on, control.rank, control.world, control.device = False, 0, 1, torch.device("cpu")
        control.timeout = DEFAULT_TIMEOUT
        return control

    @property
    def multi(self) -> bool:
        return self.on and self.world > 1

    # ------------------------------------------------------------------------------------------------
    # The checkpoint's gloo group and bounded waits.

    def _group(self, what: str) -> dist.ProcessGroup:
        global _CONTROL
        world = dist.group.WORLD
        if _CONTROL is None or _CONTROL[0] is not world:
            try:
                _CONTROL = (world, dist.new_group(backend="gloo", timeout=self.timeout))
            except Exception as e:
                raise CheckpointError(
                    f"{what}: not every rank started a checkpoint call within {self._seconds} (creating the "
                    f"checkpoint's process group failed: {type(e).__name__}: {_first_line(e)}); fix: call "
                    "save/load on every rank, at the same point of the program") from None
        return _CONTROL[1]

    @property
    def _seconds(self) -> str:
        return f"the timeout of {self.timeout.total_seconds():g} s"

    def _wait(self, issue: Callable[[], Any], deadline: float, what: str, problem: str) -> None:
        """Issue a collective (``issue()`` returns its work) and wait for it until ``deadline``; either failing
        (a peer that timed out closes its connections: the next send to it fails at once) is a CheckpointError."""
        try:
            issue().wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), _MIN_WAIT_S)))
        except Exception as e:
            _forget_group()  # a timed-out gloo group is unusable; a later call makes a new one
            raise CheckpointError(f"{what}: {problem} within {self._seconds} ({_first_line(e)}); fix: every rank "
                                  "must call save/load together; a rank that hangs, died or skipped the call "
                                  "is the cause (see its log)") from None

    def _send(self, obj: Any, dst: int, deadline: float, what: str) -> None:
        """One fixed-size message (length + the JSON's start), then the rest of a long JSON if any."""
        group = self._group(what)
        data = json.dumps(obj, allow_nan=False).encode()
        head = bytearray(_MESSAGE_BYTES)
        head[:8] = len(data).to_bytes(8, "little")
        head[8: 8 + len(data)] = data[: _MESSAGE_BYTES - 8]
        problem = f"rank {dst} did not arrive (it did not take this rank's report)"
        self._wait(lambda: dist.isend(torch.frombuffer(head, dtype=torch.uint8), dst, group), deadline, what, problem)
        if len(data) > _MESSAGE_BYTES - 8:
            rest = torch.frombuffer(bytearray(data[_MESSAGE_BYTES - 8:]), dtype=torch.uint8)
            self._wait(lambda: dist.isend(rest, dst, group), deadline, what, problem)

    def _recv_rest(self, head: torch.Tensor, src: int, deadline: float, what: str, problem: str) -> Any:
        raw = bytes(head.numpy())
        size = int.from_bytes(raw[:8], "little")
        data = raw[8: 8 + min(size, _MESSAGE_BYTES - 8)]
        if size > _MESSAGE_BYTES - 8:
            rest = torch.empty(size - (_MESSAGE_BYTES - 8), dtype=torch.uint8)
            self._wait(lambda: dist.irecv(rest, src, self._group(what)), deadline, what, problem)
            data += bytes(rest.numpy())
        return json.loads(data)

    def _recv(self, src: int, deadline: float, what: str, problem: str) -> Any:
        head = torch.empty(_MESSAGE_BYTES, dtype=torch.uint8)
        self._wait(lambda: dist.irecv(head, src, self._group(what)), deadline, what, problem)
        return self._recv_rest(head, src, deadline, what, problem)

    # ------------------------------------------------------------------------------------------------
    # Phases.

    @contextlib.contextmanager
    def phase(self, what: str, on_error: Callable[[], None] | None = None,
              facts: dict[str, Any] | None = None) -> Iterator[None]:
        """Run the body, then agree across ranks: if it raised on any rank, raise on every rank (collective).

        ``what`` must be the same on every rank (it names the call, its path and the phase). ``facts``
        (JSON values, filled in by the body) must be equal on every rank, else every rank raises naming
        the fact and the ranks (compared by digest; the values travel only when they differ).
        ``on_error`` runs on every rank before the common CheckpointError propagates (cleanup).
        Only ``Exception`` is converted: ``KeyboardInterrupt`` and ``SystemExit`` propagate unchanged on
        the rank that got them, without another collective, because an interrupt means "stop now" and
        must not wait for peers; those peers then fail within ``timeout``, naming the rank that did not
        arrive.
        """
        error: Exception | None = None
        try:
            yield
        except Exception as e:
            error = e
        try:
            self.agree(error, what, facts or {})
        except CheckpointError:
            if on_error is not None:
                on_error()
            raise

    def agree(self, error: BaseException | None, what: str, facts: dict[str, Any] | None = None) -> None:
        """Collective: raise the same CheckpointError on every rank if any rank's ``error`` is set, a rank
        did not arrive within the timeout, a rank is at another phase/path, or ``facts`` differ."""
        facts = facts or {}
        message = None if error is None else (str(error) if isinstance(error, CheckpointError) else
                                              f"{type(error).__name__}: {error}\n"
                                              f"{''.join(traceback.format_exception(error)[-3:])}")
        report = {"label": what, "error": message, "facts": {k: _digest(v) for k, v in sorted(facts.items())}}
        if not self.multi:
            verdict: dict[str, Any] = {"error": _failure_text(what, {0: message}), "differ": []}
        elif self.rank == 0:
            verdict = self._judge(what, report)
        else:
            deadline = time.monotonic() + 2 * self.timeout.total_seconds()
            self._send(report, 0, deadline, what)
            verdict = self._recv(0, deadline, what, "rank 0 did not answer (it did not arrive at this phase, or "
                                                    "waits for another rank)")
        if verdict["error"] is not None:
            raise CheckpointError(verdict["error"]) from error
        if verdict["differ"]:
            raise CheckpointError(self._difference(what, verdict["differ"], facts))

    def _judge(self, what: str, mine: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: collect every rank's report (bounded), send back the common verdict."""
        group = self._group(what)
        deadline = time.monotonic() + self.timeout.total_seconds()
        heads = {r: torch.empty(_MESSAGE_BYTES, dtype=torch.uint8) for r in range(1, self.world)}
        posted: dict[int, Any] = {}
        missing = []
        for r, head in heads.items():
            try:
                posted[r] = dist.irecv(head, r, group)
            except Exception:  # its connection is gone (it timed out in an earlier phase, or died)
                missing.append(r)
        reports: dict[int, Any] = {0: mine}
        for r, work in posted.items():
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), _MIN_WAIT_S)))
            except Exception:
                missing.append(r)
                continue
            reports[r] = self._recv_rest(heads[r], r, deadline + _MIN_WAIT_S, what,
                                         f"rank {r} did not finish its report")
        others = {r: rep["label"] for r, rep in reports.items() if rep["label"] != what}
        verdict: dict[str, Any] = {"error": None, "differ": []}
        if missing:
            verdict["error"] = (
                f"{what}: rank(s) {_ranks(missing)} did not arrive within {self._seconds}; they are elsewhere "
                "(training, in another collective, idle, hung or dead); fix: call save/load on every rank at the "
                "same point of the program (a rank that skipped a step after an exception is a common cause)")
        elif others:
            first = min(others)
            verdict["error"] = (f"{what}: rank(s) {_ranks(sorted(others))} are in another checkpoint call; rank "
                                f"{first} is at {others[first]!r}; fix: every rank must call the same save/load "
                                "with the same path")
        else:
            verdict["error"] = _failure_text(what, {r: rep["error"] for r, rep in reports.items()})
            verdict["differ"] = sorted({k for rep in reports.values() for k in rep["facts"]
                                        if rep["facts"].get(k) != mine["facts"].get(k)})
        for r in sorted(reports):
            if r != 0:
                self._send(verdict, r, deadline + self.timeout.total_seconds(), what)
        if missing:
            _forget_group()
        return verdict

    def _difference(self, what: str, names: list[str], facts: dict[str, Any]) -> str:
        """The message for facts that differ between ranks (collective: every rank gets the same text)."""
        gathered = self.all_gather_json({k: facts.get(k) for k in names}, what)
        lines = []
        for name in names:
            ranks = [r for r, g in enumerate(gathered) if _digest(g[name]) != _digest(gathered[0][name])]
            lines.append(f"  {name}: rank(s) {_ranks(ranks)} differ from rank 0: "
                         f"{_compare(gathered[0][name], gathered[ranks[0]][name], ranks[0])}")
        return (f"{what}: the ranks disagree:\n" + "\n".join(lines) + "\n  fix: every rank must pass the same "
                "path, model structure (parameters and buffers) and optimizer (on every rank or on none)")

    # ------------------------------------------------------------------------------------------------
    # JSON collectives (bounded by the timeout).

    def all_gather_json(self, obj: Any, what: str = "checkpoint") -> list[Any]:
        data = json.dumps(obj, allow_nan=False).encode()
        if not self.multi:
            return [json.loads(data)]
        group = self._group(what)
        deadline = time.monotonic() + self.timeout.total_seconds()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        self._wait(lambda: dist.all_gather(sizes, size, group=group, async_op=True), deadline, what,
                   "the ranks did not meet")
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(self.world)]
        self._wait(lambda: dist.all_gather(out, buf, group=group, async_op=True), deadline, what,
                   "the ranks did not meet")
        return [json.loads(bytes(o[: int(s.item())].numpy())) for o, s in zip(out, sizes)]

    def broadcast_json(self, obj: Any, src: int = 0, what: str = "checkpoint") -> Any:
        if not self.multi:
            return obj
        group = self._group(what)
        deadline = time.monotonic() + self.timeout.total_seconds()
        data = json.dumps(obj, allow_nan=False).encode() if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(lambda: dist.broadcast(size, src, group=group, async_op=True), deadline, what,
                   "the ranks did not meet")
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.rank == src and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._wait(lambda: dist.broadcast(buf, src, group=group, async_op=True), deadline, what,
                   "the ranks did not meet")
        return json.loads(bytes(buf.numpy()))

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` (same shape/dtype on every rank) in place, as raw bytes, on the default group."""
        if not self.multi or tensor.numel() == 0:
            return
        flat = tensor.reshape(-1)
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            raise ValueError("broadcast_tensor needs a contiguous tensor")
        raw = flat.view(torch.uint8)
        moved = raw.to(self.device)
        dist.broadcast(moved, src)
        if moved is not raw:
            raw.copy_(moved)


def _failure_text(what: str, messages: dict[int, str | None]) -> str | None:
    failed = [(r, m) for r, m in sorted(messages.items()) if m is not None]
    if not failed:
        return None
    first_rank, first = failed[0]
    return f"{what} failed on rank(s) {_ranks([r for r, _ in failed])}; rank {first_rank} reports:\n{first}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def _digest(value: Any) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(value, sort_keys=True, allow_nan=False).encode())


def _compare(base: Any, other: Any, rank: int, limit: int = 8) -> str:
    """What rank ``rank`` has that rank 0 has not (and vice versa): keys of dicts, else the two values."""
    if isinstance(base, dict) and isinstance(other, dict):
        parts = []
        for label, keys in ((f"only on rank {rank}", sorted(set(other) - set(base))),
                            ("only on rank 0", sorted(set(base) - set(other))),
                            ("different", sorted(k for k in set(base) & set(other) if base[k] != other[k]))):
            if keys:
                parts.append(f"{label}: {keys[:limit]}{' ...' if len(keys) > limit else ''}")
        return "; ".join(parts)
    return f"rank {rank} has {_short(other)}, rank 0 has {_short(base)}"


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _forget_group() -> None:
    global _CONTROL
    _CONTROL = None
