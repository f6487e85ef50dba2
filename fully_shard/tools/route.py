"""Route: the files of a library that one block of Python walks through, counted as hops between files.

Shared by ``benchmarks/hops.py`` (this library against torch's ``fully_shard``) and ``tests/tools/test_route.py``
(the bound on one all-gather and one step). How it counts (the method of issue 29's measurement):

- ``record`` runs a callable under ``sys.setprofile`` and keeps the ``call`` and ``return`` events of the
  frames whose file lies in the library (``marker``: a piece of the path, e.g. ``"/fully_shard/"``), with
  the file (from the marker on) and the function's qualified name. Only the calling thread is traced.
- A stack of files follows the events: on a call the running file is the callee's, on a return the
  caller's (the frame below on the stack; outside the library when the stack is empty). A **hop** is a
  change of the running file from one library file to another.
- A **segment** is one top-level call of a named function (e.g. ``FSDPState.pre_forward_hook``), from its
  call event to its return: one hook's whole route.

``step_route`` is the standard measurement: a 3-block MLP (``Linear(64, 256) -> relu -> Linear(256, 64)``
plus a residual per block, a ``Linear(64, 8)`` head on the root) sharded block by block and at the root, 2
warm-up steps (forward, backward, AdamW step), then one forward and backward recorded. ``LEGS`` names each
library's hooks and which top-level call is ``blocks.1``'s; ``legs`` cuts a route into them.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.nn as nn

__all__ = ["LEGS", "MARKERS", "Event", "Route", "legs", "record", "step_route"]

# The files of each library: (a piece of the path, a piece that excludes it)
MARKERS = {"ours": ("/fully_shard/", "/site-packages/torch/"), "torch": ("torch/distributed/fsdp/_fully_shard/", None)}
# leg -> (ours' hook, torch's hook, which top-level call of it is blocks.1's)
LEGS: dict[str, tuple[str, str, int]] = {
    # blocks.1's wait and copy-out, plus blocks.2's copy-in and issue (ours prefetches it implicitly; torch
    # issues it in blocks.2's own pre-forward): one whole all-gather in both
    "pre-forward": ("FSDPState.pre_forward_hook", "FSDPState._pre_forward", 2),  # root, blocks.0, blocks.1
    "post-forward": ("FSDPState.post_forward_hook", "FSDPState._post_forward", 1),  # blocks.0, blocks.1
    "pre-backward": ("FSDPState.pre_backward", "FSDPState._pre_backward", 2),  # root, blocks.2, blocks.1
    "post-backward": ("_post_backward_backward", "RegisterPostBackwardFunction.backward", 1),  # blocks.2, blocks.1
    "end of backward": ("FSDPState.root_final_callback", "FSDPState._root_post_backward_final_callback", 0),
}


@dataclass(frozen=True, slots=True)
class Event:
    """One Python call or return inside the library."""

    kind: str  # "call" | "return"
    file: str  # the path from the library's marker on, e.g. "/fully_shard/core/group.py"
    qualname: str


def record(fn: Callable[[], Any], *, marker: str, exclude: str | None = None) -> Route:
    """The route ``fn()`` walks through the files whose path contains ``marker`` (and not ``exclude``)."""
    events: list[Event] = []
    files: dict[str, str | None] = {}

    def tag(path: str) -> str | None:
        found = files.get(path, "")
        if found != "":
            return found
        i = path.find(marker)
        skip = i < 0 or (exclude is not None and exclude in path) or path == __file__  # (not this file's lambdas)
        files[path] = None if skip else path[i:]
        return files[path]

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" or event == "return":
            code = frame.f_code
            file = tag(code.co_filename)
            if file is not None:
                events.append(Event(event, file, code.co_qualname))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return Route(tuple(events))


@dataclass(frozen=True)
class Route:
    """Recorded events and what they add up to."""

    events: tuple[Event, ...]

    def _running(self) -> list[str | None]:
        """The running library file after each event (None: outside the library)."""
        stack: list[str] = []
        out: list[str | None] = []
        for e in self.events:
            if e.kind == "call":
                stack.append(e.file)
            elif stack:
                stack.pop()
            out.append(e.file if e.kind == "call" else (stack[-1] if stack else None))
        return out

    def _moves(self) -> list[tuple[str, str]]:
        moves = []
        last: str | None = None
        for now in self._running():
            if now is not None and last is not None and now != last:
                moves.append((last, now))
            if now is not None:
                last = now
            else:
                last = None
        return moves

    @property
    def hops(self) -> int:
        """Changes of the running file from one library file to another."""
        return len(self._moves())

    @property
    def calls(self) -> int:
        return sum(1 for e in self.events if e.kind == "call")

    @property
    def files(self) -> list[str]:
        """The library files entered, in the order first entered."""
        return list(dict.fromkeys(e.file for e in self.events if e.kind == "call"))

    def pairs(self) -> Counter[tuple[str, str]]:
        """Hops per unordered pair of files."""
        return Counter(tuple(sorted(move)) for move in self._moves())  # type: ignore[misc]

    def segments(self, qualname: str) -> list[Route]:
        """Each top-level call of ``qualname`` (no call of it open around it), from its call to its return."""
        out: list[Route] = []
        depth = 0
        start: int | None = None
        for i, e in enumerate(self.events):
            if start is None:
                if e.kind == "call" and e.qualname == qualname:
                    start, depth = i, 1
                continue
            depth += 1 if e.kind == "call" else -1
            if depth == 0:
                out.append(Route(self.events[start:i + 1]))
                start = None
        return out


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _MLP(nn.Module):
    def __init__(self, blocks: int = 3, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def step_route(shard: Callable[[nn.Module], Any], library: str, *, warmup: int = 2) -> Route:
    """The route of one forward + backward of the 3-block MLP sharded by ``shard`` (this library's
    ``fully_shard`` or torch's; ``library``: ``"ours"`` | ``"torch"``, whose files are kept), after ``warmup``
    training steps. Every rank of the default process group runs it."""
    torch.manual_seed(0)
    model = _MLP()
    for block in model.blocks:
        shard(block)
    shard(model)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 64)
    for _ in range(warmup):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    marker, exclude = MARKERS[library]
    return record(lambda: model(x).sum().backward(), marker=marker, exclude=exclude)


def legs(route: Route, library: str) -> dict[str, Route]:
    """Each leg's segment of a ``step_route`` (``LEGS``); an empty route where the hook did not run."""
    out = {}
    for leg, (ours, theirs, index) in LEGS.items():
        found = route.segments(ours if library == "ours" else theirs)
        out[leg] = found[index] if len(found) > index else Route(())
    return out
