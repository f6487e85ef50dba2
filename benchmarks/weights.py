"""Weights out: iter_full vs the per-parameter ``full_tensor()`` loop, and delta vs full sends.

    python benchmarks/weights.py                 # 3 ranks: 2 trainers (fully_shard) + 1 receiver; ~102M params
    python benchmarks/weights.py --layers 2      # a smaller model (quick look)

The model is a Llama built from a config (untied; hidden 768, 11 layers, intermediate 2048, vocab 16000:
about 102M parameters, fp32), one fully_shard unit per decoder layer plus the root, on ranks 0 and 1.

Part 1 (the trainer ranks, the receiver waits): the full weights gathered two ways, taking turns, each
consumer dropping every tensor at once: ours (``iter_full``: one all-gather per unit through the unshard
path) and the loop RL frameworks write (``for name, p in model.state_dict().items(): p.full_tensor()``:
one all-gather per parameter). Per way: median wall time, collectives issued (counted at the
dispatcher, waits not counted), and the peak resident memory beyond what the process held (glibc told
to map every block of 4 KiB or more on its own, so freed memory leaves the resident set at once).

Part 2 (all three ranks): ``Sender(delta=True)`` to a ``Receiver`` holding a plain copy of the model.
For each fraction (1%, 3%, 10%) a step that changes that fraction of every local shard's elements (at
random places), then a delta send, then a full send (``full_send=True``) of the same weights, taking
turns; median time of the send on the receiver's side (from the header's arrival: the whole transfer,
checks and apply included)
and the payload bytes. Results: benchmarks/results/weights.txt (and .json).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from fully_shard import fully_shard  # noqa: E402
from fully_shard.tools.collectives import CollectiveWatch  # noqa: E402
from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory  # noqa: E402
from fully_shard.weights import Receiver, Sender, iter_full  # noqa: E402

TRAINERS, RECEIVER = [0, 1], 2


class Gathers(CollectiveWatch):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def on_collective(self, op: str, args: tuple) -> None:
        if "gather" in op:
            self.n += 1


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    heads = args.hidden // 64
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                                      num_hidden_layers=args.layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def ours(model: torch.nn.Module) -> None:
    for _, t in iter_full(model):
        del t


def loop(model: torch.nn.Module) -> None:
    for _, p in model.state_dict().items():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        del full


def measure(fn: Any, model: torch.nn.Module) -> tuple[float, int, int]:
    dist.barrier(group=model._bench_group)  # type: ignore[attr-defined]
    before = current_memory()
    reset_peak_memory()
    with Gathers() as g:
        t0 = time.perf_counter()
        fn(model)
        seconds = time.perf_counter() - t0
    return seconds, g.n, peak_memory() - before


def change(model: torch.nn.Module, fraction: float, seed: int) -> None:
    """Add a small value at ``fraction`` of every local shard's elements (random places)."""
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            flat = local.view(-1)
            k = max(1, int(flat.numel() * fraction))
            idx = torch.randint(0, flat.numel(), (k,), generator=g)
            flat[idx] += 1e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=11)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fractions", default="0.01,0.03,0.10")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        from torch.distributed.run import main as torchrun

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("PYTHONPATH", str(ROOT))
        torchrun(["--standalone", "--nproc_per_node=3", __file__, *sys.argv[1:]])
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ctypes.CDLL("libc.so.6").mallopt(-3, 4096)  # M_MMAP_THRESHOLD (see the docstring)
    mesh = DeviceMesh("cpu", torch.tensor(TRAINERS), mesh_dim_names=("dp",))
    trainer_group = mesh.get_group() if rank in TRAINERS else None
    model = build(args)
    params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {"params": params, "model_mib": params * 4 / 2**20, "ranks": "2 trainers + 1 receiver"}
    if rank in TRAINERS:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model._bench_group = trainer_group  # type: ignore[attr-defined]
        ours(model)  # lazy init and first-use allocations out of the way
        loop(model)
        rows: dict[str, list[tuple[float, int, int]]] = {"ours": [], "loop": []}
        for _ in range(args.repeats):
            for name, fn in (("ours", ours), ("loop", loop)):
                rows[name].append(measure(fn, model))
        for name, runs in rows.items():
            result[name] = {"seconds": statistics.median(r[0] for r in runs), "collectives": runs[0][1],
                            "peak_mib": max(r[2] for r in runs) / 2**20}
    dist.barrier()
    # Part 2: sends
    fractions = [float(f) for f in args.fractions.split(",")]
    sends: dict[str, Any] = {}
    if rank in TRAINERS:
        sender = Sender(model, group=None, dst=RECEIVER, delta=True)
        sender.send()
        for i, fraction in enumerate(fractions):
            for r in range(args.repeats):
                change(model, fraction, 100 * i + r)
                dist.barrier(group=trainer_group)
                sender.send()
                dist.barrier(group=trainer_group)
                sender.send(full_send=True)
    else:
        receiver = Receiver(model, group=None)
        receiver.receive()
        for fraction in fractions:
            delta, full = [], []
            for _ in range(args.repeats):
                delta.append(receiver.receive())
                full.append(receiver.receive())
            assert all(s.mode == "delta" for s in delta) and all(s.mode == "full" for s in full)
            sends[f"{fraction:.0%}"] = {
                "delta_s": statistics.median(s.seconds for s in delta),
                "full_s": statistics.median(s.seconds for s in full),
                "delta_mib": statistics.median(s.bytes for s in delta) / 2**20,
                "full_mib": statistics.median(s.bytes for s in full) / 2**20}
    gathered: list[Any] = [None] * 3
    dist.all_gather_object(gathered, (result, sends))
    if rank == 0:
        result, sends = gathered[0][0], gathered[RECEIVER][1]
        lines = [f"weights: {result['params'] / 1e6:.1f}M parameters ({result['model_mib']:.0f} MiB fp32), "
                 f"{result['ranks']}, gloo on CPU, median of {args.repeats}",
                 "", "gather the full weights   seconds  collectives  peak MiB beyond the model"]
        for name in ("ours", "loop"):
            r = result[name]
            lines.append(f"  {name:<22} {r['seconds']:8.3f}  {r['collectives']:11d}  {r['peak_mib']:9.1f}")
        ratio = result["ours"]["seconds"] / result["loop"]["seconds"]
        lines.append(f"  iter_full / loop time: {ratio:.2f}x (goal <= 0.5x)")
        lines += ["", "send (receiver side)  delta s   full s  delta/full   delta MiB  full MiB"]
        for fraction, s in sends.items():
            lines.append(f"  {fraction:>4} changed      {s['delta_s']:7.3f}  {s['full_s']:7.3f}  "
                         f"{s['delta_s'] / s['full_s']:9.2f}x  {s['delta_mib']:9.1f}  {s['full_mib']:8.1f}")
        text = "\n".join(lines)
        print(text)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "weights.txt").write_text(text + "\n")
        (RESULTS / "weights.json").write_text(json.dumps({"gather": result, "sends": sends}, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
