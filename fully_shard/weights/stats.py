"""SyncStats: what one ``Sender.send`` or ``Receiver.receive`` moved and how long it took."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SyncStats:
    """``mode``: "full" or "delta". ``bytes``: payload bytes this rank sent (a Sender, summed over the
    receivers) or received from every sender (a Receiver); headers and control messages not counted
    (``control_bytes``). ``seconds``: the call's wall time (a Receiver's from the header's arrival:
    waiting for the trainers to start the send is not counted). ``tensors``: tensors in the send;
    ``elements``: elements on the wire (every element for a full send, the changed ones for a delta)."""

    mode: str
    bytes: int
    seconds: float
    tensors: int
    elements: int
    control_bytes: int = 0
    seq: int = 0  # the send's number (1 for the first) in this Sender's session
