"""Weights out: iter_full vs the per-parameter ``full_tensor()`` loop, and delta vs full sends.

    python benchmarks/weights.py                 # 3 ranks: 2 trainers (fully_shard) + 1 receiver; ~102M params
    python benchmarks/weights.py --layers 2      # a smaller model (quick look)

The model is a Llama built from a config (untied; hidden 768, 11 layers, intermediate 2048, vocab 16000:
about 102M parameters, fp32), one fully_shard unit per decoder layer plus the root, on ranks 0 and 1.

Part 1 (the trainer ranks, the receiver waits): the full weights gathered several ways, taking turns, each
consumer dropping every tensor at once; per way the median wall time and the collectives issued (counted
at the dispatcher, waits not counted):

- ``iter_full``: one packed all-gather per unit; and the loop RL frameworks write (``for name, p in
  model.state_dict().items(): p.full_tensor()``: one all-gather per parameter);
- the all-gathers alone, on buffers allocated once outside the timing: one per parameter (the loop's
  collectives) and one per unit (ours): the transport's floor, which both ways pay;
- a bf16 export of the fp32 weights: ``iter_full(dtype=torch.bfloat16)`` (cast before the wire), the loop
  casting after the gather (``p.full_tensor().to(torch.bfloat16)``) and before it
  (``p.to(torch.bfloat16).full_tensor()``).

Part 2 (all three ranks): ``Sender(delta=True)`` to a ``Receiver`` holding a plain copy of the model.
For each fraction (1%, 3%, 10%) a step that changes that fraction of every local shard's elements (at
random places), then a delta send, then a full send (``full_send=True``) of the same weights, taking
turns; median time of the send on the receiver's side (from the header's arrival: the whole transfer,
checks and apply included) and on the leader's (``Sender.send()``), and the payload bytes.

Part 3 (the trainer ranks): the peak resident memory of one ``iter_full`` and one loop beyond what the
process held, glibc told to map every block of 4 KiB or more on its own (so freed memory leaves the
resident set at once; set only now: it makes every allocation fault its pages in, which would distort
the times above). Results: benchmarks/results/weights.txt (and .json).
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
from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory  # noqa: E402
from fully_shard.tools.watch import CollectiveWatch  # noqa: E402
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


def ours_bf16(model: torch.nn.Module) -> None:
    for _, t in iter_full(model, dtype=torch.bfloat16):
        del t


def loop_bf16_after(model: torch.nn.Module) -> None:
    for _, p in model.state_dict().items():
        full = (p.full_tensor() if isinstance(p, DTensor) else p.detach()).to(torch.bfloat16)
        del full


def loop_bf16_before(model: torch.nn.Module) -> None:
    for _, p in model.state_dict().items():
        full = p.to(torch.bfloat16).full_tensor() if isinstance(p, DTensor) else p.detach().to(torch.bfloat16)
        del full


class Alone:
    """The all-gathers alone: each rank's shard bytes per parameter or per unit, outputs allocated once."""

    def __init__(self, model: torch.nn.Module, per: str) -> None:
        from fully_shard.weights import unshard

        group = model._bench_group  # type: ignore[attr-defined]
        world = dist.get_world_size(group)
        if per == "parameter":
            pieces = [[p] for p in model.parameters()]
        else:
            pieces = [[p.sharded_param for p in u.group.params] for u in unshard.units_of(model)]
        self.inputs = [torch.cat([p.to_local().detach().reshape(-1) for p in ps]) for ps in pieces]
        self.outputs = [torch.empty(world * x.numel(), dtype=x.dtype) for x in self.inputs]
        self.group = group

    def __call__(self, model: torch.nn.Module) -> None:
        for x, out in zip(self.inputs, self.outputs):
            dist.all_gather_into_tensor(out, x, group=self.group)


def measure(fn: Any, model: torch.nn.Module) -> tuple[float, int]:
    dist.barrier(group=model._bench_group)  # type: ignore[attr-defined]
    with Gathers() as g, torch.no_grad():
        t0 = time.perf_counter()
        fn(model)
        seconds = time.perf_counter() - t0
    return seconds, g.n


def peak(fn: Any, model: torch.nn.Module) -> int:
    dist.barrier(group=model._bench_group)  # type: ignore[attr-defined]
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap memory out of the resident set (parts 1 and 2 left some)
    before = current_memory()
    reset_peak_memory()
    with torch.no_grad():
        fn(model)
    return peak_memory() - before


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
    mesh = DeviceMesh("cpu", torch.tensor(TRAINERS), mesh_dim_names=("dp",))
    trainer_group = mesh.get_group() if rank in TRAINERS else None
    model = build(args)
    params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {"params": params, "model_mib": params * 4 / 2**20, "ranks": "2 trainers + 1 receiver"}
    ways: dict[str, Any] = {}
    if rank in TRAINERS:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model._bench_group = trainer_group  # type: ignore[attr-defined]
        ways = {"iter_full": ours, "loop: full_tensor()": loop,
                "all-gathers alone, per parameter": Alone(model, "parameter"),
                "all-gathers alone, per unit": Alone(model, "unit"),
                "iter_full(dtype=bf16)": ours_bf16, "loop: full_tensor().to(bf16)": loop_bf16_after,
                "loop: to(bf16).full_tensor()": loop_bf16_before}
        for fn in ways.values():  # lazy init and first-use allocations out of the way
            fn(model)
        rows: dict[str, list[tuple[float, int]]] = {name: [] for name in ways}
        for _ in range(args.repeats):
            for name, fn in ways.items():
                rows[name].append(measure(fn, model))
        result["ways"] = {name: {"seconds": statistics.median(r[0] for r in runs), "collectives": runs[0][1]}
                          for name, runs in rows.items()}
    dist.barrier()
    # Part 2: sends
    fractions = [float(f) for f in args.fractions.split(",")]
    sends: dict[str, Any] = {}
    if rank in TRAINERS:
        sender = Sender(model, group=None, dst=RECEIVER, delta=True)
        sender.send()
        for i, fraction in enumerate(fractions):
            delta_s, full_s = [], []
            for r in range(args.repeats):
                change(model, fraction, 100 * i + r)
                dist.barrier(group=trainer_group)
                delta_s.append(sender.send().seconds)
                dist.barrier(group=trainer_group)
                full_s.append(sender.send(full_send=True).seconds)
            sends[f"{fraction:.0%}"] = {"delta_s": statistics.median(delta_s), "full_s": statistics.median(full_s)}
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
    dist.barrier()
    # Part 3: peak memory (glibc: every block of 4 KiB or more mapped on its own, from now on)
    ctypes.CDLL("libc.so.6").mallopt(-3, 4096)  # M_MMAP_THRESHOLD
    if rank in TRAINERS:
        peaks: dict[str, list[int]] = {"iter_full": [], "loop: full_tensor()": []}
        for _ in range(2):
            for name in peaks:
                peaks[name].append(peak(ways[name], model))
        for name, values in peaks.items():
            result["ways"][name]["peak_mib"] = max(values) / 2**20
    gathered: list[Any] = [None] * 3
    dist.all_gather_object(gathered, (result, sends))
    if rank == 0:
        result, leader = gathered[0]
        sends = gathered[RECEIVER][1]
        lines = [f"weights: {result['params'] / 1e6:.1f}M parameters ({result['model_mib']:.0f} MiB fp32), "
                 f"{result['ranks']}, gloo on CPU, median of {args.repeats}, taking turns",
                 "", "gather the full weights            seconds  /loop  collectives  peak MiB beyond the model"]
        ways_out = result["ways"]
        base = ways_out["loop: full_tensor()"]["seconds"]
        for name, r in ways_out.items():
            if name == "iter_full(dtype=bf16)":
                lines.append("  bf16 export of the fp32 weights:")
                base = ways_out["loop: full_tensor().to(bf16)"]["seconds"]
            mem = f"{r['peak_mib']:9.1f}" if "peak_mib" in r else ""
            lines.append(f"  {name:<32} {r['seconds']:7.3f}  {r['seconds'] / base:5.2f}  {r['collectives']:11d}  {mem}")
        ratio = ways_out["iter_full"]["seconds"] / ways_out["loop: full_tensor()"]["seconds"]
        floor = ways_out["all-gathers alone, per unit"]["seconds"] / ways_out["loop: full_tensor()"]["seconds"]
        lines.append(f"  iter_full / loop time: {ratio:.2f}x (goal <= 0.5x); its all-gathers alone: {floor:.2f}x")
        bf = ways_out["iter_full(dtype=bf16)"]["seconds"]
        lines.append(f"  bf16: iter_full / full_tensor().to(bf16): "
                     f"{bf / ways_out['loop: full_tensor().to(bf16)']['seconds']:.2f}x, / to(bf16).full_tensor(): "
                     f"{bf / ways_out['loop: to(bf16).full_tensor()']['seconds']:.2f}x")
        lines += ["", "send        receiver side: delta s  full s  delta/full   leader: delta s  full s  delta/full"
                  "   delta MiB  full MiB"]
        for fraction, s in sends.items():
            mine = leader[fraction]
            lines.append(f"  {fraction:>4} changed               {s['delta_s']:7.3f} {s['full_s']:7.3f}  "
                         f"{s['delta_s'] / s['full_s']:9.2f}x          {mine['delta_s']:7.3f} {mine['full_s']:7.3f}  "
                         f"{mine['delta_s'] / mine['full_s']:9.2f}x  {s['delta_mib']:9.1f}  {s['full_mib']:8.1f}")
        text = "\n".join(lines)
        print(text)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "weights.txt").write_text(text + "\n")
        (RESULTS / "weights.json").write_text(json.dumps({"gather": result, "leader_sends": leader, "sends": sends},
                                                          indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
