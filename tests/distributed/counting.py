"""Count the c10d collectives a block issues (at the dispatcher, independent of our own trace)."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

NAMES = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "allreduce_": "all_reduce", "broadcast_": "broadcast", "allgather_": "all_gather_list"}


def _in_reduce_grads() -> bool:
    """Issued by fully_shard's ``Reducer.reduce`` itself (the dispatcher runs in the issuing
    thread), not by a method it calls (HSDP's replica all-reduce is ``_all_reduce_replicas``'s)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith("fully_shard/core/reduce.py") and code.co_name != "<lambda>":
            return code.co_name == "reduce"  # the innermost method in core/reduce.py
        frame = frame.f_back  # type: ignore[assignment]
    return False


class CountCollectives(TorchDispatchMode):
    """``with CountCollectives() as c: ...; c.counts == {"all_gather": 4, ...}``.

    On gloo fully_shard's reduce-scatter is an all-reduce of its own input in place (gloo's
    reduce-scatter is an all-reduce of a copy: design/data-path.md); the all-reduce issued from
    ``Reducer.reduce`` is counted as the operation it performs, ``reduce_scatter``, so counts compare
    with torch's FSDP2 one for one."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = func._overloadpacket
        if packet.__module__.endswith("c10d") or "c10d" in str(packet):
            name = NAMES.get(str(packet).split(".")[-1], str(packet).split(".")[-1])
            if name == "all_reduce" and _in_reduce_grads():
                name = "reduce_scatter"
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))
