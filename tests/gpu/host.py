"""Part host of the GPU check: what the host does per step, ours vs torch's fully_shard, at world 1.

* **No hidden host syncs**: a steady-state forward+backward of ours under
  ``torch.cuda.set_sync_debug_mode("error")`` (any ``.item()``, blocking copy or stream sync raises); the
  optimizer step's, and torch's, are reported.
* **Launch-bound model**: a small GPT (many small kernels) where the step is host time, the case where the
  CPU benchmarks' host-overhead figures matter on a GPU: step time ours vs torch, taking turns.
* **CPU offload**: ``CPUOffloadPolicy()`` (pinned host shards, H2D copy-in, D2H gradients, the optimizer on
  the host): step time ours vs torch, taking turns.

Losses of ours and torch are compared on every step (NCCL and gloo write every output).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from models.gpt import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.gpu.common import device_of, error_text, log, shard, sizes, sync, write_json
from tests.gpu.report import Report
from tests.gpu.step import init_world_one

LIBS = ("ours", "torch")


def sync_debug(cfg: GPTConfig, device: torch.device) -> dict[str, Any]:
    """Per library: whether a steady-state forward+backward, and the optimizer step, ran without a host sync."""
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {}
    for lib in LIBS:
        torch.manual_seed(0)
        model = shard(GPT(cfg).to(device), lib, init_device_mesh(device.type, (1,)), None, False, True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x, y = synthetic_batch(cfg, 2, 0, 0, device=device)
        for _ in range(2):  # lazy init, optimizer states, allocator warm
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        rec: dict[str, str | None] = {}
        for phase in ("forward_backward", "optimizer"):
            try:
                torch.cuda.set_sync_debug_mode("error")
                if phase == "forward_backward":
                    loss_fn(model(x), y).backward()
                else:
                    opt.step()
                    opt.zero_grad()
                rec[phase] = None
            except Exception as e:
                rec[phase] = error_text(e)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
        out[lib] = rec
        del model, opt
    return out


def timed_pair(cfg: GPTConfig, device: torch.device, batch: int, steps: int, *, offload: bool) -> dict[str, Any]:
    """Ours and torch's on the same model and batches, taking turns per step after a warm-up step each:
    step times and losses."""
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    models = {}
    for lib in LIBS:
        model = shard(copy.deepcopy(base), lib, init_device_mesh(device.type, (1,)), None, offload, cuda)
        models[lib] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    rec: dict[str, Any] = {lib: {"step_s": [], "losses": []} for lib in LIBS}
    for i in range(1 + steps):
        x, y = synthetic_batch(cfg, batch, i, 0, device=device)
        for lib in (LIBS if i % 2 == 0 else LIBS[::-1]):
            model, opt = models[lib]
            sync(device)
            t = time.perf_counter()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            if i:
                rec[lib]["step_s"].append(time.perf_counter() - t)
            rec[lib]["losses"].append(float(loss.detach()))
    return rec


def run(args: argparse.Namespace, out: str) -> None:
    t0 = time.perf_counter()
    device = device_of(args)
    cuda = device.type == "cuda"
    init_world_one(device)
    s = sizes(args)
    steps = 3 if args.cpu_dry_run else (10 if args.quick else 30)
    res: dict[str, Any] = {"host_cfg": s.host_cfg.__dict__, "host_batch": s.host_batch,
                           "offload_cfg": s.offload_cfg.__dict__, "steps": steps}
    for name, job in (("sync", lambda: sync_debug(s.host_cfg, device) if cuda else None),
                      ("launch_bound", lambda: timed_pair(s.host_cfg, device, s.host_batch, steps, offload=False)),
                      ("offload", lambda: timed_pair(s.offload_cfg, device, 2, max(3, steps // 3), offload=True))):
        log(name, t0)
        try:
            res[name] = job()
        except Exception as e:
            res[name] = {"error": error_text(e), "traceback": traceback.format_exc()[-3000:]}
            print(res[name]["traceback"], flush=True)
        write_json(out, res)
    res["elapsed_s"] = time.perf_counter() - t0
    write_json(out, res)
    dist.destroy_process_group()


def report(rep: Report, data: dict[str, Any] | None, cuda: bool, cut: bool = False) -> None:
    rep.say("\n== Part host: host syncs, a launch-bound model and CPU offload, ours vs torch (world 1) ==")
    if data is None:
        return
    part = "host"
    sync_rec = data.get("sync")
    if not cuda:
        rep.check(part, "no host sync in a steady-state forward+backward (set_sync_debug_mode)", None, "",
                  skip="skipped: no CUDA")
    elif sync_rec is None:
        rep.missing(part, "no host sync in a steady-state forward+backward (set_sync_debug_mode)", "not run", cut=cut)
    elif "error" in sync_rec:
        rep.check(part, "no host sync in a steady-state forward+backward (set_sync_debug_mode)", False,
                  sync_rec["error"])
    else:
        for lib in LIBS:
            rep.say(f"sync debug ({lib}): forward+backward {sync_rec[lib]['forward_backward'] or 'no sync'}; "
                    f"optimizer step {sync_rec[lib]['optimizer'] or 'no sync'}")
        rep.check(part, "no host sync in a steady-state forward+backward (set_sync_debug_mode)",
                  sync_rec["ours"]["forward_backward"] is None, sync_rec["ours"]["forward_backward"] or "ours")
        rep.check(part, "no host sync in the optimizer step where torch's has none",
                  sync_rec["ours"]["optimizer"] is None or sync_rec["torch"]["optimizer"] is not None,
                  sync_rec["ours"]["optimizer"] or "ours", warn=True)
    skip = None if cuda else "skipped: no CUDA (CPU times mean nothing here)"
    for name, what, limit in (("launch_bound", f"launch-bound GPT {_cfg(data['host_cfg'])}, batch {data['host_batch']}",
                               1.0),
                              ("offload", f"CPUOffloadPolicy() GPT {_cfg(data['offload_cfg'])}, batch 2", 1.10)):
        rec = data.get(name)
        if rec is None:
            rep.missing(part, f"{name} runs", "not run", cut=cut)
            continue
        if "error" in rec:
            rep.check(part, f"{name} runs", False, rec["error"])
            continue
        o, t = rec["ours"], rec["torch"]
        mo, mt = statistics.median(o["step_s"]), statistics.median(t["step_s"])
        rep.say(f"{what}: step ms ours {mo * 1e3:.2f}, torch {mt * 1e3:.2f} (ours/torch {mo / mt:.3f}, "
                f"{len(o['step_s'])} steps each, taking turns)")
        rep.check(part, f"{name}: ours/torch step time <= {limit:.2f}", mo / mt <= limit, f"{mo / mt:.3f}", warn=True,
                  skip=skip)
        gap = max(abs(a - b) for a, b in zip(o["losses"], t["losses"]))
        rep.check(part, f"{name}: losses equal torch's on every step (|diff| <= 0.02, bf16)", gap <= 0.02,
                  f"max |diff| {gap:.2e} over {len(o['losses'])} steps")


def _cfg(cfg: dict[str, Any]) -> str:
    return f"(d={cfg['dim']}, {cfg['blocks']} blocks, seq {cfg['seq']})"
