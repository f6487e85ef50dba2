"""CollectiveWatch: every c10d collective a block issues, seen at the dispatcher, with the library's trace.

Shared by ``benchmarks/`` (bytes per mesh axis) and ``tests/`` (collective counts against torch's
``fully_shard``). On gloo the library performs a 1-D reduce-scatter as an in-place all-reduce of its own
input and says so in its trace (a ``REDUCE_SCATTER`` event with ``issued_as="all_reduce"``, emitted right
after the all-reduce is issued; design/data-path.md): a watch hears both, so it can count that all-reduce
as the reduce-scatter it stands for.
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from ..comm import trace

__all__ = ["KINDS", "CollectiveWatch"]

# c10d op name -> the collective's name in torch's terms
KINDS = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "allreduce_": "all_reduce", "broadcast_": "broadcast", "allgather_": "all_gather_list"}


class CollectiveWatch(TorchDispatchMode):
    """``with Watch() as w: ...`` calls ``w.on_collective(op, args)`` for every c10d op dispatched inside
    (``op``: the c10d name, e.g. ``allreduce_``) and ``w.on_in_place_reduce_scatter()`` for every
    reduce-scatter the library issued as an in-place all-reduce (after that all-reduce's
    ``on_collective``). Subclasses override the two."""

    def __init__(self) -> None:
        super().__init__()
        self._observing: Any = None

    def on_collective(self, op: str, args: tuple) -> None:
        """One c10d op ``op`` with its dispatcher ``args`` (tensors, process group, options)."""

    def on_in_place_reduce_scatter(self) -> None:
        """The all-reduce just seen stands for a reduce-scatter (gloo's in-place path)."""

    def _on_event(self, event: trace.TraceEvent) -> None:
        if event.kind is trace.EventKind.REDUCE_SCATTER and event.issued_as == "all_reduce":
            self.on_in_place_reduce_scatter()

    def __enter__(self) -> Any:
        self._observing = trace.observe(self._on_event)
        self._observing.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._observing.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = func._overloadpacket
        if packet.__module__.endswith("c10d") or "c10d" in str(packet):
            self.on_collective(str(packet).split(".")[-1], args)
        return func(*args, **(kwargs or {}))
