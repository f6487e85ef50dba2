"""Fault tolerance under torchft: when a replica group dies, the others go on and it heals from a live peer.

``fault_tolerant(model, optimizer, manager=...)`` (api.py) is the one call; it uses the replica all-reduce
hook (hook.py), the optimizer state created up front (optim_state.py), the recovery state captured and
applied on the training thread (recovery.py, checked against the peer's ShardLayout: layout.py) and the
optimizer wrapper that starts and commits each step's quorum (optimizer.py). ``StepSampler``
(sampler.py) keys batches by the manager's step. See docs/ft.md and design/fault-tolerance.md.

Nothing here imports torchft: the manager is passed in (``pip install 'fully_shard[ft]'``), and
``import fully_shard`` does not import this package.
"""

from __future__ import annotations

from .api import STATE_KEY, fault_tolerant
from .hook import ReplicaAllReduce
from .layout import ShardLayout, ShardLayoutError
from .optim_state import create_optimizer_state
from .optimizer import FaultTolerantOptimizer, Phase
from .recovery import RecoveryState
from .sampler import StepSampler

__all__ = ["STATE_KEY", "FaultTolerantOptimizer", "Phase", "RecoveryState", "ReplicaAllReduce", "ShardLayout",
           "ShardLayoutError", "StepSampler", "create_optimizer_state", "fault_tolerant"]
