"""The founding note's quick start (fsdp-note, "快速开始"): its FSDP1 code as written, on this library.

    torchrun --nproc_per_node 2 examples/quickstart.py                  # CPU (gloo) or GPUs (nccl)
    torchrun --nproc_per_node 4 examples/quickstart.py                  # + HYBRID_SHARD on a (2, 2) mesh
    torchrun --nproc_per_node 2 examples/quickstart.py --torch-imports  # the note's torch imports, patched

The note's code below differs from the note only in its two import lines, which name this library
(``--torch-imports`` runs it with torch's imports after ``compat.patch_torch(fsdp1=True)``). No
``device_id``: the device comes from the process group's backend. The note's four steps, printed as they run:

1. the whole model as one unit (``FSDP(build_model())``, no policy);
2. one unit per ``TransformerBlock`` (``transformer_auto_wrap_policy``): what one all-gather holds;
3. bf16 mixed precision, and a check that each sharding strategy shards as much as it says
   (FULL_SHARD / SHARD_GRAD_OP: 1/W of the parameters per rank; NO_SHARD: all of them);
4. save and load on the small model: FULL_STATE_DICT and SHARDED_STATE_DICT (torch.distributed.checkpoint),
   model and optimizer (``FSDP.optim_state_dict``), restored into fresh models: the loss continues exactly.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.note import QUICKSTART, TransformerBlock, build_model  # the note's model (its code below names them)
from models.note import batch as note_batch

VOCAB, SEQ, BATCH = QUICKSTART.vocab, QUICKSTART.seq, 8


def note_model(torch_imports: bool) -> nn.Module:
    """The note's code. With ``torch_imports`` its imports are the note's own (torch's names, patched)."""
    if torch_imports:
        return _note_model_with_torch_imports()
    # --- the note's code; its two import lines name this library ----------------------------------
    from functools import partial
    import torch
    from fully_shard import (
        FullyShardedDataParallel as FSDP,
        ShardingStrategy,
        MixedPrecision,
    )
    from fully_shard.wrap import transformer_auto_wrap_policy

    auto_wrap = partial(
        transformer_auto_wrap_policy,
        transformer_layer_cls={TransformerBlock},
    )

    model = FSDP(
        build_model(),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=auto_wrap,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    # ------------------------------------------------------------------------------------------------
    return model


def _note_model_with_torch_imports() -> nn.Module:
    from fully_shard import compat

    compat.patch_torch(fsdp1=True)  # torch's FullyShardedDataParallel is this library's from here on
    # --- the note's code, character for character --------------------------------------------------
    from functools import partial
    import torch
    from torch.distributed.fsdp import (
        FullyShardedDataParallel as FSDP,
        ShardingStrategy,
        MixedPrecision,
    )
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    auto_wrap = partial(
        transformer_auto_wrap_policy,
        transformer_layer_cls={TransformerBlock},
    )

    model = FSDP(
        build_model(),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=auto_wrap,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
    )
    # ------------------------------------------------------------------------------------------------
    compat.unpatch_torch()
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``step`` (a learnable pattern: token t+1 = 3 * token t)."""
    return note_batch(QUICKSTART, step, batch=BATCH, world=dist.get_world_size(), rank=dist.get_rank())


def train(model: Any, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1).to(x.device))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(round(mean.item() / dist.get_world_size(), 4))
    return losses


def local_bytes(model: nn.Module) -> tuple[int, int]:
    """(this rank's parameter bytes, the unsharded model's)."""
    mine = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters())
    return mine, sum(p.numel() * p.element_size() for p in model.parameters())


def say(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--torch-imports", action="store_true", help="run the note's code with torch's imports")
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from fully_shard import FullyShardedDataParallel as FSDP
    from fully_shard import MixedPrecision, ShardingStrategy, StateDictType
    from fully_shard.wrap import transformer_auto_wrap_policy

    world, steps = dist.get_world_size(), range(args.steps)

    say("== 1. the whole model as one unit ==")
    whole = FSDP(build_model())
    say(f"units: {len(FSDP.fsdp_modules(whole))}; losses:",
        train(whole, torch.optim.AdamW(whole.parameters(), lr=3e-3), steps))

    say("\n== 2. one unit per TransformerBlock: the note's code ==")
    model = note_model(args.torch_imports)
    units = FSDP.fsdp_modules(model)
    biggest = max(sum(p.numel() for p in u.module.parameters()) for u in units[1:])
    say(f"{type(model).__name__}: {len(units)} units (the root + {len(units) - 1} blocks); one block's all-gather "
        f"holds {biggest:,} parameters instead of the whole model's {sum(p.numel() for p in model.parameters()):,}")

    say("\n== 3. bf16 mixed precision; each strategy shards as it says ==")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    say("losses (bf16 compute, fp32 master weights):", train(model, opt, steps))
    w = model.module.blocks[0].module.up.weight
    say(f"blocks.0.up.weight: {tuple(w.shape)} {w.dtype}, placements {tuple(w.placements)}, local "
        f"{tuple(w.to_local().shape)}")
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] + (["HYBRID_SHARD"] if world % 2 == 0 and world > 2
                                                                else [])
    for name in strategies:
        mesh = None
        if name == "HYBRID_SHARD":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cuda" if use_cuda else "cpu", (2, world // 2), mesh_dim_names=("replicate",
                                                                                                   "shard"))
        m = FSDP(build_model(), sharding_strategy=ShardingStrategy[name], device_mesh=mesh,
                 auto_wrap_policy=partial_policy(transformer_auto_wrap_policy),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
        mine, full = local_bytes(m)
        say(f"  {name:<14} per-rank parameters {mine:>9,} B of {full:,} B ({mine / full:.3f}; 1/W = {1 / world:.3f})")

    say("\n== 4. save / load: FULL_STATE_DICT and SHARDED_STATE_DICT, model + optimizer ==")
    later = range(args.steps, args.steps + 3)
    path = [tempfile.mkdtemp(prefix="quickstart-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = copy.deepcopy((model.state_dict(), FSDP.optim_state_dict(model, opt)))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}, checkpoint_id=path[0])
    reference = train(model, opt, later)  # the original run goes on
    results = {}
    for kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        fresh = note_model(torch_imports=False)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
        if kind is StateDictType.FULL_STATE_DICT:
            msd, osd = full
        else:
            train(fresh, fresh_opt, range(99, 100))  # optimizer state tensors for DCP to load into
            with FSDP.state_dict_type(fresh, kind):
                target = {"model": fresh.state_dict(), "optim": FSDP.optim_state_dict(fresh, fresh_opt)}
            dcp.load(target, checkpoint_id=path[0])
            msd, osd = target["model"], target["optim"]
        with FSDP.state_dict_type(fresh, kind):
            fresh.load_state_dict(msd)
            fresh_opt.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_opt, osd))
        results[kind.name] = train(fresh, fresh_opt, later)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    say(f"FULL_STATE_DICT: {len(full[0])} tensors; optimizer state of {len(full[1]['state'])} parameters")
    say("original run goes on:      ", reference)
    for name, resumed in results.items():
        say(f"resumed from {name}:", resumed)
    ok = all(resumed == reference for resumed in results.values())
    say("the loss continues:", ok)
    if not ok:
        raise SystemExit("a restored model does not continue the original run")
    dist.destroy_process_group()


def partial_policy(policy: Any) -> Any:
    from functools import partial

    return partial(policy, transformer_layer_cls={TransformerBlock})


if __name__ == "__main__":
    main()
