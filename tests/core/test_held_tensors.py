"""Host memory the runtime keeps between steps: the tensor objects it holds (issue 23 part 2).

A tensor object kept by the runtime stays for the process's lifetime: its Python object and
``TensorImpl`` (about 0.5 KiB of host heap each, however small its data). The host-work caching had
kept two per parameter (the flattened shard for the copy-in and the ``(world, size)`` copy-out rows,
next to the storage's own write tensor), ~0.6 MiB on ``memory.py --shape small``'s 581 parameters,
which made this library's peak RSS there ~1 MiB more than torch's ``fully_shard`` (benchmarks/README.md,
"Memory by rule"), and one zeros tensor per padded parameter (now one per padding size). Counted here as the live tensor
objects a model, its sharding and an AdamW optimizer leave after two training steps, against torch's
``fully_shard`` on the same model (24 parameters, 16 of them padded on rank 1: 269 and 271 tensor
objects against torch's 272; 317 with the cached views and zeros)."""

from __future__ import annotations

import gc

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fully_shard import fully_shard
from tests.distributed.harness import distributed


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@distributed(world_size=2)
def _held_after_steps(variant: str) -> tuple[int, int]:
    """(tensor objects alive after two steps minus before the model was built, parameters)."""
    before = _live_tensors()
    torch.manual_seed(0)
    # 5 rows over 2 ranks: the Linear's weight and bias are padded on rank 1; the LayerNorm's are not
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 6)) for _ in range(4)])
    shard = fully_shard if variant == "ours" else torch_fully_shard
    for block in model:
        shard(block)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(3, 6)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del x
    n_params = len(list(model.parameters()))
    return _live_tensors() - before, n_params


def test_holds_no_more_tensor_objects_than_torch_fully_shard() -> None:
    ours = _held_after_steps("ours")
    torch_ref = _held_after_steps("torch")
    for rank, ((held, n_params), (torch_held, _)) in enumerate(zip(ours, torch_ref)):
        # the parameters, their AdamW states and torch's per-parameter objects (sharded and unsharded
        # forms, their storages' tensors) are on both sides; a cached view per parameter is not
        assert held <= torch_held, (f"rank {rank}: this library holds {held} tensor objects after two steps of "
                                    f"a {n_params}-parameter model, torch's fully_shard {torch_held}")
