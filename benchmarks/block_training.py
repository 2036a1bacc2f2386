"""Fake-quantized training: how far MXFP8 / NVFP4 recipes land from bf16, and what each ingredient buys.

Trains two small models once per (configuration, seed) and prints the final validation loss:

* ``demo``: lowp's demo model (:class:`lowp.demo.model.CharLM`, 2 layers, width 96) on the
  standard-library bytes of :func:`lowp.demo.data.load_data` (300 kB; batches of 8 x 64 bytes;
  validation: the first 6 x 64 windows of the held-out text); its tied output projection is an
  ``F.linear`` on the embedding and is not quantized.
* ``copy``: a 2-layer causal transformer (width 64, 4 heads) on a synthetic copy task: 8 random
  tokens of 16, a separator, the same 8 tokens again; the loss counts the copied half only. Its
  output head (17 classes, not a multiple of a block) stays unquantized.

Every linear layer of the blocks is a :class:`lowp.blocks.BlockQuantLinear` with the run's recipe;
weights, optimizer (torch AdamW) and everything else stay fp32. Configurations:
``fp32`` (no quantization), ``bf16`` (every GEMM operand rounded to bf16: the baseline), ``mxfp8``
(e4m3, RCEIL), ``mxfp8-floor`` (the OCP floor scale), ``nvfp4`` (2D weights, SR on gradients,
16-point RHT on wgrad), ``nvfp4-no-sr``, ``nvfp4-no-rht``, ``nvfp4-no-2d``.

Usage (the numbers in docs/blocks.md): ``PYTHONPATH=$PWD python benchmarks/block_training.py``
(options: ``--models demo,copy --configs ... --seeds 0,1 --steps-demo 200 --steps-copy 300``).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from lowp.blocks import BlockRecipe, get_recipe, quantize_linears
from lowp.demo.model import Block

_FLOOR = "mxfp8_e4m3"


def configs() -> dict[str, BlockRecipe | None]:
    """Configuration name -> recipe (None: no layer replaced)."""
    nv = get_recipe("nvfp4")
    return {
        "fp32": None,
        "bf16": get_recipe("bf16"),
        "mxfp8": get_recipe("mxfp8"),
        "mxfp8-floor": get_recipe("mxfp8").replace(name="mxfp8-floor", inputs=_FLOOR, weights=_FLOOR, grads=_FLOOR),
        "nvfp4": nv,
        "nvfp4-no-sr": nv.replace(name="nvfp4-no-sr", grad_rounding="nearest"),
        "nvfp4-no-rht": nv.replace(name="nvfp4-no-rht", wgrad_hadamard=0),
        "nvfp4-no-2d": nv.replace(name="nvfp4-no-2d", weight_2d=False),
    }


# ---------------------------------------------------------------- the copy task and its model

VOCAB, HALF = 16, 8
SEP = VOCAB


class CopyLM(nn.Module):
    """A 2-layer causal transformer over the copy task's 17 tokens (16 symbols and a separator)."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 2 * HALF + 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB + 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, t, 17)``."""
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def copy_batch(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``s SEP s[:-1]`` and targets ``-100 ... s`` (loss on the copied half only)."""
    s = torch.randint(0, VOCAB, (batch, HALF), generator=gen)
    seq = torch.cat([s, torch.full((batch, 1), SEP), s], 1)
    x, y = seq[:, :-1], seq[:, 1:].clone()
    y[:, :HALF] = -100
    return x, y


# ---------------------------------------------------------------- training

def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``0.1 * lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train(model_name: str, recipe: BlockRecipe | None, seed: int, steps: int) -> float:
    """Train one run; the final validation loss (nats)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if model_name == "demo":
        from lowp.demo.data import load_data
        from lowp.demo.model import CharLM

        data = load_data(300_000)
        model: nn.Module = CharLM(dim=96, layers=2, heads=4, seq_len=64)
        lr, batch = 2e-3, 8

        def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
            return data.batch(batch, 64, gen)
        val = data.val_batches(64, 64)[:6]
    else:
        model = CopyLM()
        lr, batch = 2e-3, 32

        def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
            return copy_batch(batch, gen)
        vgen = torch.Generator().manual_seed(10_000)
        val = [copy_batch(256, vgen) for _ in range(2)]
    if recipe is not None:
        quantize_linears(model, recipe, include=lambda name, mod: name.startswith("blocks."), seed=seed * 1000)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos"]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "pos")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.99),
                            weight_decay=0.1)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=30)
        x, y = get_batch()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in val:
            total += float(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"))
            count += int((y != -100).sum())
    return total / count


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,copy")
    parser.add_argument("--configs", default=",".join(configs()))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps-demo", type=int, default=200)
    parser.add_argument("--steps-copy", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = configs()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in table]
    if unknown:
        parser.error(f"argument --configs: unknown {unknown}; known: {', '.join(table)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[tuple[str, str], list[float]] = {}
    for model_name in args.models.split(","):
        steps = args.steps_demo if model_name == "demo" else args.steps_copy
        for name in names:
            for seed in seeds:
                start = time.perf_counter()
                loss = train(model_name, table[name], seed, steps)
                results.setdefault((model_name, name), []).append(loss)
                took = time.perf_counter() - start
                print(f"{model_name:5} {name:12} seed {seed}: val loss {loss:.4f}  ({took:.0f} s)", flush=True)
    print("\n| model | config | val loss (mean) | per seed | vs bf16 |\n|---|---|---|---|---|")
    for (model_name, name), losses in results.items():
        base = results.get((model_name, "bf16"))
        mean = statistics.fmean(losses)
        delta = f"{mean - statistics.fmean(base):+.4f}" if base else "-"
        print(f"| {model_name} | {name} | {mean:.4f} | {', '.join(f'{v:.4f}' for v in losses)} | {delta} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
