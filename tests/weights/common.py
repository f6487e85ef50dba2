"""Shared pieces of the weights tests: tiny HF models built from configs (no downloads), the trainer mesh,
a training step and the truth (``full_tensor`` of every state_dict entry)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=101, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
MIXTRAL = dict(vocab_size=61, hidden_size=16, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


def llama(tie: bool, seed: int = 0, **overrides: Any) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **overrides}, tie_word_embeddings=tie))


def mixtral(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))


def trainer_mesh(ranks: list[int]) -> DeviceMesh:
    """A 1-D mesh over ``ranks`` (built on every rank of the job: the receiver is outside it)."""
    return DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=("dp",))


def shard_hf(model: nn.Module, mesh: DeviceMesh | None = None, **kw: Any) -> nn.Module:
    """One unit per decoder layer plus the root (embeddings, norm, head), as the recipes do."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def truth(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every state_dict entry made whole by DTensor's own ``full_tensor`` (tied tensors once), cast."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        out[name] = full.to(dtype) if dtype is not None else full.clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ (bitwise, dtype and shape included) or are in only one."""
    bad = sorted(set(a) ^ set(b))
    bad += [k for k in a if k in b and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    return bad


class Odd(nn.Module):
    """Uneven rows (7 over 2 or 3 ranks), a Shard(1) weight, a 0-dim scale, a persistent and a non-persistent
    buffer, a parameter left out by ignored_params."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 4, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.pos = nn.Parameter(torch.randn(3, 5))  # ignored by fully_shard
        self.register_buffer("stat", torch.arange(4.0))
        self.register_buffer("cache", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x + self.pos.sum(0).to(x.dtype)))) * self.scale + self.stat
