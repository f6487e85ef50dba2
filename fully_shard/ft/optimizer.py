"""FaultTolerantOptimizer: ``zero_grad()`` starts the step's quorum, ``step()`` commits it or not.

The wrapper torchft's ``OptimizerWrapper`` is, with the recovery state kept on the training thread
(recovery.py, design/fault-tolerance.md):

- ``zero_grad()``: capture the recovery state (this step boundary), then ``manager.start_quorum()``. With
  the synchronous quorum a heal arrives inside it: it is applied there, before the forward.
- ``step()``: ``manager.should_commit()`` (a heal received during the step is checked there, kept
  pending); the replica group's vote decides for all its ranks at once. Voted yes: the pending heal is
  written, then the optimizer steps. Voted no: the pending heal is dropped and the manager's step count
  put back to where this replica's state is, so the next quorum heals it again; nothing was written on
  any rank of the group. A peer whose shards do not fit raises ``ShardLayoutError`` here, after the vote
  (which it failed), on every rank that received such state.

States (``Phase``): ``IDLE`` between steps, ``STEP`` from ``zero_grad()`` to ``step()``, ``FAILED``
after a ``ShardLayoutError`` (this replica's state no longer matches the manager's step count: every
later call raises it again).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

from .layout import ShardLayoutError
from .recovery import RecoveryState

__all__ = ["FaultTolerantOptimizer", "Phase"]


class Phase(enum.Enum):
    IDLE = "idle"  # between steps: step() done (or nothing yet)
    STEP = "step"  # zero_grad() started the quorum; forward and backward run
    FAILED = "failed"  # a peer's state did not fit: this replica must be restarted


class FaultTolerantOptimizer(Optimizer):
    """An optimizer whose steps commit only with a healthy quorum (returned by ``fault_tolerant()``).

    Like torchft's ``OptimizerWrapper`` it does not call ``Optimizer.__init__``: ``param_groups``,
    ``state``, ``state_dict()`` and ``load_state_dict()`` are the wrapped optimizer's."""

    def __init__(self, optimizer: Optimizer, *, manager: Any, recovery: RecoveryState, async_quorum: bool) -> None:
        self.optim = optimizer
        self.manager = manager
        self.recovery = recovery
        self.async_quorum = async_quorum
        self.phase = Phase.IDLE
        self.committed: bool | None = None  # the last step()'s vote
        self.healed = 0  # heals applied on this replica
        self._pre_heal: dict[str, int] | None = None

    # --- the wrapped optimizer ----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._require(Phase.IDLE, "load_state_dict")
        self.optim.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("FaultTolerantOptimizer.add_param_group: every replica group must hold the same param "
                           "groups from the start (recovery copies the optimizer state group by group). Fix: put "
                           "all groups in the optimizer before fault_tolerant().")

    def __repr__(self) -> str:
        return f"FaultTolerantOptimizer({self.optim!r}, phase={self.phase.name})"

    # --- the step protocol --------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step: capture the recovery state, start the quorum (a synchronous quorum heals
        here), zero the gradients."""
        self._require(Phase.IDLE, "zero_grad")
        self.recovery.capture()
        self._pre_heal = self.manager.state_dict()  # the step count this replica's state is at
        self.manager.start_quorum()
        self.phase = Phase.STEP
        if not self.async_quorum:
            self._raise_if_refused()
            if self.recovery.apply_pending():  # before the forward, which must use the healed weights
                self.healed += 1
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Commit this step if the quorum agrees (then step the wrapped optimizer); see the module doc."""
        if closure is not None:
            raise TypeError("FaultTolerantOptimizer.step: closures are not supported (the step is decided by the "
                            "quorum after backward). Fix: compute the loss and backward before step().")
        self._require(Phase.STEP, "step")
        self.phase = Phase.IDLE
        ok = bool(self.manager.should_commit())
        self.committed = ok
        self._raise_if_refused()
        if self.recovery.has_pending:
            if ok:
                self.recovery.apply_pending()
                self.healed += 1
            else:  # the group voted no: no rank writes; the next quorum heals this replica again
                self.recovery.drop_pending()
                assert self._pre_heal is not None
                self.manager.load_state_dict(self._pre_heal)
        if ok:
            self.optim.step()

    def _raise_if_refused(self) -> None:
        error = self.recovery.error
        if error is not None:
            self.phase = Phase.FAILED
            assert self._pre_heal is not None
            self.manager.load_state_dict(self._pre_heal)
            raise error

    def _require(self, expected: Phase, method: str) -> None:
        """The one guard on phase transitions: ``method`` may only run in ``expected``."""
        if self.phase is expected:
            return
        if self.phase is Phase.FAILED:
            error = self.recovery.error
            raise ShardLayoutError(f"FaultTolerantOptimizer.{method}(): this replica failed to heal and must be "
                                   f"restarted; the failure was:\n{error}")
        hint = ("call optimizer.zero_grad() at the start of every step (it starts the quorum)" if expected is Phase.STEP
                else "call optimizer.step() to end the step zero_grad() started")
        raise RuntimeError(f"FaultTolerantOptimizer.{method}(): expected phase {expected.name}, found "
                           f"{self.phase.name}. Fix: {hint}.")
