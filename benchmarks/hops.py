"""The route one step walks through the library's files: hops, files and calls per hook, ours vs torch's fully_shard.

    python benchmarks/hops.py                # launches 2 gloo ranks itself; rank 0 prints the table
    python benchmarks/hops.py --pairs 8 --json benchmarks/results/hops.json

A 3-block MLP (``Linear(64, 256) -> relu -> Linear(256, 64)`` plus a residual per block, a ``Linear(64, 8)``
head on the root) is sharded block by block and at the root, by this library and by torch's
``fully_shard`` (the same model and input; ``fully_shard/tools/route.py``'s ``step_route``). After 2 warm-up
steps (forward, backward, AdamW step) one forward and backward runs under ``sys.setprofile``, keeping the
calls and returns of the library's own frames (ours: ``fully_shard/``; torch:
``torch/distributed/fsdp/_fully_shard/``). A hop is a change of the running file (route.py says exactly how
it is counted); a leg is one top-level call of a hook, taken for ``blocks.1``:

- pre-forward: blocks.1's wait and copy-out, plus blocks.2's copy-in and issue (our implicit forward
  prefetch; torch issues blocks.2's in its own pre-forward, so the row holds one whole all-gather in both);
- post-forward (reshard), pre-backward (the backward all-gather), post-backward (issue the reduce), and
  the root's end-of-backward callback (finish the reduces, assign ``.grad``).

Hops are deterministic (the same code path every run); ``tests/tools/test_route.py`` holds ours to the
bound of issue 29 (one all-gather <= 75 hops over <= 6 files, a forward + backward <= 900 hops).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import init, launch_if_needed, rank0_print, torch_fully_shard

from fully_shard import fully_shard
from fully_shard.tools.route import LEGS, Route, legs, step_route


def summary(route: Route, library: str) -> dict[str, Any]:
    row = {leg: {"files": len(seg.files), "hops": seg.hops, "calls": seg.calls, "file_list": seg.files}
           for leg, seg in legs(route, library).items()}
    row["whole"] = {"files": len(route.files), "hops": route.hops, "calls": route.calls,
                    "pairs": len(route.pairs()), "file_list": route.files}
    return row


def _cell(d: dict[str, Any]) -> str:
    return f"{d['files']:>3} / {d['hops']:>5} / {d['calls']:>5}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=6, help="the file pairs crossed most in ours' pre-forward")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    launch_if_needed(__file__, args.nproc)
    init("gloo")
    routes = {"ours": step_route(fully_shard, "ours"), "torch": step_route(torch_fully_shard, "torch")}
    result = {library: summary(route, library) for library, route in routes.items()}
    rank0_print(f"hops of one forward + backward, blocks.1's legs; {dist.get_world_size()} gloo ranks, torch "
                f"{torch.__version__}")
    rank0_print(f"{'leg':<17} {'ours: files / hops / calls':>27}   {'torch: files / hops / calls':>27}")
    for leg in (*LEGS, "whole"):
        rank0_print(f"{leg:<17} {_cell(result['ours'][leg]):>27}   {_cell(result['torch'][leg]):>27}")
    rank0_print(f"file pairs crossed (whole): ours {result['ours']['whole']['pairs']}, "
                f"torch {result['torch']['whole']['pairs']}")
    pre = legs(routes["ours"], "ours")["pre-forward"]
    rank0_print("ours' pre-forward files: " + ", ".join(f.removeprefix("/fully_shard/") for f in pre.files))
    for (a, b), n in pre.pairs().most_common(args.pairs):
        rank0_print(f"  {n:>3}  {a.removeprefix('/fully_shard/')} <-> {b.removeprefix('/fully_shard/')}")
    if args.json is not None and dist.get_rank() == 0:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
