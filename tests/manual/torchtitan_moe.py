"""torchtitan's own ``apply_fsdp_to_decoder`` (expert parallel, ep 2) on this library after ``compat.patch_torch()``.

    pip install --no-deps torchtitan==0.3.0      # not a dependency; or pass --torchtitan DIR (a checkout)
    python tests/manual/torchtitan_moe.py          # launches 4 gloo ranks itself

torchtitan's ``distributed/fsdp.py`` is loaded from its file, unchanged (its package ``__init__`` pulls in
dependencies unrelated to FSDP), twice: once after ``compat.patch_torch()`` (its torch imports bind this
library's names, ``ShardPlacementResult`` and ``_get_mesh_info`` included) and once unpatched (torch's
``fully_shard``). The model is tests/compat/test_torchtitan_moe.py's torchtitan-shaped ``Decoder`` (dense
``dp`` 4; experts on ``(efsdp 2, ep 2)``). Each side trains 3 SGD steps with torchtitan's loss convention
(the divide factor 1.0 its function sets, a loss summed over tokens and divided by the global count);
prints the placements, losses, and the gaps. On gloo torch's side needs ``set_force_sum_reduction_for_comms``
(its factor 1.0 is NCCL's ``PREMUL_SUM``); ours runs as torchtitan calls it. Exits non-zero if the losses
or placements differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _load_fsdp_py(torchtitan_dir: Path, name: str) -> Any:
    path = torchtitan_dir / "distributed" / "fsdp.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(rank: int, world: int, port: int, torchtitan_dir: str, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, str(Path(torchtitan_dir).parent))  # ``torchtitan.tools.logging`` for fsdp.py's logger
    from fully_shard import compat
    from tests.parallel.moe_common import TOKENS, VOCAB, Decoder, expert_parallel, sparse_meshes

    torch.manual_seed(0)
    base = Decoder(experts=4)
    results: dict[str, Any] = {}
    for impl in ("ours", "torch"):
        if impl == "ours":
            compat.patch_torch()
        try:
            fsdp_py = _load_fsdp_py(Path(torchtitan_dir), f"torchtitan_fsdp_{impl}")
            dense, edp, ep_mesh = sparse_meshes(2, 2)
            model = expert_parallel(__import__("copy").deepcopy(base), ep_mesh)
            for block in model.layers.values():  # torchtitan reads block.moe.routed_experts.inner_experts
                inner = types.SimpleNamespace(inner_experts=block.experts)
                object.__setattr__(block, "moe", types.SimpleNamespace(routed_experts=inner))
                block.experts.num_experts = 4
            model.enable_weight_tying = False
            fsdp_py.apply_fsdp_to_decoder(model, dense, torch.float32, torch.float32, pp_enabled=False,
                                          ep_degree=2, edp_mesh=edp)
            if impl == "torch":  # torch's factor 1.0 is NCCL's PREMUL_SUM, which gloo lacks: SUM, the same math
                for m in model.modules():
                    if hasattr(m, "set_force_sum_reduction_for_comms"):
                        m.set_force_sum_reduction_for_comms(True)
            placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters()}
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = []
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                tokens = torch.randint(0, VOCAB, (world, TOKENS), generator=g)
                labels = torch.randint(0, VOCAB, (world, TOKENS), generator=g)
                logits = model(tokens[rank])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[rank],
                                                         reduction="sum") / labels.numel()
                loss.backward()
                opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(total.item())
            results[impl] = {"placements": placements, "losses": losses}
        finally:
            if impl == "ours":
                compat.unpatch_torch()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchtitan", default=None, help="torchtitan package dir (default: the installed one)")
    args = ap.parse_args()
    torchtitan_dir = args.torchtitan
    if torchtitan_dir is None:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None or spec.origin is None:
            sys.exit("torchtitan is not installed: pip install --no-deps torchtitan==0.3.0, or pass --torchtitan DIR")
        torchtitan_dir = str(Path(spec.origin).parent)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_run, args=(4, port, torchtitan_dir, out), nprocs=4, start_method="spawn")
    results = out.get()
    ours, ref = results["ours"], results["torch"]
    print(f"torchtitan: {torchtitan_dir}")
    for name in ours["placements"]:
        if "experts" in name:
            print(f"  {name}: ours {ours['placements'][name]} | torch {ref['placements'][name]}")
    print(f"losses ours  {[f'{x:.6f}' for x in ours['losses']]}")
    print(f"losses torch {[f'{x:.6f}' for x in ref['losses']]}")
    gap = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))
    same_placements = ours["placements"] == ref["placements"]
    print(f"max loss gap {gap:.2e}; placements equal: {same_placements}")
    if gap > 1e-6 or not same_placements:
        sys.exit("CHECK FAILED: torchtitan's apply_fsdp_to_decoder differs between this library and torch's")


if __name__ == "__main__":
    main()
