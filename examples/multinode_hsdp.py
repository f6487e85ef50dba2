"""HSDP across nodes: two torchrun agents on this machine act as two nodes; losses must equal one agent's.

    python examples/multinode_hsdp.py          # both runs, then the comparison; exit status 1 if they differ

Run A starts two torchrun agents, each a 'node' of 2 CPU ranks, that meet through a c10d rendezvous on
localhost (``--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint localhost:PORT``). Run B is
one agent with 4 ranks. Both train the GPT of models/gpt.py with HSDP on the same (2, 2) mesh
("replicate", "shard"): each block and the root are ``fully_shard(..., mesh=mesh)`` units, parameters are
sharded within a node and replicated across nodes. Two variants run in the same processes: ``sync`` (one
batch per optimizer step) and ``accumulate`` (``--accum`` micro-batches per step with
``set_requires_all_reduce(False)`` on all but the last: the cross-node all-reduce runs once per step).
The script prints every step's mean loss of both runs and the largest difference over all ranks' losses
and the final parameters, which must all be 0.0 (same ranks, same mesh, same collectives: bit for bit).
Each worker also checks that its shard group lies within its node and its replicate group spans the
nodes, and rank 0 reports the bytes per optimizer step on each mesh axis from ``fully_shard.profile``.

On real nodes, every node runs the worker under the same torchrun command (node ranks come from the
rendezvous; the mesh is (number of nodes, ranks per node), see docs/multi-node.md)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node0.example:29500 \\
        --rdzv-id hsdp-run-1 examples/multinode_hsdp.py --worker --report runs/hsdp
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.train_gpt import setup
from fully_shard import fully_shard, profile
from models.gpt import GPT, GPTConfig, loss_fn, synthetic_batch

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("sync", "accumulate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="train (under torchrun) instead of launching")
    ap.add_argument("--report", type=Path, default=None, help="worker: rank 0 writes report.json + params.pt here")
    ap.add_argument("--replicate", type=int, default=0,
                    help="mesh rows (default: the number of torchrun agents, WORLD_SIZE // LOCAL_WORLD_SIZE)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per variant")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step in the accumulate variant")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=240.0, help="launcher: seconds per run before it is killed")
    ap.add_argument("--out", type=Path, default=None, help="launcher: where the runs write (default: a temp dir)")
    return ap.parse_args(argv)


# --- the worker: one rank of either run --------------------------------------------------------------
def build_mesh(device: torch.device, replicate: int) -> DeviceMesh:
    """(nodes, ranks per node) named ("replicate", "shard"): torchrun numbers each node's ranks
    consecutively, so every row of the mesh is one node."""
    world = dist.get_world_size()
    if replicate < 1 or world % replicate:
        raise SystemExit(f"--replicate {replicate}: expected a divisor of the world size {world}. Fix: pass the "
                         "number of nodes, or leave it out (WORLD_SIZE // LOCAL_WORLD_SIZE).")
    return init_device_mesh(device.type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def check_topology(mesh: DeviceMesh) -> dict[str, Any]:
    """Which node (torchrun's GROUP_RANK) each rank runs on; the shard group must be within one node
    (all-gathers and reduce-scatters stay off the slow links), the replicate group across nodes."""
    nodes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))
    shard = dist.get_process_group_ranks(mesh.get_group("shard"))
    replicate = dist.get_process_group_ranks(mesh.get_group("replicate"))
    n_nodes = len(set(nodes))
    if len({nodes[r] for r in shard}) != 1:
        raise SystemExit(f"rank {dist.get_rank()}: shard group {shard} spans nodes {[nodes[r] for r in shard]}; "
                         f"expected one node. Fix: build the mesh as (nodes, ranks per node) = "
                         f"({n_nodes}, {dist.get_world_size() // n_nodes}).")
    if n_nodes > 1 and len({nodes[r] for r in replicate}) != len(replicate):
        raise SystemExit(f"rank {dist.get_rank()}: replicate group {replicate} is on nodes "
                         f"{[nodes[r] for r in replicate]}; expected one rank per node. Fix: mesh rows = nodes.")
    return {"nodes": nodes, "shard_group": shard, "replicate_group": replicate}


def train(cfg: GPTConfig, mesh: DeviceMesh, args: argparse.Namespace, accum: int,
          device: torch.device) -> dict[str, Any]:
    """``args.steps`` optimizer steps of ``accum`` micro-batches; every rank's loss of every micro-batch."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses: list[list[float]] = []
    with profile(model) as prof:
        for step in range(args.steps):
            for micro in range(accum):
                model.set_requires_all_reduce(micro == accum - 1)  # cross-node all-reduce on the last only
                x, y = synthetic_batch(cfg, args.batch, step * accum + micro, rank, device=device)
                loss = loss_fn(model(x), y)
                (loss / accum).backward()
                every = [torch.zeros(()) for _ in range(world)]
                dist.all_gather(every, loss.detach().cpu())
                losses.append([t.item() for t in every])
            opt.step()
            opt.zero_grad()
            prof.step()
    s = prof.summary()
    params = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}  # collective: every rank
    return {"losses": losses, "params": params,
            "bytes": {"shard": s["all_gather_bytes"] + s["reduce_scatter_bytes"], "replicate": s["all_reduce_bytes"],
                      "model": s["model_bytes"]}}


def worker(args: argparse.Namespace) -> None:
    device = setup()
    world = dist.get_world_size()
    replicate = args.replicate or world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = build_mesh(device, replicate)
    topology = check_topology(mesh)
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, blocks=args.blocks, heads=args.heads, seq=args.seq)
    runs = {name: train(cfg, mesh, args, 1 if name == "sync" else args.accum, device) for name in VARIANTS}
    if dist.get_rank() == 0 and args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        torch.save({name: r.pop("params") for name, r in runs.items()}, args.report / "params.pt")
        (args.report / "report.json").write_text(json.dumps(
            {"mesh": list(mesh.shape), "topology": topology, "runs": runs}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# --- the launcher: run A (two agents) and run B (one agent), then compare ----------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_cmd(nnodes: int, nproc: int, run_id: str, port: int, report: Path, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", run_id,
            str(Path(__file__).resolve()), "--worker", "--report", str(report), *argv]


def run_agents(cmds: list[list[str]], timeout: float, log: Path) -> None:
    """Start the agents together (each in its own session), wait for all; kill them all on timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    logs = [open(log.with_suffix(f".agent{i}.log"), "w") for i in range(len(cmds))]  # noqa: SIM115
    procs = [subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
             for cmd, f in zip(cmds, logs)]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the agent and its workers (their own session)
        raise SystemExit(f"run timed out after {timeout:.0f} s; logs: {log.parent}") from None
    finally:
        for f in logs:
            f.close()
    for i, p in enumerate(procs):
        if p.returncode != 0:
            text = log.with_suffix(f".agent{i}.log").read_text()
            raise SystemExit(f"agent {i} exited with {p.returncode}:\n{text[-4000:]}")


def launch(args: argparse.Namespace) -> int:
    out = args.out or Path(tempfile.mkdtemp(prefix="multinode_hsdp_"))
    out.mkdir(parents=True, exist_ok=True)
    passed = [f"--{k}={getattr(args, k)}" for k in ("steps", "accum", "batch", "dim", "blocks", "heads", "seq",
                                                    "vocab")]
    tag = f"hsdp-{os.getpid()}"
    t0 = time.perf_counter()
    port = free_port()
    run_agents([agent_cmd(2, 2, tag + "-a", port, out / "two_nodes", passed) for _ in range(2)],
               args.timeout, out / "two_nodes")
    t1 = time.perf_counter()
    run_agents([agent_cmd(1, 4, tag + "-b", free_port(), out / "one_node", [*passed, "--replicate", "2"])],
               args.timeout, out / "one_node")
    t2 = time.perf_counter()
    reports = {k: json.loads((out / k / "report.json").read_text()) for k in ("two_nodes", "one_node")}
    params = {k: torch.load(out / k / "params.pt") for k in ("two_nodes", "one_node")}
    a, b = reports["two_nodes"], reports["one_node"]
    print(f"run A: 2 torchrun agents x 2 ranks, c10d rendezvous on localhost ({t1 - t0:.1f} s); "
          f"nodes of ranks {a['topology']['nodes']}, rank 0's shard group {a['topology']['shard_group']}, "
          f"replicate group {a['topology']['replicate_group']}")
    print(f"run B: 1 torchrun agent x 4 ranks ({t2 - t1:.1f} s); the same mesh {b['mesh']} (replicate, shard)")
    ok = True
    for name in VARIANTS:
        la, lb = a["runs"][name]["losses"], b["runs"][name]["losses"]
        loss_diff = max(abs(x - y) for ra, rb in zip(la, lb) for x, y in zip(ra, rb))
        pa, pb = params["two_nodes"][name], params["one_node"][name]
        param_diff = max((pa[n] - pb[n]).abs().max().item() for n in pa)
        same = len(la) == len(lb) and loss_diff == 0.0 and param_diff == 0.0 and pa.keys() == pb.keys()
        ok &= same
        per = args.accum if name == "accumulate" else 1
        print(f"\n{name}: {len(la) // per} steps x {per} micro-batch(es)"
              + (" (set_requires_all_reduce(False) on all but the last)" if per > 1 else ""))
        print("  mean loss per micro-batch, two agents: " + " ".join(f"{sum(r) / len(r):.6f}" for r in la))
        print("  mean loss per micro-batch, one agent:  " + " ".join(f"{sum(r) / len(r):.6f}" for r in lb))
        print(f"  max |diff| over all ranks' losses {loss_diff:.3g}, over the final parameters {param_diff:.3g}"
              f" -> {'EQUAL' if same else 'DIFFERENT'}")
        by = a["runs"][name]["bytes"]
        print(f"  bytes per optimizer step (rank 0): intra-node shard axis (all-gather + reduce-scatter) "
              f"{by['shard'] / 2**20:.3f} MiB, inter-node replicate axis (all-reduce) {by['replicate'] / 2**20:.3f} "
              f"MiB = 1/{by['model'] / by['replicate']:.2f} of the model's {by['model'] / 2**20:.3f} MiB")
    print(f"\n{'PASS' if ok else 'FAIL'}: two-node HSDP losses and parameters "
          f"{'equal' if ok else 'differ from'} the single-agent run's (outputs in {out})")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
