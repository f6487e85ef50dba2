"""The wire: control messages (JSON) and payload buckets between trainer ranks and receivers, bounded in time.

Everything goes point to point over the one process group the caller gives (the trainer ranks and the
receivers): a JSON message is its length (one int64) then its UTF-8 bytes; a payload is cut into
buckets of at most ``bucket_bytes``, sent in order. Every wait is bounded by the timeout and a wait
that runs out raises a ``WeightSyncError`` naming the peer, the message and the fix. The messages of
one send, in order (design/weights.md "The protocol"):

    leader -> receivers   HEADER  protocol, version, session, seq, the tensors (names, shapes, dtypes)
    receivers -> leader   READY   ok or the error (unknown name, shape, dtype); the state it holds
    leader -> all         GO      the mode (full or delta) or the error that stops the send
    full:  leader -> receivers     payload buckets, then TRAILER (offsets, checksums, error)
    delta: each trainer -> receivers   RANKHEAD (records, checksums, error), then its payload buckets
    trainers -> leader    STATUS  ok or the error of the rank's part
    receivers -> leader   REPORT  ok or the error (checksum, record, protocol)
    leader -> all         VERDICT commit, or the error every rank raises (nothing was applied)
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .errors import WeightSyncError

PROTOCOL = "fully_shard.weights"
VERSION = 1
ALIGN = 16  # every tensor and record starts at a multiple of this many bytes of its payload


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Channel:
    """Point-to-point messages over ``group`` with bounded waits; ``device``: where its tensors live."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float, what: str) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise WeightSyncError(f"{what}: torch.distributed is not initialized; fix: init_process_group() on "
                                  "every trainer and receiver process, then pass a group holding them")
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)
        self.rank = dist.get_rank()
        if self.rank not in self.ranks:
            raise WeightSyncError(f"{what}: this process (rank {self.rank}) is not in the group of ranks {self.ranks}; "
                                  "fix: pass the group that holds the trainer ranks and the receiver(s)")
        backend = str(dist.get_backend(self.group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        if timeout <= 0:
            raise WeightSyncError(f"{what}: timeout must be > 0 seconds, found {timeout!r}")
        self.timeout = float(timeout)
        self.what = what
        self.control_bytes = 0

    def check_peer(self, rank: int, role: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank not in self.ranks or rank == self.rank:
            raise WeightSyncError(f"{self.what}: {role} must be another rank of the group {self.ranks} (a global "
                                  f"rank), found {rank!r}; fix: pass the {role}'s global rank")

    def wait(self, work: Any, peer: int, message: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # a timeout, or the peer's process died
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise WeightSyncError(
                f"{self.what}: {message} did not complete with rank {peer} within {self.timeout:g} s ({first}); fix: "
                "call Sender.send() on every trainer rank and Receiver.receive() on every receiver, once per "
                "send; a rank that is elsewhere, hung or dead is the cause") from None

    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        return dist.isend(tensor, dst, group=self.group)

    def irecv(self, tensor: torch.Tensor, src: int) -> Any:
        return dist.irecv(tensor, src, group=self.group)

    def send_json(self, obj: Any, dst: int, message: str) -> None:
        data = json.dumps(obj, allow_nan=False).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.wait(self.isend(size, dst), dst, message)
        if data:
            body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            self.wait(self.isend(body, dst), dst, message)
        self.control_bytes += 8 + len(data)

    def send_json_to(self, obj: Any, dsts: Sequence[int], message: str) -> None:
        for dst in dsts:
            self.send_json(obj, dst, message)

    def recv_json(self, src: int, message: str) -> Any:
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self.wait(self.irecv(size, src), src, message)
        n = int(size.item())
        if n < 0 or n > 1 << 31:
            raise WeightSyncError(f"{self.what}: {message} from rank {src} announced {n} bytes; the peer speaks "
                                  "another protocol; fix: use the same fully_shard version on both sides")
        body = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self.wait(self.irecv(body, src), src, message)
        self.control_bytes += 8 + n
        try:
            return json.loads(bytes(body.cpu().numpy()))
        except ValueError:
            raise WeightSyncError(f"{self.what}: {message} from rank {src} is not a message of this protocol; fix: "
                                  "use the same fully_shard version on both sides, one Sender per Receiver group"
                                  ) from None


class BucketWriter:
    """Appends bytes to a payload sent in buckets of ``bucket_bytes`` to ``dsts``: two bucket buffers, so one
    is filled while the other is on the wire (each refilled only after its sends completed)."""

    def __init__(self, channel: Channel, dsts: Sequence[int], bucket_bytes: int, message: str) -> None:
        self.channel = channel
        self.dsts = list(dsts)
        self.size = bucket_bytes
        self.message = message
        self.buffers = [torch.empty(0, dtype=torch.uint8, device=channel.device) for _ in range(2)]
        self.works: list[list[tuple[Any, int]]] = [[], []]
        self.current = 0
        self.fill = 0
        self.sent = 0  # payload bytes put on the wire (per destination)

    def _buffer(self) -> torch.Tensor:
        buf = self.buffers[self.current]
        if buf.numel() == 0:
            buf = self.buffers[self.current] = torch.empty(self.size, dtype=torch.uint8, device=self.channel.device)
        return buf

    def write(self, data: torch.Tensor) -> None:
        """Append ``data`` (uint8, flat, on the channel's device)."""
        pos = 0
        n = data.numel()
        while pos < n:
            buf = self._buffer()
            take = min(n - pos, self.size - self.fill)
            buf[self.fill:self.fill + take].copy_(data[pos:pos + take])
            self.fill += take
            pos += take
            if self.fill == self.size:
                self._flush()

    def pad_to(self, total: int) -> None:
        """Append zero bytes until ``total`` bytes were written."""
        missing = total - (self.sent + self.fill)
        while missing > 0:
            buf = self._buffer()
            take = min(missing, self.size - self.fill)
            buf[self.fill:self.fill + take].zero_()
            self.fill += take
            missing -= take
            if self.fill == self.size:
                self._flush()

    def _flush(self) -> None:
        if self.fill == 0:
            return
        chunk = self.buffers[self.current][:self.fill]
        self.works[self.current] = [(self.channel.isend(chunk, dst), dst) for dst in self.dsts]
        self.sent += self.fill
        self.fill = 0
        self.current ^= 1
        self._drain(self.current)  # the other buffer: its sends must be done before it is refilled

    def _drain(self, index: int) -> None:
        for work, dst in self.works[index]:
            self.channel.wait(work, dst, self.message)
        self.works[index] = []

    def close(self) -> None:
        """Send what is left and wait for every send."""
        self._flush()
        self._drain(0)
        self._drain(1)


def receive_payload(channel: Channel, src: int, total: int, bucket_bytes: int, message: str) -> torch.Tensor:
    """The ``total`` bytes a ``BucketWriter`` sends, in the same buckets, into one staging tensor (at most
    two receives in flight)."""
    out = torch.empty(total, dtype=torch.uint8, device=channel.device)
    pending: list[Any] = []
    for start in range(0, total, bucket_bytes):
        pending.append(channel.irecv(out[start:start + bucket_bytes], src))
        if len(pending) == 2:
            channel.wait(pending.pop(0), src, message)
    for work in pending:
        channel.wait(work, src, message)
    return out


def as_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous tensor's bytes, flat, on ``device``."""
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).to(device)
