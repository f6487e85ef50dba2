"""The founding note's quick start (fsdp-note, "快速开始"), verbatim, and the small model it runs on here.

``NOTE_CODE`` is the note's skeleton character for character: torch's imports, FSDP1 with a
``transformer_auto_wrap_policy`` per ``TransformerBlock`` and bf16 mixed precision. ``run_note`` executes
it as written (torch's imports: run it after ``compat.patch_torch(fsdp1=True)`` to get this library),
with this library's imports (the two import statements swapped, nothing else), or with another
strategy/dtype substituted (the test matrix). ``TransformerBlock`` and ``build_model`` are what the note
leaves to the reader: models/note.py's, smaller than the quickstart's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models import note
from models.note import GPT, NoteSizes, TransformerBlock

NOTE_CODE = '''\
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
'''

OUR_IMPORTS = (("from torch.distributed.fsdp import (", "from fully_shard import ("),
               ("from torch.distributed.fsdp.wrap import", "from fully_shard.wrap import"))

SIZES = NoteSizes(vocab=128, dim=32, heads=4, blocks=2, seq=16)  # the quickstart's model, smaller
VOCAB, SEQ, BATCH = SIZES.vocab, SIZES.seq, 8


def build_model() -> GPT:
    """The note's ``build_model()`` here: models/note.py's GPT at ``SIZES`` (the same weights on every rank)."""
    return note.build_model(SIZES)


def note_code(*, strategy: str = "FULL_SHARD", dtype: str | None = "bfloat16", ours: bool = False,
              extra: str = "") -> str:
    """The note's code; ``strategy``/``dtype`` substituted (``dtype=None``: no mixed precision), ``ours``:
    this library's imports; ``extra``: more FSDP arguments (e.g. the torch reference's ``device_id``)."""
    code = NOTE_CODE
    if strategy != "FULL_SHARD":
        code = code.replace("ShardingStrategy.FULL_SHARD", f"ShardingStrategy.{strategy}")
    if dtype is None:
        code = code.replace("    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),\n", "")
    elif dtype != "bfloat16":
        code = code.replace("torch.bfloat16", f"torch.{dtype}")
    if extra:
        code = code.replace("    auto_wrap_policy=auto_wrap,\n", f"    auto_wrap_policy=auto_wrap,\n    {extra},\n")
    if ours:
        for theirs, mine in OUR_IMPORTS:
            code = code.replace(theirs, mine)
    return code


def run_note(code: str, **names: Any) -> nn.Module:
    """Execute ``code`` with ``TransformerBlock``/``build_model`` (and ``names``) defined; its ``model``."""
    scope: dict[str, Any] = {"TransformerBlock": TransformerBlock, "build_model": build_model, **names}
    exec(compile(code, "<fsdp-note quick start>", "exec"), scope)
    model: nn.Module = scope["model"]
    return model


def batch(step: int, *, world: int | None = None, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``step`` (a learnable pattern: token t+1 = 3 * token t)."""
    return note.batch(SIZES, step, batch=BATCH, world=dist.get_world_size() if world is None else world,
                      rank=dist.get_rank() if rank is None else rank)


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return F.cross_entropy(model(x).float().reshape(-1, VOCAB), y.reshape(-1))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, *, clip: float | None = 1.0
          ) -> tuple[list[float], list[float]]:
    """Per-step global mean losses and clip_grad_norm_ totals (the model's own method, as FSDP1 code calls it)."""
    losses, norms = [], []
    for step in steps:
        loss = loss_of(model, step)
        loss.backward()
        if clip is not None:
            norms.append(float(model.clip_grad_norm_(clip)))  # type: ignore[operator]
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses, norms
