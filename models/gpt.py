"""The GPT the examples, benchmarks and GPU checks share: config, model, loss, synthetic batches, tuner factories.

A pre-norm decoder (causal self-attention, a 4x GELU MLP) on token ids, trained on sequences from a fixed
sparse Markov chain (learnable, so the loss falls well below log(vocab)). examples/train_gpt.py trains it
end to end; ``build_model``/``build_batch`` are the tuner's factories
(``python -m fully_shard.tune --model models.gpt:build_model --batch models.gpt:build_batch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 2048
    dim: int = 128
    blocks: int = 4
    heads: int = 4
    seq: int = 64


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.blocks))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.blocks) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(cfg: GPTConfig, batch: int, step: int, rank: int, seed: int = 0,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences from a fixed sparse Markov chain (learnable, so the loss falls well below
    log(vocab)); batch ``step`` of ``rank`` is the same in every run, which makes resuming exact."""
    table = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, cfg.vocab, (cfg.vocab, 4), generator=table)  # 4 likely next tokens
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank + 1)
    tokens = torch.empty(batch, cfg.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (batch,), generator=g)
    choice = torch.randint(0, 4, (batch, cfg.seq), generator=g)
    noise = torch.rand(batch, cfg.seq, generator=g) < 0.1
    random_tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    for t in range(cfg.seq):
        nxt = successors[tokens[:, t], choice[:, t]]
        tokens[:, t + 1] = torch.where(noise[:, t], random_tokens[:, t], nxt)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


# --- tuner factories (python -m fully_shard.tune --model models.gpt:build_model ...) -----------------
# Parameters large next to the activations (short sequences), so the granularity visibly moves memory.
TUNE_CONFIG = GPTConfig(vocab=2048, dim=256, blocks=8, heads=4, seq=32)


def build_model() -> GPT:
    return GPT(TUNE_CONFIG)


def build_batch(rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(TUNE_CONFIG, 4, 0, rank)
