"""Training text that ships with every Python: the standard library's own ``.py`` sources.

Files are the top-level modules of ``sysconfig.get_paths()['stdlib']`` in sorted order, read as
bytes (vocabulary: the 256 byte values) until ``max_bytes``; the last ``val_fraction`` is held out
for validation. The choice is deterministic for a given Python version.
"""
from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TextData", "stdlib_text", "load_data"]

VOCAB_SIZE = 256


def stdlib_text(max_bytes: int = 600_000) -> tuple[bytes, list[str]]:
    """The first ``max_bytes`` of the sorted top-level stdlib sources, and the file names used."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no .py files in the standard library directory {root}")
    chunks, names, size = [], [], 0
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        names.append(path.name)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes], names


@dataclass
class TextData:
    """Byte tensors for training and validation, with a batch sampler (:func:`load_data` builds it).

    Args:
        train: training bytes, a 1-D int64 tensor of values in [0, 256). :meth:`batch` needs more
            than ``seq_len + 1`` of them (``torch.randint`` raises otherwise).
        val: validation bytes, same kind; fewer than ``seq_len + 1`` give no validation batch.
        files: names of the standard-library files the text was read from (informational).
    """

    train: torch.Tensor
    val: torch.Tensor
    files: list[str]

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of the training text: inputs and next-byte targets."""
        starts = torch.randint(0, self.train.numel() - seq_len - 1, (batch_size,), generator=generator)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        windows = self.train[idx]
        return windows[:, :-1], windows[:, 1:]

    def val_batches(self, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole validation text as non-overlapping windows."""
        n = (self.val.numel() - 1) // seq_len
        x = self.val[: n * seq_len].view(n, seq_len)
        y = self.val[1: n * seq_len + 1].view(n, seq_len)
        return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, n, batch_size)]


def load_data(max_bytes: int = 600_000, val_fraction: float = 0.1) -> TextData:
    """Load :func:`stdlib_text` and split it into training and validation bytes."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction: expected a number in (0, 1), got {val_fraction!r}")
    text, files = stdlib_text(max_bytes)
    codes = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(codes.numel() * (1 - val_fraction))
    return TextData(codes[:split], codes[split:], files)
