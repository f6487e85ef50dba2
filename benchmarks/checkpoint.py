"""Checkpoint benchmark: fully_shard.checkpoint vs torch.distributed.checkpoint, taking turns on the same ranks.

    python benchmarks/checkpoint.py                   # launches 2 ranks itself (gloo on CPU)
    torchrun --nproc_per_node 2 benchmarks/checkpoint.py --rounds 5 --dir /fast/disk/tmp

A ~52M-parameter GPT (vocab 32000, d=512, 6 blocks) sharded with fully_shard, plus its AdamW state
(one step taken), is saved by this library (xxh3 digests on, as by default) and by DCP's
FileSystemWriter (its defaults: one file per rank, fsync on), in alternating order, into fresh
directories each round. Then each round times, taking turns (the order rotates from round to round),
every way of loading it back into the same model and optimizer, with the page cache evicted
(posix_fadvise DONTNEED after fsync) before each, so every load reads the disk:

* DCP: ``dcp.load`` with ``FileSystemReader`` into the model's and optimizer's state dicts;
* staged: ``checkpoint.load`` (``LoadMode.STAGED``, the default: every digest checked before anything
  is written) right after an untimed staged load, as in a series of loads in one process (its buffer
  pool holds the memory the previous load used and the optimizer's state gave back);
* staged, empty pool: the same after ``direct.POOL.clear()``, as the first load of a process;
* in place: ``checkpoint.load(..., mode=LoadMode.IN_PLACE)``, digests checked as the bytes arrive;
* two floors (``ReadFloor``): the rank's own files read cold with O_DIRECT, 8 MiB blocks, 4 in flight,
  nothing parsed or checked, (a) *in place*, into memory that already exists, no digest: the bound of
  a loader that reads into the live tensors like DCP, and (b) *staged*, into fresh memory, hashed as
  it arrives: the bound of a verified load that changes nothing until every digest has passed and
  holds the new bytes in memory it maps afresh.

The same run measures the disk's raw speed (every rank writes, fsyncs, then reads back as many bytes
as it checkpoints). Prints every round (the load average at its start, each load's time, in place /
DCP, staged / staged floor, save ours / DCP, the order), the worst round of each ratio, medians, GB/s
of checkpoint bytes, the CPU seconds each load costs (every thread of both ranks: the work done,
which the other jobs on a shared machine change less than the wall time), and the share of our save
spent hashing.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from _common import GPT, GPTConfig, init, launch_if_needed, loss_fn, machine, median, rank0_print, timed_step

from fully_shard import fully_shard
from fully_shard.checkpoint import safetensors_io as ckpt_files


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to launch when not under torchrun")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/fully_shard-ckpt-bench"))
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args()


def evict(directory: Path) -> None:
    """Drop a directory's (already fsynced) files from the page cache so the next read hits the disk."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dir_bytes(directory: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(directory) for n in ns)


def raw_disk(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write+fsync, cold read) seconds for ``nbytes`` per rank, all ranks at once."""
    path = directory / f"raw-{dist.get_rank()}"
    block = os.urandom(64 << 20)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, memoryview(block)[: min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)

    def read() -> None:
        buf = bytearray(64 << 20)
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    w = timed_step(write, torch.device("cpu"))
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    r = timed_step(read, torch.device("cpu"))
    path.unlink()
    return w, r


class ReadFloor:
    """Lower bounds of a load: a rank's files read cold (O_DIRECT, 8 MiB blocks, 4 in flight), nothing
    parsed or checked. ``in_place``: into memory that already exists (allocated and touched once, reused
    every round), no digest: what a loader that reads straight into the model's and optimizer's tensors
    (DCP) cannot beat. ``staged``: into fresh memory, xxh3 of each block as it arrives: what a verified
    load that changes nothing until every digest is checked (ours) cannot beat, since it must hold the
    new bytes somewhere new while the old state stays intact."""

    BLOCK = 8 << 20

    def __init__(self, nbytes: int) -> None:
        self.buf = mmap.mmap(-1, nbytes + (1 << 20), flags=mmap.MAP_PRIVATE)
        self.buf.write(b"\1" * len(self.buf))  # touched: an in-place read does not fault memory in
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="floor")

    def in_place(self, files: list[Path]) -> None:
        self._read(files, self.buf, digest=False)

    def staged(self, files: list[Path]) -> None:
        fresh = mmap.mmap(-1, len(self.buf), flags=mmap.MAP_PRIVATE)
        try:
            self._read(files, fresh, digest=True)
        finally:
            fresh.close()

    def _read(self, files: list[Path], buf: mmap.mmap, *, digest: bool) -> None:
        view, pos = memoryview(buf), 0
        fds = [os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) for f in files]
        try:
            for fd, f in zip(fds, files):
                size = -(-f.stat().st_size // 4096) * 4096
                if pos + size > len(buf):
                    raise ValueError(f"floor buffer of {len(buf)} bytes is too small for {files}")
                h = xxhash.xxh3_128() if digest else None
                starts = range(0, size, self.BLOCK)
                jobs = [self.pool.submit(os.preadv, fd, [view[pos + a:pos + min(a + self.BLOCK, size)]], a)
                        for a in starts]
                for a, job in zip(starts, jobs):
                    job.result()
                    if h is not None:
                        h.update(view[pos + a:pos + min(a + self.BLOCK, size)])
                pos += size
        finally:
            for fd in fds:
                os.close(fd)
            view.release()


LOADS = ("dcp", "staged", "in_place", "floor", "staged_floor", "staged_cold")
LABELS = {"dcp": "DCP", "staged": "staged", "in_place": "in place", "floor": "in-place floor",
          "staged_floor": "staged floor", "staged_cold": "staged, empty pool"}


def main() -> None:
    args = parse_args()
    launch_if_needed(__file__, args.nproc)
    device = init("gloo")
    import torch.distributed.checkpoint as dcp

    from fully_shard import checkpoint
    from fully_shard.checkpoint import direct

    rank = dist.get_rank()
    cfg = GPTConfig(vocab=args.vocab, dim=args.dim, blocks=args.blocks, heads=8, seq=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab, (2, cfg.seq))
    loss_fn(model(x), x).backward()
    opt.step()
    opt.zero_grad()
    local = sum(t.to_local().numel() * 4 for t in model.state_dict().values())
    local += sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
                 for s in opt.state.values() for v in s.values())
    root = args.dir
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    rank0_print(f"# {machine()}; {dist.get_world_size()} ranks (gloo), {n_params / 1e6:.1f}M params + AdamW, "
                f"~{local / 1e6:.0f} MB of state per rank; dir {root}")

    hashing = [0.0]
    real_digest = ckpt_files.digest_from_memory

    def timed_digest(*a: Any, **k: Any) -> str:
        t = time.perf_counter()
        try:
            return real_digest(*a, **k)
        finally:
            hashing[0] += time.perf_counter() - t

    ckpt_files.digest_from_memory = timed_digest  # type: ignore[assignment]

    def dcp_state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": checkpoint.get_optimizer_state_dict(model, opt)}

    results: dict[str, list[float]] = {k: [] for k in (
        "ours_save", "dcp_save", "raw_write", "raw_read", "hash", "loadavg", *LOADS, *(f"{k}_cpu" for k in LOADS))}
    orders: list[list[str]] = []
    floor = ReadFloor(local)
    sizes: dict[str, int] = {}
    for rnd in range(args.rounds):
        results["loadavg"].append(os.getloadavg()[0])
        w, r = raw_disk(root, local)
        results["raw_write"].append(w)
        results["raw_read"].append(r)
        ours, theirs = root / f"ours-{rnd}", root / f"dcp-{rnd}"
        for name in (["ours", "dcp"] if rnd % 2 == 0 else ["dcp", "ours"]):
            if name == "ours":
                hashing[0] = 0.0
                results["ours_save"].append(timed_step(partial(checkpoint.save, ours, model, opt), device))
                h = torch.tensor([hashing[0]], dtype=torch.float64)
                dist.all_reduce(h, op=dist.ReduceOp.MAX)
                results["hash"].append(float(h.item()))
            else:
                writer = dcp.FileSystemWriter(str(theirs))
                results["dcp_save"].append(timed_step(partial(dcp.save, dcp_state(), storage_writer=writer), device))
        mine = sorted(ours.glob(f"*-rank{rank:05d}.safetensors"))

        def load_dcp(path: Path) -> None:
            dcp.load(dcp_state(), storage_reader=dcp.FileSystemReader(str(path)))

        runs = {"dcp": partial(load_dcp, theirs), "staged": partial(checkpoint.load, ours, model, opt),
                "in_place": partial(checkpoint.load, ours, model, opt, mode=checkpoint.LoadMode.IN_PLACE),
                "floor": partial(floor.in_place, mine), "staged_floor": partial(floor.staged, mine),
                "staged_cold": partial(checkpoint.load, ours, model, opt)}
        order = list(LOADS[rnd % len(LOADS):] + LOADS[:rnd % len(LOADS)])
        orders.append(order)
        prepare = {"staged": runs["staged"],  # (untimed) a staged load just before, as in a series of loads
                   "staged_cold": direct.POOL.clear}  # (untimed) as in a fresh process: its memory faulted afresh
        for name in order:
            if name in prepare:
                prepare[name]()
            if rank == 0:
                evict(ours)
                evict(theirs)
            dist.barrier()
            cpu = time.process_time()
            results[name].append(timed_step(runs[name], device))
            used = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
            dist.all_reduce(used)  # CPU seconds of every thread of every rank: the work, whatever the load
            results[f"{name}_cpu"].append(float(used.item()))
        dist.barrier()
        sizes["ours"], sizes["dcp"] = dir_bytes(ours), dir_bytes(theirs)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ours)
            shutil.rmtree(theirs)
    med = {k: median(v) for k, v in results.items()}
    total_state = local * dist.get_world_size()
    if rank == 0:
        gb = 1e9
        print("seconds per load, both ranks at once; each round's loads in the order shown (page cache evicted "
              "before each)")
        print(f"{'round':>5}{'loadavg':>8}{'DCP':>7}{'staged':>8}{'in place':>9}{'floor':>7}{'st.floor':>9}"
              f"{'st.cold':>8}{'inplace/DCP':>12}{'staged/st.floor':>16}{'cold/st.floor':>14}{'save/DCP':>9}  order")
        for i in range(args.rounds):
            v = {k: results[k][i] for k in results}
            print(f"{i:>5}{v['loadavg']:>8.2f}{v['dcp']:>7.3f}{v['staged']:>8.3f}{v['in_place']:>9.3f}{v['floor']:>7.3f}"
                  f"{v['staged_floor']:>9.3f}{v['staged_cold']:>8.3f}{v['in_place'] / v['dcp']:>12.2f}"
                  f"{v['staged'] / v['staged_floor']:>16.2f}{v['staged_cold'] / v['staged_floor']:>14.2f}"
                  f"{v['ours_save'] / v['dcp_save']:>9.2f}  {','.join(orders[i])}")
        worst = {k: max(a / b for a, b in zip(results[k], results[ref])) for k, ref in
                 (("in_place", "dcp"), ("staged", "staged_floor"), ("staged_cold", "staged_floor"))}
        print(f"worst round: in place / DCP {worst['in_place']:.2f} (target <= 0.7), staged / staged floor "
              f"{worst['staged']:.2f} (target <= 1.2), staged with an empty pool / staged floor "
              f"{worst['staged_cold']:.2f}")
        print(f"bytes on disk: ours {sizes['ours'] / gb:.3f} GB, DCP {sizes['dcp'] / gb:.3f} GB "
              f"(state {total_state / gb:.3f} GB)")
        print(f"raw disk (all ranks at once): write+fsync {total_state / med['raw_write'] / gb:.2f} GB/s, "
              f"cold read {total_state / med['raw_read'] / gb:.2f} GB/s")
        print(f"{'median of ' + str(args.rounds):24}{'s':>8}{'GB/s':>7}")
        for key, label, nbytes in (("ours_save", "save ours", sizes["ours"]), ("dcp_save", "save DCP", sizes["dcp"]),
                                   *((k, "load " + LABELS[k], sizes["dcp" if k == "dcp" else "ours"])
                                     for k in LOADS)):
            print(f"{label:24}{med[key]:8.3f}{nbytes / med[key] / gb:7.2f}")
        cpu = ", ".join(f"{LABELS[k]} {med[k + '_cpu']:.3f}" for k in LOADS)
        print(f"CPU seconds per load (every thread of both ranks), median: {cpu}; in place / DCP "
              f"{med['in_place_cpu'] / med['dcp_cpu']:.2f}")
        print(f"save: xxh3_128 digests take {med['hash']:.3f} s ({100 * med['hash'] / med['ours_save']:.1f}% of the "
              f"save); ours/DCP {med['ours_save'] / med['dcp_save']:.2f}")
        if args.json:
            args.json.write_text(json.dumps({"machine": machine(), "params": n_params, "state_bytes": total_state,
                                             "sizes": sizes, "orders": orders, "runs": results, "median": med},
                                            indent=2))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
