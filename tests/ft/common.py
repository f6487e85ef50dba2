"""A stand-in for torchft's Manager (the calls fully_shard.ft makes, nothing more) and a small sharded model.

The stand-in keeps torchft 0.2.0's order: ``start_quorum`` applies an incoming heal itself only with the
synchronous quorum; ``should_commit`` hands an incoming heal to the registered load callbacks, then
votes (no on a reported error). ``serve()`` is what a peer's transport would carry: the registered
state dicts plus the manager's own, through a ``torch.save``/``torch.load`` round trip (copies, as over
HTTP).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard


class Done:
    def wait(self) -> bool:
        return True


class FakeManager:
    def __init__(self, *, async_quorum: bool = True, init_sync: bool = False) -> None:
        self._use_async_quorum = async_quorum
        self._init_sync = init_sync
        self.loads: dict[str, Any] = {}
        self.saves: dict[str, Any] = {}
        self._user_state_dicts = self.saves  # torchft's name for the registered state_dict callbacks
        self.step = 0
        self.batches = 0
        self.errors: list[Exception] = []
        self.incoming: dict[str, Any] | None = None  # a peer's state, delivered at the next quorum
        self.vote = True
        self.calls: list[str] = []
        self.allreduced = 0

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        assert key not in self.loads
        self.loads[key], self.saves[key] = load, save

    def start_quorum(self) -> None:
        self.calls.append("start_quorum")
        self.errors.clear()
        if not self._use_async_quorum:
            self._deliver()

    def should_commit(self) -> bool:
        self.calls.append("should_commit")
        if self._use_async_quorum:
            self._deliver()
        ok = self.vote and not self.errors
        if ok:
            self.step += 1
        return ok

    def _deliver(self) -> None:
        if self.incoming is None:
            return
        sd, self.incoming = self.incoming, None
        self.load_state_dict(sd["torchft"])
        for key, load in self.loads.items():
            load(sd["user"][key])

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> Done:
        self.allreduced += 1
        return Done()

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "batches_committed": self.batches}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.batches = sd["step"], sd["batches_committed"]

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return 1

    def serve(self) -> dict[str, Any]:
        """What a peer's transport delivers: its state dicts, copied through torch.save/torch.load."""
        buf = io.BytesIO()
        torch.save({"user": {k: f() for k, f in self.saves.items()}, "torchft": self.state_dict()}, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)


def build(seed: int = 0, *, cols: bool = False, hidden: int = 12) -> nn.Sequential:
    """Linear(6, hidden) - Tanh - Linear(hidden, 5), each Linear a unit, then the root (2 ranks: uneven rows)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 5))
    kwargs: dict[str, Any] = {}
    if cols:
        from torch.distributed.tensor import Shard

        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else Shard(0)
    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    return model


def train_step(model: nn.Module, optimizer: Any, step: int) -> None:
    optimizer.zero_grad()
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of this rank's local parameter shards and optimizer state tensors, in a fixed order."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = [local(p) for p in model.parameters()]
    for p in model.parameters():
        out += [local(v) for _, v in sorted(optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
