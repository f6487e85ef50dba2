"""Loading Hugging Face weights into a sharded model: load_hf vs DCP's HuggingFaceStorageReader vs rank-0 broadcast.

    python benchmarks/hf_load.py                      # builds the model directory once, then 2 ranks per method
    python benchmarks/hf_load.py --layers 4           # a smaller model

A synthetic Llama (~0.5B parameters at the defaults) is built from a config, saved with
``save_pretrained`` in bf16 (several files + index; nothing is downloaded) and loaded at ``--nproc``
ranks into a model built on the meta device, sharded with fully_shard and materialized (fp32
parameters), three ways, each in fresh processes (so peak RSS is each method's own):

* ours: ``checkpoint.load_hf``;
* dcp: ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` (its default threads);
* bcast: rank 0 reads every file (``safetensors.torch.load_file``), then torch's
  ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``.

The model directory's files are evicted from the page cache (posix_fadvise DONTNEED) before each load.
Per rank: wall time of the load (between barriers) and peak RSS growth during it (sampled every 2 ms),
next to that rank's shard (fp32 bytes) and largest local block; then the time of a second load into
the same parameters ("reload": their memory is already touched, so this is the reader's own cost
without the first-touch page faults of the fp32 shards, which every method pays alike). A checksum of
every parameter shows that the three methods loaded the same values. Results: benchmarks/results/hf_load.{json,txt}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
METHODS = ("ours", "dcp", "bcast")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/fs_hf_bench", help="where the model directory is built (kept)")
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-size", default="200MB", help="save_pretrained max_shard_size")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=3, help="runs per method (fresh processes each)")
    ap.add_argument("--warm", action="store_true", help="keep the files in the page cache (default: evict)")
    ap.add_argument("--threads", type=int, default=4, help="load_hf's threads")
    ap.add_argument("--method", help=argparse.SUPPRESS)  # set on the ranks
    return ap.parse_args()


def config(args: argparse.Namespace) -> Any:
    import transformers
    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                    intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                                    tie_word_embeddings=False)


def model_dir(args: argparse.Namespace) -> Path:
    return Path(args.dir) / f"llama-{args.layers}x{args.hidden}x{args.intermediate}-v{args.vocab}-bf16"


def build(args: argparse.Namespace) -> Path:
    import transformers
    d = model_dir(args)
    if (d / "config.json").exists():
        return d
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config(args)).to(torch.bfloat16)
    model.save_pretrained(str(d), max_shard_size=args.shard_size)
    return d


def evict(d: Path) -> None:
    for f in d.glob("*.safetensors*"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak RSS over a block, sampled by a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __enter__(self) -> PeakRSS:
        self.base = rss()
        self.peak = self.base
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def rank_main(args: argparse.Namespace) -> None:
    import transformers
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from fully_shard import fully_shard
    from fully_shard.checkpoint import load_hf

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    d = model_dir(args)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(args))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())  # type: ignore[attr-defined]
    block = max(p.to_local().numel() * 2 for p in model.parameters())  # type: ignore[attr-defined]

    def prepare() -> None:
        if not args.warm:
            evict(d)
        else:  # read once so that every method finds the files cached
            for f in sorted(d.glob("*.safetensors")):
                f.read_bytes()
        dist.barrier()

    def load() -> None:
        if args.method == "ours":
            load_hf(d, model, threads=args.threads)
        elif args.method == "dcp":
            dcp_load(model.state_dict(), storage_reader=HuggingFaceStorageReader(str(d)))
        else:
            from safetensors.torch import load_file
            full: dict[str, torch.Tensor] = {}
            if rank == 0:
                for f in sorted(d.glob("*.safetensors")):
                    full.update(load_file(str(f)))
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                        broadcast_from_rank0=True))
            del full
        dist.barrier()

    prepare()
    with PeakRSS() as mem:
        start = time.perf_counter()
        load()
        seconds = time.perf_counter() - start
    prepare()  # again, into memory the first load already touched: the reader's own cost
    start = time.perf_counter()
    load()
    reload = time.perf_counter() - start
    total = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.detach().double().abs().sum()
    dist.all_reduce(total)
    out = {"rank": rank, "method": args.method, "seconds": seconds, "reload": reload, "rss_growth": mem.peak - mem.base,
           "shard": shard, "block": block, "checksum": total.item()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.method:
        rank_main(args)
        return
    start = time.perf_counter()
    d = build(args)
    os.sync()  # a fresh build's dirty pages must not be written back during the first measured load
    params = len(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])
    size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
    print(f"model directory {d}: {size / 1e9:.2f} GB in bf16, {params} tensors (built/checked in "
          f"{time.perf_counter() - start:.0f} s)", flush=True)
    runs: list[list[dict[str, Any]]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for _ in range(args.rounds):
        for method in args.methods.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, *sys.argv[1:], "--method", method]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"{method} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", flush=True)
                continue
            runs.append(json.loads(line[len("RESULT "):]))
            print(method, [f"rank {r['rank']}: {r['seconds']:.2f} s (reload {r['reload']:.2f} s), "
                           f"+{r['rss_growth'] / 2**20:.0f} MiB"
                           for r in runs[-1]], flush=True)
    report(args, d, size, runs)


def report(args: argparse.Namespace, d: Path, size: int, runs: list[list[dict[str, Any]]]) -> None:
    by: dict[str, list[list[dict[str, Any]]]] = {}
    for run in runs:
        by.setdefault(run[0]["method"], []).append(run)
    cache = "page cache warm" if args.warm else "page cache evicted before each load"
    lines = [f"HF load, {args.nproc} ranks (gloo, CPU), {size / 1e9:.2f} GB bf16 files into fp32 shards, {cache}, "
             f"load_hf threads={args.threads}; median of {args.rounds} run(s) per method",
             f"{'method':<8}{'time s':>9}{'vs dcp':>9}{'reload s':>10}{'vs dcp':>9}{'peak RSS growth MiB':>22}"
             f"{'shard+block MiB':>17}{'checksum':>22}"]
    med: dict[str, float] = {}
    again: dict[str, float] = {}
    for method, rs in by.items():
        times = sorted(max(r["seconds"] for r in run) for run in rs)
        med[method] = times[len(times) // 2]
        times = sorted(max(r["reload"] for r in run) for run in rs)
        again[method] = times[len(times) // 2]
    for method, rs in by.items():
        last = rs[-1]
        growth = max(r["rss_growth"] for run in rs for r in run) / 2**20  # the worst rank of any run
        bound = max(r["shard"] + r["block"] for r in last) / 2**20
        ratio = med[method] / med["dcp"] if "dcp" in med else float("nan")
        ratio2 = again[method] / again["dcp"] if "dcp" in again else float("nan")
        lines.append(f"{method:<8}{med[method]:>9.2f}{ratio:>9.2f}{again[method]:>10.2f}{ratio2:>9.2f}"
                     f"{growth:>22.0f}{bound:>17.0f}"
                     f"{last[0]['checksum']:>22.6e}")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    tag = "-warm" if args.warm else ""
    (RESULTS / f"hf_load{tag}.txt").write_text(text + "\n")
    (RESULTS / f"hf_load{tag}.json").write_text(json.dumps({"args": vars(args), "dir": str(d), "bytes": size,
                                                      "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
