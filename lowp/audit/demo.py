"""A tiny transformer-style model and inputs that provoke fp16 problems, for ``lowp doctor``.

The block has unscaled attention scores (``q @ k^T`` without ``1/sqrt(d)``), so large inputs make
the scores overflow fp16's 65504, and the loss is multiplied by a small factor, so gradients
underflow fp16 (values below 2**-25 become zero) -- the two classic reasons for loss scaling and
for keeping some modules in fp32.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["DemoModel", "demo_batch", "run_demo", "CLASSES"]

#: Output classes of :class:`DemoModel` and labels of :func:`demo_batch` (one number for both).
CLASSES = 8


class Scores(nn.Module):
    """Attention scores ``q @ k^T`` (a module so hooks see them)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-2, -1)


class DemoBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.scores = Scores()
        self.softmax = nn.Softmax(dim=-1)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        x = x + self.softmax(self.scores(q, k)) @ v
        return x + self.mlp(self.norm(x))


class DemoModel(nn.Module):
    """Embedding projection, one attention+MLP block, and a linear head.

    The input has shape ``(batch, tokens, features)``, the output ``(batch, tokens, classes)``.

    Args:
        features: input features per token (default 16); must match :func:`demo_batch`'s.
        width: width of the block (default 32); the MLP is ``4 * width`` wide.
        classes: output classes (default :data:`CLASSES`).

    Negative sizes raise torch's ``RuntimeError`` when the model is built; 0 builds an empty model.
    """

    def __init__(self, features: int = 16, width: int = 32, classes: int = CLASSES) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.block = DemoBlock(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits per token."""
        return self.head(self.block(self.embed(x)))


def demo_batch(batch: int = 4, tokens: int = 8, features: int = 16, scale: float = 300.0,
               seed: int = 0, classes: int = CLASSES) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``scale * N(0, 1)`` (large enough to overflow fp16 attention scores) and class labels
    in ``[0, classes)`` (match the model's ``classes``)."""
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(batch, tokens, features, generator=g)
    y = torch.randint(0, classes, (batch, tokens), generator=g)
    return x, y


def run_demo(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_factor: float = 1e-6) -> torch.Tensor:
    """One forward and backward pass; the loss is scaled by ``loss_factor`` so gradients are tiny."""
    logits = model(x)
    classes = logits.shape[-1]
    if y.shape != logits.shape[:-1]:
        raise ValueError(f"y: expected labels of shape {tuple(logits.shape[:-1])}, got {tuple(y.shape)}")
    if bool(((y < 0) | (y >= classes)).any()):
        raise ValueError(f"y: expected labels in [0, {classes}) (the model's classes), "
                         f"got values in [{int(y.min())}, {int(y.max())}]")
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) * loss_factor
    with warnings.catch_warnings():  # full backward hooks warn when the input needs no grad
        warnings.simplefilter("ignore", UserWarning)
        loss.backward()
    return loss.detach()
