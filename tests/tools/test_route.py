"""The route one step walks through the library's files (fully_shard/tools/route.py, benchmarks/hops.py).

Issue 29's bound: one whole all-gather (blocks.1's pre-forward: its wait and copy-out, blocks.2's copy-in and
issue) crosses at most 6 files in at most 75 hops, and one forward + backward at most 900 hops (the code
before the stream verbs and the gather plan: 122 hops over 11 files, 1,238 for the step). Hops are counted
from the Python profile of the library's own frames, so the figures are deterministic: the same code takes
the same path on every run.
"""

from __future__ import annotations

from typing import Any

from fully_shard import fully_shard
from fully_shard.tools.route import Event, Route, legs, step_route
from tests.distributed.harness import distributed


@distributed(world_size=2)
def _route() -> dict[str, Any]:
    route = step_route(fully_shard, "ours")
    gather = legs(route, "ours")["pre-forward"]
    return {"gather_hops": gather.hops, "gather_files": gather.files, "hops": route.hops}


def test_one_all_gather_and_one_step_stay_within_the_bound() -> None:
    for rank, r in enumerate(_route()):
        assert r["gather_hops"] <= 75 and len(r["gather_files"]) <= 6, (rank, r)
        assert r["hops"] <= 900, (rank, r)


def test_hops_count_changes_of_the_running_file() -> None:
    """A call into another file and its return are two hops; a call within a file none; leaving the
    library and coming back (the stack empty in between) none."""
    a, b = "/fully_shard/a.py", "/fully_shard/b.py"
    events = [Event("call", a, "f"), Event("call", a, "g"), Event("return", a, "g"),  # within a: 0
              Event("call", b, "h"), Event("call", b, "i"), Event("return", b, "i"),  # a -> b: 1
              Event("return", b, "h"),  # b -> a: 1
              Event("return", a, "f"),  # a -> outside: 0
              Event("call", b, "j"), Event("return", b, "j")]  # outside -> b -> outside: 0
    route = Route(tuple(events))
    assert route.hops == 2 and route.calls == 5 and route.files == [a, b]
    assert [r.calls for r in route.segments("f")] == [4] and route.segments("f")[0].hops == 2
