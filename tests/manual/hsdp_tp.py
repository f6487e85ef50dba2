"""HSDP x tensor parallel on 8 CPU ranks: a (replicate=2, shard=2, tp=2) mesh, 3-D DTensor parameters.

    python tests/manual/hsdp_tp.py [--steps 5]        # launches its own 8 gloo ranks (torchrun)

The same tiny TP transformer as tests/parallel (q/k/v/up colwise, o/down rowwise, plain norms) is
trained with this library's and torch's fully_shard on mesh["replicate", "shard"] (TP on mesh["tp"])
and with one unsharded copy on the global batch, side by side in the same processes. Prints the
placements (which must equal torch's), the per-step losses and the largest differences; exits non-zero
when a check fails. Not part of the test suite: 8 processes are too many for CI's 2 cores, and the
4-rank (dp=2, tp=2) suite in tests/parallel/test_tp.py covers the same code paths except the leading
Replicate() and the replica all-reduce (covered at 1-D x replicate by tests/policies/test_hsdp.py).
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fully_shard, tests

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fully_shard import fully_shard
from tests.distributed.launch import launch_if_needed, rank0_print
from tests.parallel.tp_common import data, fresh_pair, full, loss_fn, shard_2d, tensor_parallel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    launch_if_needed(__file__, 8)
    torch.set_num_threads(1)
    # full_tensor() of a (Replicate, _StridedShard, Shard) parameter logs a "2 sequential all_gathers" hint
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp = mesh["replicate", "shard"]
    base, ref = fresh_pair()
    ours = shard_2d(tensor_parallel(copy.deepcopy(base), mesh["tp"]), fully_shard, dp)
    theirs = shard_2d(tensor_parallel(copy.deepcopy(base), mesh["tp"]), torch_fully_shard, dp)
    theirs_params = dict(theirs.named_parameters())
    ok = True
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        same = (tuple(p.placements) == tuple(q.placements) and p.shape == q.shape
                and torch.equal(p.to_local(), q.to_local()))
        ok &= same
        if name.startswith("blocks.0."):
            rank0_print(f"{name:24s} {tuple(p.placements)!s:70s} {'= torch' if same else 'DIFFERS from torch'}")
    dp_rank = dp.get_coordinate()
    assert dp_rank is not None
    index, n_dp = dp_rank[0] * 2 + dp_rank[1], 4
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, ref)]
    worst_torch = worst_ref = 0.0
    rank0_print(f"\n{'step':>4} {'ours':>10} {'torch':>10} {'unsharded':>10}")
    for step, (x, y) in enumerate(data(args.steps, batch=8)):
        per = x.shape[0] // n_dp
        xs, ys = x[index * per:(index + 1) * per], y[index * per:(index + 1) * per]
        losses = [loss_fn(ours(xs), ys), loss_fn(theirs(xs), ys), loss_fn(ref(x), y)]
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
        mean = torch.stack([losses[0].detach(), losses[1].detach()])
        dist.all_reduce(mean)  # the tp ranks of one dp index hold the same loss: the world mean is dp's
        l_ours, l_torch = (mean / dist.get_world_size()).tolist()
        worst_torch, worst_ref = max(worst_torch, abs(l_ours - l_torch)), max(worst_ref, abs(l_ours - losses[2].item()))
        rank0_print(f"{step:4d} {l_ours:10.6f} {l_torch:10.6f} {losses[2].item():10.6f}")
    ref_params = dict(ref.named_parameters())
    param_diff = max((full(p.detach()) - ref_params[n].detach()).abs().max().item() for n, p in ours.named_parameters())
    ok &= worst_torch < 1e-5 and worst_ref < 2e-5
    rank0_print(f"\nmax |loss ours - torch| {worst_torch:.2e} (< 1e-5), max |loss ours - unsharded| {worst_ref:.2e} "
                f"(< 2e-5), max |param ours - unsharded| {param_diff:.2e}; placements/local shards = torch's: "
                f"{'yes' if ok else 'NO'}")
    verdict = torch.tensor([int(ok)])
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


if __name__ == "__main__":
    sys.exit(main())
