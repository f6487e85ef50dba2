"""Receiver: applies what a ``Sender`` sends into a plain module by name, or hands it to ``load_weights``.

Everything a send carries is checked before anything is applied: the header against the target (every
name known, shapes equal, dtypes of a kind the target takes, a full send covering every target tensor),
then the payload (each tensor's or record's checksum, each record inside its tensor). Only when every
receiver and every trainer rank reported success does the leader's verdict commit, and then the
receiver writes: a failed send leaves the target as it was, and every rank raises the same error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checkpoint.boxes import Box
from . import checksum, delta, wire
from .errors import WeightSyncError, short_list
from .sender import DEFAULT_TIMEOUT_S, message
from .stats import SyncStats

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r} in the header; fix: the same torch on both sides")
    return value


class Receiver:
    """Receives a ``Sender``'s weights into ``target``: an ``nn.Module`` (tensors written in place by their
    ``state_dict`` names; tied tensors once) or a ``load_weights(iterable of (name, tensor))`` callable (an
    inference engine's; called with the tensors of each send, the changed ones for a delta).

    ``group``: the Sender's process group; ``src``: the Sender's leader (the lowest trainer rank; default
    the lowest other rank of ``group``). ``strict`` (module targets): a full send must cover every tensor
    of the target. With a callable and a delta-sending Sender the receiver keeps the last values (the
    model's size in the wire dtype) to apply deltas to.
    """

    def __init__(self, target: nn.Module | LoadWeights, *, group: dist.ProcessGroup | None, src: int | None = None,
                 strict: bool = True, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.channel = wire.Channel(group, timeout, "Receiver.receive")
        if src is None:
            src = min(r for r in self.channel.ranks if r != self.channel.rank)
        self.channel.check_peer(src, "src")
        if not isinstance(target, nn.Module) and not callable(target):
            raise WeightSyncError(f"Receiver: target must be an nn.Module or a load_weights callable, found "
                                  f"{type(target).__name__}")
        self.target = target
        self.src = src
        self.strict = strict
        self.state: list[Any] | None = None  # [session, seq] of the last send applied
        self.mirror: dict[str, torch.Tensor] | None = None  # callable targets fed deltas

    # ------------------------------------------------------------------------------------------------
    def receive(self) -> SyncStats:
        """Receive one send (call once per ``Sender.send``). Returns the stats; raises ``WeightSyncError``
        (the target unchanged) when the send failed on any rank."""
        ch = self.channel
        ch.control_bytes = 0
        header = ch.recv_json(self.src, "the header")
        t0 = time.perf_counter()  # (waiting for the trainers to start the send is not counted)
        problem = None
        try:
            tensors = self._check_header(header)
        except Exception as e:
            problem, tensors = message(e), []
        ch.send_json({"error": problem, "state": self.state}, self.src, "this receiver's readiness")
        go = ch.recv_json(self.src, "the go message")
        if go["error"]:
            raise WeightSyncError(f"Receiver.receive: nothing was applied: {go['error']}")
        mode = go["mode"]
        bucket = int(header["bucket_bytes"])
        received = elements = 0
        if mode == "full":
            total = sum(wire.aligned(math.prod(s) * d.itemsize) for _, s, d in tensors)
            payload = wire.receive_payload(ch, self.src, total, bucket, "a payload bucket")
            trailer = ch.recv_json(self.src, "the trailer")
            received = total
            work: list[tuple[int, torch.Tensor]] = []
            try:
                work = self._check_full(tensors, payload, trailer)
                elements = sum(math.prod(tensors[i][1]) for i, _ in work)
            except Exception as e:
                problem = problem or message(e)
        else:
            records: list[tuple[int, Box, torch.Tensor | None, torch.Tensor]] = []
            for r in header["trainers"]:
                head = ch.recv_json(r, f"trainer rank {r}'s record list")
                payload = wire.receive_payload(ch, r, int(head["bytes"]), bucket, "a payload bucket")
                received += int(head["bytes"])
                try:
                    if head.get("error"):
                        raise WeightSyncError(f"trainer rank {r}: {head['error']}")
                    found = self._check_records(tensors, head["records"], payload, r)
                    records += found
                    elements += sum(len(w[2]) if w[2] is not None else 1 for w in found)
                except Exception as e:
                    problem = problem or message(e)
        ch.send_json({"error": problem, "bytes": received}, self.src, "this receiver's report")
        verdict = ch.recv_json(self.src, "the verdict")
        if not verdict["commit"]:
            raise WeightSyncError(f"Receiver.receive: nothing was applied: {verdict['error']}")
        try:
            if mode == "full":
                self._apply_full(tensors, work, keep=bool(header.get("delta")))
            else:
                self._apply_delta(tensors, records)
        except Exception as e:
            self.state = None  # the next send is a full one
            raise WeightSyncError(f"Receiver.receive: applying the committed send failed ({message(e)}); the "
                                  "target may be partly updated; the next send will be a full one") from e
        self.state = [header["session"], header["seq"]]
        return SyncStats(mode, received, time.perf_counter() - t0, len(tensors), elements, ch.control_bytes,
                         int(header["seq"]))

    # ------------------------------------------------------------------------------------------------
    def _check_header(self, header: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if header.get("protocol") != wire.PROTOCOL or header.get("version") != wire.VERSION:
            raise WeightSyncError(
                f"protocol mismatch: the sender speaks {header.get('protocol')!r} version {header.get('version')!r}, "
                f"this receiver {wire.PROTOCOL!r} version {wire.VERSION}; fix: the same fully_shard version on the "
                "trainer and the receiver")
        if header.get("error"):
            raise WeightSyncError(f"the sender failed before sending: {header['error']}")
        if header.get("checksum") != checksum.name_for(self.channel.device):
            raise WeightSyncError(f"protocol mismatch: the sender checksums with {header.get('checksum')!r}, this "
                                  f"receiver with {checksum.name_for(self.channel.device)!r} (different devices for "
                                  "the transfer); fix: one process group backend for both sides")
        tensors = [(str(n), tuple(int(x) for x in s), _dtype(d)) for n, s, d in header["tensors"]]
        if isinstance(self.target, nn.Module):
            self._check_target(tensors)
        return tensors

    def _check_target(self, tensors: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Every sent tensor lands on a target tensor of its shape and dtype kind (and, if strict, covers them all)."""
        assert isinstance(self.target, nn.Module)
        have = self.target.state_dict(keep_vars=True)
        unexpected = [n for n, _, _ in tensors if n not in have]
        lines = []
        if unexpected and self.strict:
            lines.append(f"  names the target does not have: {short_list(unexpected)}")
        for n, shape, dtype in tensors:
            if n not in have:
                continue
            t = have[n]
            if tuple(t.shape) != shape:
                lines.append(f"  {n}: shape {list(shape)} sent, the target's is {list(t.shape)}")
            elif _kind(t.dtype) != _kind(dtype):
                lines.append(f"  {n}: dtype {dtype} sent, the target's {t.dtype} cannot take it (a {_kind(dtype)} "
                             f"tensor into a {_kind(t.dtype)} one)")
        owners: dict[int, str] = {}
        for n, _, _ in tensors:
            if n in have:
                first = owners.setdefault(id(have[n]), n)
                if first != n:
                    lines.append(f"  {first} and {n} are one tied tensor in the target but two tensors sent")
        if self.strict:
            covered = set(owners)
            missing = [n for n, t in have.items() if id(t) not in covered]
            if missing:
                lines.append(f"  target tensors no sent tensor fills: {short_list(missing)}")
        if lines:
            raise WeightSyncError("the sent tensors do not fit the target:\n" + "\n".join(lines) + "\n  fix: "
                                  "the same architecture on both sides, or a key_map on the Sender that names the "
                                  "target's tensors (strict=False ignores missing and unexpected names)")

    def _check_full(self, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], payload: torch.Tensor,
                    trailer: dict[str, Any]) -> list[tuple[int, torch.Tensor]]:
        if trailer.get("error"):
            raise WeightSyncError(f"the leader failed while sending: {trailer['error']}")
        index = {n: i for i, (n, _, _) in enumerate(tensors)}
        names, offsets, sums = trailer["names"], trailer["offsets"], trailer["checksums"]
        if sorted(names) != sorted(index) or len(offsets) != len(names) or len(sums) != len(names):
            raise WeightSyncError("protocol mismatch: the trailer does not list the header's tensors; fix: the same "
                                  "fully_shard version on both sides")
        work = []
        for name, off, expected in zip(names, offsets, sums):
            i = index[name]
            _, shape, dtype = tensors[i]
            n = math.prod(shape) * dtype.itemsize
            if not 0 <= off <= payload.numel() - n:
                raise WeightSyncError(f"{name}: the trailer places it outside the payload; fix: the same fully_shard "
                                      "version on both sides")
            data = payload[off:off + n]
            if checksum.checksum(data) != expected:
                raise WeightSyncError(f"{name}: checksum mismatch (the bytes received differ from the bytes sent); "
                                      "fix: check the transport (NCCL/gloo, network); the send can be repeated")
            work.append((i, data.view(dtype).view(shape)))
        return work

    def _check_records(self, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], records: list[Any],
                       payload: torch.Tensor, rank: int) -> list[tuple[int, Box, torch.Tensor | None, torch.Tensor]]:
        """Each record inside its tensor, its checksum right, its positions inside its box: (tensor, box,
        positions (None: a 0-dim tensor), values)."""
        out = []
        for rec in records:
            i, offsets, sizes, kind, count, off, expected = rec
            if not (isinstance(i, int) and 0 <= i < len(tensors)):
                raise WeightSyncError(f"trainer rank {rank}: a record names tensor #{i!r}, the header lists "
                                      f"{len(tensors)}; fix: the same fully_shard version on both sides")
            name, shape, dtype = tensors[i]
            box = Box(tuple(offsets), tuple(sizes))
            if len(box.offsets) != len(shape) or len(box.sizes) != len(shape) or any(
                    o < 0 or s < 0 or o + s > d for o, s, d in zip(box.offsets, box.sizes, shape)):
                raise WeightSyncError(f"{name}: trainer rank {rank} sent a delta for block {offsets}+{sizes}, outside "
                                      f"its shape {list(shape)}; fix: the same model on every trainer rank")
            try:
                where_n, values_n = delta.record_size(kind, int(count), box.numel, dtype.itemsize)
            except (TypeError, ValueError) as e:
                raise WeightSyncError(f"{name}: trainer rank {rank} sent a malformed record: {e}") from None
            start = wire.aligned(where_n)
            if not (isinstance(off, int) and off >= 0 and off % wire.ALIGN == 0
                    and off <= payload.numel() - (start + values_n)):
                raise WeightSyncError(f"{name}: trainer rank {rank}'s record lies outside its payload; fix: the same "
                                      "fully_shard version on both sides")
            data = payload[off:off + start + values_n]
            if checksum.checksum(data) != expected:
                raise WeightSyncError(f"{name}: checksum mismatch in the delta from trainer rank {rank} (the bytes "
                                      "received differ from the bytes sent); fix: check the transport; the send can "
                                      "be repeated")
            try:
                positions = delta.positions(kind, data[:where_n], int(count), box.numel)
            except ValueError as e:
                raise WeightSyncError(f"{name}: trainer rank {rank}'s delta record is malformed: {e}") from None
            values = data[start:].view(dtype)
            out.append((i, box, positions if shape else None, values))
        return out

    # ------------------------------------------------------------------------------------------------
    def _apply_full(self, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                    work: list[tuple[int, torch.Tensor]], *, keep: bool) -> None:
        if isinstance(self.target, nn.Module):
            have = self.target.state_dict(keep_vars=True)
            with torch.no_grad():
                for i, value in work:
                    name = tensors[i][0]
                    if name in have:
                        have[name].copy_(value)
            self.mirror = None
            return
        named = [(tensors[i][0], value) for i, value in work]
        self.mirror = dict(named) if keep else None
        self.target(iter(named))

    def _apply_delta(self, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                     work: list[tuple[int, Box, torch.Tensor | None, torch.Tensor]]) -> None:
        if isinstance(self.target, nn.Module):
            have = self.target.state_dict(keep_vars=True)
            dests = {i: have[tensors[i][0]] for i, _, _, _ in work if tensors[i][0] in have}
        else:
            if self.mirror is None:
                raise WeightSyncError("a delta arrived but this receiver keeps no values to apply it to")
            dests = {i: self.mirror[tensors[i][0]] for i, _, _, _ in work}
        with torch.no_grad():
            for i, box, positions, values in work:
                dest = dests.get(i)
                if dest is None:
                    continue
                if positions is None:
                    dest.copy_(values.reshape(()))
                    continue
                delta.write(dest[box.slices()], positions, values)
        if not isinstance(self.target, nn.Module):
            changed = sorted({i for i, _, _, _ in work})
            self.target(iter([(tensors[i][0], dests[i]) for i in changed]))
