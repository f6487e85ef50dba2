"""Tiny models for the tests: a GPT-like transformer with uneven shapes (vocab 997, dim 60)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has zero true gradient: Adam amplifies its noise
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.gate = nn.Parameter(torch.tensor(0.9))  # a 0-dim parameter (torch's fully_shard refuses these)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.gate * self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 997, dim: int = 60, n_blocks: int = 3, heads: int = 4, hidden: int = 157,
                 seq: int = 16, zero_dim: bool = True, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(n_blocks))
        if not zero_dim:
            for blk in self.blocks:
                del blk.gate
                blk.register_buffer("gate", torch.tensor(0.9))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class AuxGPT(TinyGPT):
    """TinyGPT (2 blocks) with an auxiliary head on the embeddings, returning (logits, aux): a unit whose
    backward runs only on the steps whose loss uses ``aux``, while the implicit backward prefetch (by
    block 0) gathers it on every step."""

    def __init__(self) -> None:
        super().__init__(n_blocks=2, zero_dim=False)  # (torch's fully_shard refuses 0-dim parameters)
        self.aux = nn.Linear(60, 60)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        aux = self.aux(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)), aux


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(n: int, batch: int = 6, seq: int = 16, vocab: int = 997,
            seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((data[:, :-1], data[:, 1:]))
    return out
