"""Fault tolerance under torchft: random kill trials, time to go on, heal time vs model size, ours vs torch.

    python benchmarks/ft.py                       # everything below (~10-20 min on 2 loaded cores)
    python benchmarks/ft.py --trials 20 --parts trials
    python benchmarks/ft.py --parts sizes --sizes 64,512,1024,2048

All on CPU, gloo, 127.0.0.1, with examples/fault_tolerant.py's launcher (lighthouse in this process,
ranks forked from a forkserver, every rank with a watchdog, every run with a deadline):

- ``trials``: 3 replica groups x 2 ranks train an MLP with AdamW; ``--trials`` times, once every group has
  contributed to a committed step since the last kill, a random rank of a random group is SIGKILLed in a
  random phase (forward, backward, the cross-replica all-reduce, the optimizer step, or while its restart
  heals: then it is killed twice, or as its restart heals, the live group it heals from, as that one starts
  sending: a second group dies); its group is killed and restarted and heals from a live peer. Counts
  hangs (the run's deadline passed), NaNs and divergent replicas (final parameters and AdamW state not
  bitwise equal across groups); per kill: seconds to the survivors' next committed step without the
  victim, their step attempts that did not commit in between, seconds from the restart to the heal
  applied. Run for this library (``fully_shard.ft.fault_tolerant``) and for torch's ``fully_shard`` on the
  same recipe as torchtitan's experiments/torchft runs it (hook through the manager, torchft's
  ``OptimizerWrapper``, optimizer state by a zero-gradient lr-0 step, state dicts cached on the training
  thread), with the same kill sequence.
- ``sizes``: 2 groups, one kill in the forward, per MLP width: the heal's transfer time (torchft's HTTP
  transport) and restart-to-healed time, for this library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("RUST_LOG", "warn")

from examples.fault_tolerant import PHASES, Cluster, Kill, Recipe, compare_replicas, summarize  # noqa: E402


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.2f} {unit}".strip()


def trials(variant: str, n: int, seed: int, deadline_s: float) -> dict[str, Any]:
    """``n`` random kills on 3 groups; the kill sequence depends only on ``seed``."""
    rng = random.Random(seed)
    plan = [Kill(rng.randrange(3), rng.randrange(2), rng.choice(PHASES)) for _ in range(n)]
    recipe = Recipe(groups=3, hold=True, step_sleep=0.02, variants=(variant,) * 3, hidden=64)
    workdir = Path(tempfile.mkdtemp(prefix=f"ft_bench_{variant}_"))
    cluster = Cluster(recipe, workdir)
    start = time.time()
    try:
        report = cluster.run(plan=list(plan), deadline_s=deadline_s)
    finally:
        cluster.close()
    problems = compare_replicas(report, recipe)
    rows = summarize(report, recipe.groups)
    nan = sum("NaN" in p for p in problems)
    finals = report.finals
    final_step = finals[(0, 0)]["step"] if (0, 0) in finals else None
    adam_counts = sorted({float(t) for state in finals.values() for t in state["optim"][2::3]})
    out = {
        "variant": variant, "trials": n, "kills": len(report.kills), "restarts": len(report.restarts),
        "hung": report.hung, "nan": nan, "divergent": len(problems) - nan, "errors": report.errors,
        "wall_s": time.time() - start, "final_step": final_step, "adam_step_counts": adam_counts,
        "to_next_commit_s": [r["to_next_commit_s"] for r in rows],
        "steps_lost": [r["steps_lost"] for r in rows],
        "restart_to_healed_s": [r["restart_to_healed_s"] for r in rows if r["restart_to_healed_s"] is not None],
        "restart_to_ready_s": [r["restart_to_ready_s"] for r in rows if r["restart_to_ready_s"] is not None],
        "ready_to_healed_s": [r["ready_to_healed_s"] for r in rows if r["ready_to_healed_s"] is not None],
        "recv_s": [r["recv_s"] for r in rows if r["recv_s"] is not None],
        "phases": {p: sum(k["phase"] == p for k in report.kills) for p in PHASES},
        # restarts not caused by a planned kill (a rank that died by itself), and every rank's error
        "unplanned_restarts": [r for r in report.restarts if not any(
            k["replica"] == r["replica"] and k["incarnation"] == r["incarnation"] - 1 for k in report.kills)],
        "all_errors": [f"replica {e['replica']} rank {e['rank']} incarnation {e['incarnation']}: {e['msg']}"
                       for e in report.all_errors],
        "problems": problems[:10],
    }
    shutil.rmtree(workdir, ignore_errors=True)
    return out


def sizes(widths: list[int], deadline_s: float) -> list[dict[str, Any]]:
    out = []
    for width in widths:
        recipe = Recipe(hold=True, step_sleep=0.02, hidden=width, d_in=width, d_out=width, samples=256,
                        timeout_s=60.0)
        workdir = Path(tempfile.mkdtemp(prefix="ft_bench_size_"))
        cluster = Cluster(recipe, workdir)
        try:
            report = cluster.run(plan=[Kill(1, 0, "forward")], deadline_s=deadline_s)
        finally:
            cluster.close()
        params = 3 * (width * width + width)  # three width x width Linear layers
        rows = summarize(report, recipe.groups)
        row = rows[0] if rows else {}
        out.append({"width": width, "params": params, "state_mib": params * 3 * 4 / 2**20,
                    "recv_s": row.get("recv_s"), "restart_to_healed_s": row.get("restart_to_healed_s"),
                    "ready_to_healed_s": row.get("ready_to_healed_s"),
                    "to_next_commit_s": row.get("to_next_commit_s"), "equal": not compare_replicas(report, recipe),
                    "hung": report.hung})
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="trials,sizes")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--variants", default="ours,torch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default="64,512,1024,2048")
    ap.add_argument("--deadline", type=float, default=1200.0, help="seconds per run before it counts as a hang")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results: dict[str, Any] = {"load_average": os.getloadavg()}
    parts = args.parts.split(",")
    if "trials" in parts:
        results["trials"] = []
        print(f"{args.trials} random kills, 3 replica groups x 2 ranks, seed {args.seed} (the same kills per variant)")
        print("| variant | kills (trials) | hangs | NaN | divergent | to next commit (median / max) | steps lost "
              "(median / max) | restart -> healed (median / max) | of which startup (median) | ready -> healed "
              "(median) | transfer (median) | final step | AdamW step counts | wall |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for variant in args.variants.split(","):
            r = trials(variant, args.trials, args.seed, args.deadline)
            results["trials"].append(r)
            nxt = [v for v in r["to_next_commit_s"] if v is not None]
            print(f"| {variant} | {r['kills']} ({r['trials']}) | {int(r['hung'])} | {r['nan']} | {r['divergent']} | "
                  f"{_fmt(_median(nxt))} / {_fmt(max(nxt, default=None))} | "
                  f"{_median([float(v) for v in r['steps_lost']])} / {max(r['steps_lost'], default=None)} | "
                  f"{_fmt(_median(r['restart_to_healed_s']))} / {_fmt(max(r['restart_to_healed_s'], default=None))} | "
                  f"{_fmt(_median(r['restart_to_ready_s']))} | {_fmt(_median(r['ready_to_healed_s']))} | "
                  f"{_fmt(_median(r['recv_s']))} | {r['final_step']} | {r['adam_step_counts']} | "
                  f"{r['wall_s']:.0f} s |", flush=True)
            if r["problems"] or r["errors"]:
                print(f"  {variant}: problems {r['problems']} errors {r['errors'][:3]}")
            print(f"  {variant}: kills per phase {r['phases']}; no commit after a kill: "
                  f"{sum(v is None for v in r['to_next_commit_s'])}; restarts without a planned kill: "
                  f"{len(r['unplanned_restarts'])}; rank errors (any incarnation): {len(r['all_errors'])}")
            for line in r["all_errors"][:5]:
                print(f"    {line}")
    if "sizes" in parts:
        print("\nheal time vs model size (2 groups, one kill in the forward; this library)")
        print("| width | params | state MiB (params + AdamW, whole model) | transfer s | ready -> healed s | "
              "restart -> healed s | to next commit s | replicas equal |")
        print("|---|---|---|---|---|---|---|---|")
        results["sizes"] = sizes([int(w) for w in args.sizes.split(",")], args.deadline)
        for row in results["sizes"]:
            print(f"| {row['width']} | {row['params']:,} | {row['state_mib']:.1f} | {_fmt(row['recv_s'], '')} | "
                  f"{_fmt(row['ready_to_healed_s'], '')} | {_fmt(row['restart_to_healed_s'], '')} | "
                  f"{_fmt(row['to_next_commit_s'], '')} | {row['equal'] and not row['hung']} |", flush=True)
    results["load_average_end"] = os.getloadavg()
    print(f"\nload average at start {results['load_average']}, at end {results['load_average_end']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
