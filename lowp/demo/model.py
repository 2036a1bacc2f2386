"""A small decoder-only transformer over bytes (pre-norm, learned positions, tied embeddings).

Weights may be stored in bf16/fp16; every layer computes in ``compute_dtype`` (fp32 by default,
because CPUs without bf16 units multiply bf16 matrices slowly), casting its weights on the fly.
Gradients therefore arrive in the weights' own dtype, and the optimizer sees exactly what a
pure-bf16 training run would store.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Block", "CharLM"]


class _Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class _LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class Block(nn.Module):
    """A pre-norm causal transformer block: attention and a 4x MLP, each added back.

    Args:
        dim: width (a multiple of ``heads``).
        heads: attention heads.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = _LayerNorm(dim), _LayerNorm(dim)
        self.qkv, self.proj = _Linear(dim, 3 * dim), _Linear(dim, dim)
        self.fc, self.out = _Linear(dim, 4 * dim), _Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + attention(norm1(x))``, then plus ``mlp(norm2(.))``; ``x`` of shape ``(batch, t, dim)``."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class CharLM(nn.Module):
    """``CharLM(vocab=256, dim=96, layers=2, heads=4, seq_len=64)``: logits for the next byte.

    ``forward(idx)`` maps int64 tokens of shape ``(batch, t)``, ``t <= seq_len``, to logits of
    shape ``(batch, t, vocab)`` in ``compute_dtype``.

    Args:
        vocab: vocabulary size (default 256, one token per byte value); token ids must be below it.
        dim: model width (default 96); must be a multiple of ``heads`` (``ValueError`` otherwise).
        layers: transformer blocks (default 2; 0 gives embedding, final norm and tied output only).
        heads: attention heads per block (default 4).
        seq_len: longest input sequence, the number of learned positions (default 64); longer
            inputs fail in the position addition.
        compute_dtype: dtype every layer computes in, whatever dtype the weights are stored in
            (default ``torch.float32``); weights are cast to it on the fly.
    """

    def __init__(self, vocab: int = 256, dim: int = 96, layers: int = 2, heads: int = 4, seq_len: int = 64,
                 compute_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim: expected a multiple of heads={heads}, got {dim}")
        self.compute_dtype = compute_dtype
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = _LayerNorm(dim)
        for name, p in self.named_parameters():
            if p.dim() == 2 and name != "pos":
                nn.init.normal_(p, std=0.02 if "out" not in name and "proj" not in name
                                else 0.02 / math.sqrt(2 * layers))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-byte logits ``(batch, t, vocab)`` for tokens ``idx`` of shape ``(batch, t)``."""
        x = self.embed(idx).to(self.compute_dtype) + self.pos[: idx.shape[1]].to(self.compute_dtype)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight.to(self.compute_dtype))
