"""Where this library's step time goes on step.py's model: the profiler's per-unit table.

    python benchmarks/step_profile.py            # launches 2 gloo ranks itself
    torchrun --nproc_per_node 2 benchmarks/step_profile.py --steps 8

The model, batch and optimizer of ``step.py`` (GPT 5.8M params, 6 blocks, d=256, seq 128, batch 4 per
rank, fp32, AdamW); two warm-up steps, then ``--steps`` profiled steps (the first one skipped in the
table). Prints rank 0's table: per unit, each all-gather and reduce-scatter's time from issue to done
and the part the host waited for (exposed), then the step's exposed communication and the share of
the step with a collective in flight.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _common import GPT, GPTConfig, init, launch_if_needed, loss_fn, synthetic_batch, wrap_variant

from fully_shard import profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to launch when not under torchrun")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    launch_if_needed(__file__, args.nproc)
    init("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(vocab=2048, dim=256, blocks=6, heads=8, seq=128)  # step.py's defaults
    torch.manual_seed(0)
    model = wrap_variant(GPT(cfg), "ours")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x, y = synthetic_batch(cfg, 4, i, rank)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for i in range(2):
        step(i)
    with profile(model) as prof:
        for i in range(args.steps):
            step(i)
            prof.step()
    if rank == 0:
        print(prof.table(skip_first=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
