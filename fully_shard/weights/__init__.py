"""Weights out: a training model's full weights for an inference engine, one unit at a time, with deltas.

``iter_full(model)`` yields ``(name, full tensor)`` gathering one parameter group at a time with one
packed all-gather; ``iter_local(model)`` yields each rank's local shards with their placements and
offsets; ``Sender``/``Receiver`` move the weights between the trainer ranks and receiver processes over a
process group, packed into buckets, full or as deltas of each rank's own shard. See design/weights.md
and docs/weights.md.
"""

from __future__ import annotations

from .errors import WeightSyncError
from .full import iter_full
from .local import LocalShard, iter_local
from .receiver import Receiver
from .sender import Sender
from .stats import SyncStats

__all__ = ["LocalShard", "Receiver", "Sender", "SyncStats", "WeightSyncError", "iter_full", "iter_local"]
