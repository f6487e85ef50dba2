"""RL-style weight sync: 2 trainer ranks (fully_shard) and a separate generator process, deltas every step.

    python examples/rl_weight_sync.py            # starts 3 CPU processes itself (torchrun --nproc_per_node 3)

Ranks 0 and 1 train a small Llama (built from a config, nothing downloaded) sharded with fully_shard on a
mesh of those two ranks. Rank 2 is the "generator": a plain Hugging Face model, as an inference engine
holds it, that samples with ``generate()``. Every step the trainers send their weights with
``fully_shard.weights.Sender(dtype=torch.bfloat16, delta=True)`` (the first send is full; then each rank
sends only the elements of its own shard whose bf16 value changed: few, at RL's small learning rates) and
the generator applies them with ``Receiver`` before generating again; the generator prints what it
received, and at the end the trainer checks that the generator's weights equal its own full weights
(cast to bf16) bit for bit.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

TRAINERS, GENERATOR = [0, 1], 2
STEPS = 4


def build() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def trainer(mesh: DeviceMesh) -> None:
    from fully_shard import fully_shard
    from fully_shard.weights import Sender, iter_full

    model = build()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # RL fine-tuning's small steps
    # group=None: the default group (ranks 0-2); bf16 on the wire and in the generator, as engines run
    sender = Sender(model, group=None, dst=GENERATOR, dtype=torch.bfloat16, delta=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(STEPS):
        ids = torch.randint(0, 128, (4, 16), generator=g)  # stand-in for the rollouts' tokens and rewards
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = sender.send()
        if dist.get_rank() == 0:
            print(f"[trainer] step {step}: loss {loss.item():.4f}, sent {stats.mode} {stats.bytes / 1024:.1f} KiB "
                  f"in {stats.seconds * 1e3:.0f} ms", flush=True)
    full = dict(iter_full(model, dtype=torch.bfloat16, rank=0))
    held: list[object] = [None]
    if dist.get_rank() == 0:
        dist.recv_object_list(held, src=GENERATOR)
        same = all(torch.equal(full[k], held[0][k]) for k in full)  # type: ignore[index]
        print(f"[trainer] generator's weights equal the trainer's full weights bitwise: {same}", flush=True)
        assert same


def generator() -> None:
    from fully_shard.weights import Receiver

    model = build().to(torch.bfloat16)  # a plain copy, as the inference engine holds it
    model.eval()
    receiver = Receiver(model, group=None, src=0)
    prompt = torch.tensor([[1, 2, 3, 4]])
    for step in range(STEPS):
        stats = receiver.receive()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        print(f"[generator] step {step}: received {stats.mode} ({stats.elements} elements, "
              f"{stats.bytes / 1024:.1f} KiB), generated {out[0, 4:].tolist()}", flush=True)
    dist.send_object_list([{k: v.clone() for k, v in model.state_dict().items()}], dst=0)


def main() -> None:
    if "RANK" not in os.environ:
        from torch.distributed.run import main as torchrun

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        torchrun(["--standalone", "--nproc_per_node=3", __file__, *sys.argv[1:]])
        return
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = DeviceMesh("cpu", torch.tensor(TRAINERS), mesh_dim_names=("dp",))  # built on every rank (collective)
    if dist.get_rank() in TRAINERS:
        trainer(mesh)
    else:
        generator()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
