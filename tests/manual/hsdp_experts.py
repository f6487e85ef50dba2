"""HSDP for experts on 8 CPU ranks: experts on (dp_replicate 2, efsdp 2, ep 2), the rest on dp 8.

    python tests/manual/hsdp_experts.py [--steps 3]      # launches its own 8 gloo ranks (torchrun)

The tiny MoE model of tests/parallel/moe_common.py (the parity setup: tests/parallel/moe_parity.py), its
experts Shard(0) DTensors on ``ep``, sharded with this library's and torch's fully_shard (torchtitan's
shard_placement_fn: experts on the 2-D (dp_replicate, efsdp) mesh -> HSDP, the rest on dp), side by side with
one unsharded copy on the global
batch. Checks: placements and mesh names equal torch's; with the default divisor our gradients equal
the unsharded model's while torch's expert gradients are ep times larger (pytorch #160285); with factor
1.0 and a global-token loss the losses equal torch's step by step. Exits non-zero when a check fails.
Not part of the test suite: 8 processes are too many for CI's 2 cores; tests/parallel/test_experts.py
covers the same code at 4 ranks except the experts' replica all-reduce.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fully_shard, tests

import torch
import torch.distributed as dist

from tests.distributed.launch import launch_if_needed, rank0_print
from tests.parallel import moe_parity as P


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    launch_if_needed(__file__, 8)
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base, ours, theirs, _, _ = P.setup(experts=4, efsdp=2, ep=2, replicate=2)
    layout, torch_layout = P.layout(ours), P.layout(theirs)
    w1 = layout["layers.0.experts.w1"]
    rank0_print(f"layers.0.experts.w1: {w1[0]} on {w1[2]}")
    checks = {"placements equal torch's": layout == torch_layout,
              "experts on (dp_replicate, efsdp, ep)": w1[2] == ("dp_replicate", "efsdp", "ep")}
    r = P.default_divisor(base, ours, theirs, ep=2)
    rank0_print(f"default divisor: ours vs unsharded {r['grad_vs_ref']:.2e}; torch / ep vs unsharded "
                f"{r['torch_vs_ref_times_ep']:.2e}; norm ours {r['norm'][0]:.6f} unsharded {r['norm'][1]:.6f}")
    checks["default divisor = unsharded"] = r["grad_vs_ref"] < 2e-5
    checks["torch experts ep x"] = r["torch_vs_ref_times_ep"] < 2e-5 and r["torch_vs_ref"] > 1e-3
    checks["clip norm = unsharded"] = abs(r["norm"][0] - r["norm"][1]) < 1e-4
    losses = P.factor_one_steps(ours, theirs, base, steps=args.steps)
    for i, (a, b, c) in enumerate(losses):
        rank0_print(f"step {i}: ours {a:.8f} torch {b:.8f} unsharded {c:.8f}")
    checks["losses = torch (factor 1.0)"] = all(abs(a - b) < 1e-6 and abs(a - c) < 2e-5 for a, b, c in losses)
    failed = [name for name, ok in checks.items() if not ok]
    rank0_print("FAILED: " + ", ".join(failed) if failed else "all checks passed")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
