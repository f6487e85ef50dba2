"""Fine-tune a Hugging Face model with fully_shard: meta init, shard, load_hf, train, save_hf, from_pretrained.

    torchrun --nproc_per_node 2 examples/finetune_hf.py                       # a tiny Llama made here, CPU
    torchrun --nproc_per_node 2 examples/finetune_hf.py --model /path/to/hf/dir --out /path/to/out

Without ``--model`` a small Llama is built from a config and saved with ``save_pretrained`` (nothing is
downloaded). Every rank then builds the model on the meta device (no memory), shards it with
fully_shard, materializes only its shards, restores the non-persistent buffers the meta device left
empty (rotary frequencies), and reads its blocks of the weights with ``checkpoint.load_hf``. Logits
are checked against ``from_pretrained`` (one process, unsharded), a few AdamW steps are taken, the
result is written with ``checkpoint.save_hf`` plus the config/tokenizer files copied by rank 0, and
``from_pretrained`` on that directory must give the sharded model's logits.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fully_shard import fully_shard
from fully_shard.checkpoint import load_hf, save_hf


def make_pretrained(path: str) -> None:
    """A small random Llama saved as a Hugging Face directory (stands in for a downloaded one)."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def restore_buffers(model: nn.Module) -> None:
    """Recompute non-persistent buffers (not in the weights files), which ``to_empty`` left uninitialized."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            fresh = type(module)(config=module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)


def build(path: str, device: torch.device) -> nn.Module:
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # the root unit holds the embedding, the final norm and lm_head (tied or not)
    model.to_empty(device=device)
    with torch.no_grad():
        restore_buffers(model)
    load_hf(path, model)  # each rank reads only its blocks; bf16 files -> fp32 parameters
    return model


def copy_side_files(src: str, dst: str) -> None:
    """config.json, generation_config.json, tokenizer files: everything but the weights (rank 0)."""
    for name in os.listdir(src):
        if not (name.startswith("model") and ".safetensors" in name):
            full = os.path.join(src, name)
            if os.path.isfile(full):
                shutil.copy2(full, os.path.join(dst, name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a save_pretrained directory (default: build a tiny Llama)")
    ap.add_argument("--out", help="where save_hf writes (default: a temporary directory)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import transformers

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    tmp = tempfile.mkdtemp() if rank == 0 else ""
    shared = [tmp]
    dist.broadcast_object_list(shared)
    src = args.model or os.path.join(shared[0], "pretrained")
    out = args.out or os.path.join(shared[0], "finetuned")
    if args.model is None and rank == 0:
        make_pretrained(src)
    dist.barrier()

    model = build(src, device)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ours = model(ids).logits.float().cpu()
        reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids.cpu()).logits
    print(f"rank {rank}: loaded, max |logits - from_pretrained| = {(ours - reference).abs().max():.2e}", flush=True)
    if (ours - reference).abs().max() > 1e-5:
        raise SystemExit("load_hf does not reproduce from_pretrained's logits")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    for step in range(args.steps):
        batch = torch.randint(0, model.config.vocab_size, (4, 16), generator=g).to(device)
        loss = model(batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    save_hf(out, model)  # each file written by one rank; config and tokenizer are ours to copy
    if rank == 0:
        copy_side_files(src, out)
    dist.barrier()
    with torch.no_grad():
        ours = model(ids).logits.float().cpu()
    if rank == 0:
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            diff = (back(ids.cpu()).logits - ours).abs().max().item()
        print(f"from_pretrained({out}): max |logits - sharded model| = {diff:.2e}", flush=True)
        if diff > 1e-5:
            raise SystemExit("the saved model does not reproduce the sharded model's logits")
    dist.barrier()
    if args.model is None and args.out is None and rank == 0:
        shutil.rmtree(shared[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
