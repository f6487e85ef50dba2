"""Count the c10d collectives a block issues (at the dispatcher), and the same in torch's terms."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from fully_shard.tools.watch import KINDS, CollectiveWatch


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched inside the mode, by packet name (``counts["_chunk_cat"]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class CountCollectives(CollectiveWatch):
    """``with CountCollectives() as c: ...``: ``c.issued`` counts every c10d collective issued in the
    block, by name, at the dispatcher; ``c.counts`` is the same in torch's terms, to compare with
    torch's ``fully_shard`` one for one.

    The one mapping between them (design/data-path.md): on gloo the library performs a unit's
    reduce-scatter as an in-place all-reduce of its own input (gloo's own reduce-scatter is an all-reduce
    of a copy). The library says so in its trace: a ``REDUCE_SCATTER`` event with ``issued_as="all_reduce"``.
    ``counts`` moves exactly those all-reduces back to ``reduce_scatter``; nothing else is renamed, and
    ``issued`` keeps what really went to the backend (tests/core/test_gloo_reduce.py checks both)."""

    def __init__(self) -> None:
        super().__init__()
        self.issued: Counter[str] = Counter()
        self.in_place_reduce_scatters = 0

    @property
    def counts(self) -> Counter[str]:
        out = Counter(self.issued)
        if self.in_place_reduce_scatters:
            out["all_reduce"] -= self.in_place_reduce_scatters
            out["reduce_scatter"] += self.in_place_reduce_scatters
        return +out  # drops zero entries

    def on_collective(self, op: str, args: tuple) -> None:
        self.issued[KINDS.get(op, op)] += 1

    def on_in_place_reduce_scatter(self) -> None:
        self.in_place_reduce_scatters += 1
