"""The founding note's FSDP quick start, end to end, with this library's FSDP1-style front end.

    torchrun --nproc_per_node 2 examples/quickstart.py                      # CPU, gloo, ~20 s
    torchrun --nproc_per_node 4 examples/quickstart.py --strategy HYBRID_SHARD   # 2 replicas x 2 shards

The note's four steps (fsdp-note, "快速开始"), each printed as it runs:

1. the whole model as one unit (``auto_wrap`` with a policy that picks nothing: only the root);
2. ``auto_wrap`` per Transformer block (``ModuleClassPolicy({TransformerBlock})``, FSDP1's
   ``transformer_auto_wrap_policy``): the plan shows how much one all-gather materializes;
3. bf16 mixed precision (fp32 master weights and reduction), and a check that the sharding strategy
   gives the intended degree of sharding (placements and local shard sizes);
4. save and load on a small model: the full state dict (FULL_STATE_DICT) and the sharded checkpoint
   (SHARDED_STATE_DICT, ``fully_shard.checkpoint``), restored into fresh models; the loss continues
   exactly where the original run goes on.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fully_shard import MixedPrecisionPolicy, ShardingStrategy, checkpoint
from fully_shard.comm import trace
from fully_shard.comm.trace import EventKind
from fully_shard.optim.clip import clip_grad_norm_
from fully_shard.wrap import ModuleClassPolicy, PredicatePolicy, WrapPlan, auto_wrap

VOCAB, DIM, HEADS, BLOCKS, SEQ = 512, 64, 4, 4, 32


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(d, dim=-1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(TransformerBlock() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build_model() -> GPT:
    torch.manual_seed(0)  # identical on every rank
    return GPT()


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``step`` (a learnable pattern: token t+1 = 3 * token t)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (8, 1), generator=g)
    seq = (start * 3 ** torch.arange(SEQ + 1)) % VOCAB
    per = 8 // dist.get_world_size()
    rows = seq[dist.get_rank() * per:(dist.get_rank() + 1) * per].to(device)
    return rows[:, :-1], rows[:, 1:]


def loss_of(model: nn.Module, step: int, device: torch.device) -> torch.Tensor:
    x, y = batch(step, device)
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, device: torch.device) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(model, step, device)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(round(mean.item(), 4))
    return losses


def shard(strategy: ShardingStrategy, policy: object, mp: MixedPrecisionPolicy) -> tuple[GPT, WrapPlan]:
    model = build_model()
    mesh = None
    if strategy is ShardingStrategy.HYBRID_SHARD:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        mesh = init_device_mesh(DEVICE.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    return model, auto_wrap(model, policy, strategy=strategy, mesh=mesh, mp_policy=mp)


def bytes_per_step(model: nn.Module, device: torch.device) -> tuple[int, int]:
    with trace.record() as events:
        loss_of(model, 99, device).backward()
    model.zero_grad()
    ag = sum(e.nbytes for e in events if e.kind is EventKind.ALL_GATHER)
    rs = sum(e.nbytes for e in events if e.kind is EventKind.REDUCE_SCATTER)
    return ag, rs


def say(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


DEVICE = torch.device("cpu")


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    strategy = ShardingStrategy[args.strategy]
    fp32 = MixedPrecisionPolicy()
    steps = range(args.steps)

    say("== 1. the whole model as one unit ==")
    model, plan = shard(strategy, PredicatePolicy(lambda fqn, m: False), fp32)
    say(plan.table())
    say("losses:", train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), steps, DEVICE))

    say(f"\n== 2. auto_wrap per TransformerBlock ({strategy.name}) ==")
    model, block_plan = shard(strategy, ModuleClassPolicy({TransformerBlock}), fp32)
    say(block_plan.table())
    say(f"one all-gather now materializes at most {block_plan.peak_gathered_nbytes:,} B "
        f"instead of {plan.peak_gathered_nbytes:,} B")
    say("losses:", train(model, torch.optim.AdamW(model.parameters(), lr=3e-3), steps, DEVICE))
    ag32, rs32 = bytes_per_step(model, DEVICE)

    say("\n== 3. bf16 mixed precision (fp32 master weights, fp32 gradient reduction) ==")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, plan = shard(strategy, ModuleClassPolicy({TransformerBlock}), bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    say("losses:", train(model, opt, steps, DEVICE))
    ag16, rs16 = bytes_per_step(model, DEVICE)
    say(f"bytes per step (all-gather outputs / reduce-scatter inputs, this rank): fp32 {ag32:,} / {rs32:,}; "
        f"bf16 {ag16:,} / {rs16:,}")
    w = model.blocks[0].up.weight
    say(f"strategy check: blocks.0.up.weight {tuple(w.shape)} {w.dtype}, placements {tuple(w.placements)}, "
        f"local shard {tuple(w.to_local().shape)} (shard group of {plan.shard_world})")

    say("\n== 4. save / load: full state dict and sharded checkpoint, then the loss continues ==")
    full = checkpoint.get_model_state_dict(model, full=True, cpu_offload=True)  # FULL_STATE_DICT
    later = range(args.steps, args.steps + 3)
    with tempfile.TemporaryDirectory() as tmp:
        shared = [os.path.join(tmp, "ckpt")]
        dist.broadcast_object_list(shared, src=0)  # rank 0's directory (one machine here)
        path = shared[0]
        checkpoint.save(path, model, opt)  # SHARDED_STATE_DICT: each rank writes its own blocks
        reference = train(model, opt, later, DEVICE)  # the original run goes on
        resumed_model, _ = shard(strategy, ModuleClassPolicy({TransformerBlock}), bf16)
        resumed_opt = torch.optim.AdamW(resumed_model.parameters(), lr=3e-3)
        checkpoint.load(path, resumed_model, resumed_opt)  # weights + optimizer state
        resumed = train(resumed_model, resumed_opt, later, DEVICE)
        dist.barrier()  # nobody deletes the directory while another rank still reads it
    restored, _ = shard(strategy, ModuleClassPolicy({TransformerBlock}), bf16)
    checkpoint.set_model_state_dict(restored, full, full=True)
    with torch.no_grad():
        first = loss_of(restored, later[0], DEVICE)
    dist.all_reduce(first, op=dist.ReduceOp.AVG)
    say(f"full state dict: {len(full)} tensors, {sum(t.numel() for t in full.values()):,} elements; "
        f"restored model's loss on the next batch {first.item():.4f} (the original: {reference[0]:.4f})")
    say("original run goes on:        ", reference)
    say("resumed from the checkpoint: ", resumed)
    ok = resumed == reference and round(first.item(), 4) == reference[0]
    say("the loss continues:", ok)
    if not ok:
        raise SystemExit("a restored model does not continue the original run")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
