"""Sender: a training model's weights to one or more receiver processes, every step, full or as deltas.

Constructed on every trainer rank with the same arguments; ``send()`` is called on every trainer rank
at the same point (it is collective over the model's ranks) while each receiver calls
``Receiver.receive()``. The leader (the lowest trainer rank of the group) speaks for the trainers:
it sends the header, decides the mode and the verdict (wire.py lists the messages). A full send is
``iter_full(rank=leader)``: the leader packs each tensor into two alternating buckets. With
``delta=True``, after a committed full send every rank keeps a snapshot of its own parts (parts.py, in
the wire dtype) and later sends only the elements that changed since (delta.py), straight to the
receivers, with no collective among the trainers; the mode falls back to a full send whenever a
receiver does not hold the state the delta builds on (a new or restarted receiver, a failed send).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checkpoint.hf_keys import KeyMap, RenameSpec
from . import checksum, delta, full, naming, parts, wire
from .errors import WeightSyncError
from .stats import SyncStats

DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 300.0


def message(error: BaseException | None) -> str | None:
    if error is None:
        return None
    return str(error) if isinstance(error, WeightSyncError) else f"{type(error).__name__}: {error}"


class Sender:
    """Sends ``model``'s full weights (as ``iter_full`` names and casts them) to the receiver rank(s) ``dst``
    of ``group`` (a process group holding the trainer ranks and the receivers; gloo on CPU, NCCL on GPUs).

    ``dtype``/``key_map``: as ``iter_full``. ``delta=True``: after the first full send, each rank sends
    only the changed elements of its own shard (about 1.1x its shard in the wire dtype kept as the
    snapshot). ``bucket_bytes``: the payload is cut into buckets of at most this size, two in flight.
    ``timeout``: seconds any one wait may take before every rank raises.
    """

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None, dst: int | Sequence[int],
                 dtype: torch.dtype | None = None, key_map: KeyMap | RenameSpec = None, delta: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.channel = wire.Channel(group, timeout, "Sender.send")
        dsts = [dst] if isinstance(dst, int) and not isinstance(dst, bool) else list(dst)  # type: ignore[arg-type]
        if not dsts:
            raise WeightSyncError("Sender: dst names no receiver; fix: pass the receiver's global rank")
        for d in dsts:
            self.channel.check_peer(d, "dst")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < wire.ALIGN:
            raise WeightSyncError(f"Sender: bucket_bytes must be an int >= {wire.ALIGN}, found {bucket_bytes!r}")
        self.receivers = dsts
        self.trainers = [r for r in self.channel.ranks if r not in dsts]
        self.leader = min(self.trainers)
        self.is_leader = self.channel.rank == self.leader
        self.model = model
        self.dtype = dtype
        self.key_map = key_map
        self.delta = bool(delta)
        self.bucket_bytes = bucket_bytes - bucket_bytes % wire.ALIGN
        self.session = secrets.token_hex(8)
        self.seq = 0  # committed sends
        self.snapshot: list[torch.Tensor] | None = None  # this rank's parts at the last committed send
        self.snapshot_key: list[Any] | None = None
        self._parts: tuple[tuple[Any, ...], list[parts.Part]] | None = None  # (the plan's tensors, own parts)
        self._encoder: Any = None  # delta.Encoder, made at the first delta
        naming.plan(model, key_map=key_map, dtype=dtype, what="Sender")  # bad arguments fail here, not at send()

    # ------------------------------------------------------------------------------------------------
    def send(self, *, full_send: bool = False) -> SyncStats:
        """Send the weights (collective over the trainer ranks; each receiver calls ``receive()``).
        ``full_send=True``: a full send even where a delta would do. Returns this rank's stats; raises
        ``WeightSyncError`` on every rank when the send failed anywhere (the receivers then hold what they
        held before)."""
        t0 = time.perf_counter()
        ch = self.channel
        ch.control_bytes = 0
        error: BaseException | None = None
        plan: naming.Plan | None = None
        own: list[parts.Part] = []
        try:
            plan = naming.plan(self.model, key_map=self.key_map, dtype=self.dtype, what="Sender")
            own = self._own_parts(plan)
        except Exception as e:
            error = e
        key = [[p.output, list(p.box.offsets), list(p.box.sizes), str(p.dtype)] for p in own]
        others = [r for r in self.trainers if r != ch.rank]
        # phase 1: header, readiness, mode
        if self.is_leader:
            header = {"protocol": wire.PROTOCOL, "version": wire.VERSION, "session": self.session,
                      "seq": self.seq + 1, "base": self.seq, "delta": self.delta, "trainers": self.trainers,
                      "bucket_bytes": self.bucket_bytes, "checksum": checksum.name_for(ch.device),
                      "tensors": naming.signature(plan.outputs) if plan is not None else [],
                      "error": message(error)}
            ch.send_json_to(header, self.receivers, "the header")
            readies = [ch.recv_json(r, "the receiver's readiness") for r in self.receivers]
            problems = [f"receiver rank {r}: {m['error']}" for r, m in zip(self.receivers, readies) if m.get("error")]
            can_delta = (self.delta and not full_send and self.snapshot is not None and self.snapshot_key == key
                         and all(m.get("state") == [self.session, self.seq] for m in readies))
            go = {"mode": "delta" if can_delta else "full", "error": message(error) or _join(problems)}
            ch.send_json_to(go, others + self.receivers, "the go message")
        else:
            go = ch.recv_json(self.leader, "the go message")
        if go["error"]:
            raise WeightSyncError(go["error"])
        assert plan is not None  # (a planning error was in go["error"])
        mode = str(go["mode"])
        # phase 2: the payload
        status: BaseException | None = None
        sent = elements = 0
        pending: Any = None
        if mode == "full":
            self.snapshot = None  # a full send replaces it (and a failed one leaves none: the next is full)
            sent, elements, status = self._send_full(plan)
            if self.delta and status is None:
                try:
                    pending = [p.values() for p in own]
                except Exception as e:
                    status = e
        else:
            sent, elements, pending, status = self._send_delta(plan, own)
        # phase 3: verdict
        if self.is_leader:
            statuses = [ch.recv_json(r, "a trainer's status") for r in others]
            reports = [ch.recv_json(r, "the receiver's report") for r in self.receivers]
            problems = ([f"trainer rank {ch.rank}: {message(status)}"] if status is not None else [])
            problems += [f"trainer rank {r}: {m['error']}" for r, m in zip(others, statuses) if m.get("error")]
            problems += [f"receiver rank {r}: {m['error']}" for r, m in zip(self.receivers, reports) if m.get("error")]
            verdict = {"commit": not problems, "error": _join(problems)}
            ch.send_json_to(verdict, others + self.receivers, "the verdict")
        else:
            ch.send_json({"error": message(status)}, self.leader, "this rank's status")
            verdict = ch.recv_json(self.leader, "the verdict")
        if not verdict["commit"]:
            raise WeightSyncError(f"Sender.send: nothing was applied (the receivers keep their weights): "
                                  f"{verdict['error']}")
        if mode == "full":
            self.snapshot = pending
            self.snapshot_key = key if pending is not None else None
        else:
            assert self.snapshot is not None
            for i, enc in pending:
                delta.apply(self.snapshot[i], enc)
        self.seq += 1
        return SyncStats(mode, sent, time.perf_counter() - t0, len(plan.outputs), elements, ch.control_bytes,
                         self.seq)

    def _own_parts(self, plan: naming.Plan) -> list[parts.Part]:
        """This rank's parts, found again only when the model's tensors (or the plan) changed: the parts hold
        the tensors, so the ids compared stay theirs."""
        key = (tuple((e.name, id(e.tensor), e.hidden) for e in plan.entries), tuple(map(tuple, naming.signature(
            plan.outputs))))
        if self._parts is None or self._parts[0] != key:
            self._parts = (key, parts.own_parts(plan, leader=self.is_leader))
        return self._parts[1]

    # ------------------------------------------------------------------------------------------------
    def _send_full(self, plan: naming.Plan) -> tuple[int, int, BaseException | None]:
        """Every trainer rank runs the gather; the leader packs and sends. Returns (bytes sent, elements, error)."""
        ch = self.channel
        writer = wire.BucketWriter(ch, self.receivers, self.bucket_bytes, "a payload bucket") \
            if self.is_leader else None
        names, offsets, sums = [], [], []
        error: BaseException | None = None
        elements = pos = 0
        total = sum(wire.aligned(_nbytes(o)) for o in plan.outputs)
        for name, tensor in full.iterate(self.model, plan, rank=self.leader):
            if writer is None or tensor is None or error is not None:
                continue
            try:
                data = wire.as_bytes(tensor, ch.device)
                names.append(name)
                offsets.append(pos)
                sums.append(checksum.checksum(data))
                writer.write(data)
                pos += wire.aligned(data.numel())
                writer.pad_to(pos)
                elements += tensor.numel()
            except WeightSyncError:
                raise
            except Exception as e:
                error = e
        if writer is None:
            return 0, 0, None
        writer.pad_to(total)
        writer.close()
        trailer = {"names": names, "offsets": offsets, "checksums": sums, "error": message(error)}
        ch.send_json_to(trailer, self.receivers, "the trailer")
        return writer.sent * len(self.receivers), elements, error

    def _send_delta(self, plan: naming.Plan, own: list[parts.Part]) -> tuple[int, int, Any, BaseException | None]:
        """Every trainer rank sends its changed elements straight to the receivers."""
        ch = self.channel
        records: list[list[Any]] = []
        pieces: list[torch.Tensor] = []
        pending: list[tuple[int, delta.Encoded]] = []
        error: BaseException | None = None
        elements = pos = 0
        try:
            if self.snapshot is None or len(self.snapshot) != len(own):
                raise WeightSyncError(f"trainer rank {ch.rank} holds no snapshot of its parts for a delta; fix: "
                                      "send(full_send=True)")
            if self._encoder is None:
                self._encoder = delta.Encoder()
            for i, p in enumerate(own):
                enc = self._encoder.encode(p.current(), self.snapshot[i])
                if enc is None:
                    continue
                where, values = enc.where.to(ch.device), enc.values.to(ch.device)
                start = wire.aligned(where.numel())  # the values aligned for their dtype
                record = torch.zeros(wire.aligned(start + values.numel()), dtype=torch.uint8, device=ch.device)
                record[:where.numel()].copy_(where)
                record[start:start + values.numel()].copy_(values)
                records.append([p.output, list(p.box.offsets), list(p.box.sizes), enc.kind, enc.count, pos,
                                checksum.checksum(record[:start + values.numel()])])
                pieces.append(record)
                pending.append((i, enc))
                pos += record.numel()
                elements += enc.count
        except Exception as e:
            error, records, pieces, pending, pos = e, [], [], [], 0
        head = {"records": records, "bytes": pos, "error": message(error)}
        ch.send_json_to(head, self.receivers, "this rank's record list")
        writer = wire.BucketWriter(ch, self.receivers, self.bucket_bytes, "a payload bucket")
        for piece in pieces:
            writer.write(piece)
        writer.close()
        return writer.sent * len(self.receivers), elements, pending, error


def _nbytes(out: naming.Output) -> int:
    n = 1
    for s in out.shape:
        n *= s
    return n * out.dtype.itemsize


def _join(problems: list[str]) -> str | None:
    return "\n".join(problems) if problems else None
