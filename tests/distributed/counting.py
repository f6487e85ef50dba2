"""Count the c10d collectives a block issues (at the dispatcher, independent of our own trace)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

NAMES = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
         "allreduce_": "all_reduce", "broadcast_": "broadcast", "allgather_": "all_gather_list"}


class CountCollectives(TorchDispatchMode):
    """``with CountCollectives() as c: ...; c.counts == {"all_gather": 4, ...}``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = func._overloadpacket
        if packet.__module__.endswith("c10d") or "c10d" in str(packet):
            name = str(packet).split(".")[-1]
            self.counts[NAMES.get(name, name)] += 1
        return func(*args, **(kwargs or {}))
