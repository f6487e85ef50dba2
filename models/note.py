"""The founding note's model: the ``TransformerBlock`` and ``build_model`` its quick start leaves to the reader.

The note (fsdp-note, "快速开始") wraps ``build_model()`` in FSDP1 with a ``transformer_auto_wrap_policy`` per
``TransformerBlock``. A small pre-norm GPT on token ids, trained on a learnable pattern (token t+1 = 3 *
token t mod vocab): examples/quickstart.py runs it at ``QUICKSTART``'s sizes (``build_model()``, as the note
calls it), benchmarks/fsdp1.py at any, tests/wrap/note.py smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class NoteSizes:
    vocab: int = 512
    dim: int = 64
    heads: int = 4
    blocks: int = 4
    seq: int = 32


QUICKSTART = NoteSizes()  # 0.27M parameters


class TransformerBlock(nn.Module):
    def __init__(self, sizes: NoteSizes = QUICKSTART) -> None:
        super().__init__()
        self.heads = sizes.heads
        self.norm1, self.norm2 = nn.LayerNorm(sizes.dim), nn.LayerNorm(sizes.dim)
        # no qkv bias: a key bias has zero true gradient, and AdamW turns its rounding noise into +-lr steps
        self.qkv, self.proj = nn.Linear(sizes.dim, 3 * sizes.dim, bias=False), nn.Linear(sizes.dim, sizes.dim)
        self.up, self.down = nn.Linear(sizes.dim, 4 * sizes.dim), nn.Linear(4 * sizes.dim, sizes.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(d, dim=-1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, sizes: NoteSizes = QUICKSTART) -> None:
        super().__init__()
        self.tok = nn.Embedding(sizes.vocab, sizes.dim)
        self.pos = nn.Parameter(torch.randn(sizes.seq, sizes.dim) * 0.02)
        self.blocks = nn.ModuleList(TransformerBlock(sizes) for _ in range(sizes.blocks))
        self.norm = nn.LayerNorm(sizes.dim)
        self.head = nn.Linear(sizes.dim, sizes.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build_model(sizes: NoteSizes = QUICKSTART) -> GPT:
    torch.manual_seed(0)  # identical on every rank
    return GPT(sizes)


def batch(sizes: NoteSizes, step: int, *, batch: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice (of ``world``) of global batch ``step``: ``batch`` sequences of the pattern."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, sizes.vocab, (batch, 1), generator=g)
    seq = (start * 3 ** torch.arange(sizes.seq + 1)) % sizes.vocab
    per = batch // world
    rows = seq[rank * per:(rank + 1) * per]
    return rows[:, :-1], rows[:, 1:]
