"""Train :class:`~lowp.demo.model.CharLM` once per precision setting and record the losses.

Every run starts from the same fp32 initialisation (cast to the run's weight dtype), sees the
same batches and uses AdamW with linear warm-up and cosine decay; only the storage precision of
weights, gradients and states and the update mode differ.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from lowp.demo.data import TextData
from lowp.demo.model import CharLM
from lowp.optim import AdamW
from lowp.optim.convert import KEEP_FP32_TYPES, cast_model

__all__ = ["RUNS", "RUN_STATES", "DemoConfig", "RunResult", "train_run", "build_model", "param_groups", "lr_at",
           "train_loop", "evaluate", "bytes_per_param"]

#: run name -> (weight dtype, update mode)
RUNS: dict[str, tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "nearest"),
    "bf16-nearest": (torch.bfloat16, "nearest"),
    "bf16-kahan": (torch.bfloat16, "kahan"),
    "bf16-stochastic": (torch.bfloat16, "stochastic"),
    "bf16-exact": (torch.bfloat16, "exact"),
    "bf16-exact8": (torch.bfloat16, "exact8"),
    "bf16-8bit": (torch.bfloat16, "exact8"),
    "bf16-4bit": (torch.bfloat16, "stochastic"),
    "fp16-kahan": (torch.float16, "kahan"),
}
#: run name -> the ``state_dtype`` of runs with block-scaled states (others: the default)
RUN_STATES: dict[str, dict[str, torch.dtype]] = {
    "bf16-8bit": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
    "bf16-4bit": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint4},  # type: ignore[attr-defined]
}


@dataclass
class DemoConfig:
    """Settings of one demo training run; the defaults are the settings measured in docs/optimizers.md.

    The fields are not validated here (``lowp demo`` checks its options before building one).

    Args:
        batch_size: sequences of ``seq_len`` bytes per step (default 16).
        seq_len: bytes per training sequence and positions of the model (default 64).
        dim: transformer width (default 96), a multiple of ``heads``.
        layers: transformer blocks (default 2).
        heads: attention heads (default 4).
        steps: optimizer steps (default 700); at least 1, as the last step is always evaluated.
        lr: peak AdamW learning rate (default 2e-3).
        min_lr_ratio: the cosine decay ends at ``min_lr_ratio * lr`` (default 0.1).
        warmup: steps of linear warm-up from ``lr / warmup`` to ``lr`` (default 50; 0 starts the
            cosine at once).
        weight_decay: decoupled weight decay on the matrices (default 0.1); biases, norms and
            positions get none.
        eval_every: steps between points of the validation curve (default 50; at least 1).
        eval_batches: validation batches (of 64 sequences) per curve point (default 8); the final
            loss uses the whole validation text.
        seed: seed of the initialisation, the batches and stochastic rounding (default 0).
        keep_norms_fp32: keep LayerNorm weights in fp32 in the low-precision runs (default ``False``).
        vocab: vocabulary of the model (default 256, the byte values); the data's tokens must be below it.
    """

    batch_size: int = 16          # sequences of seq_len bytes per step
    seq_len: int = 64
    dim: int = 96                 # transformer width, depth and heads
    layers: int = 2
    heads: int = 4
    steps: int = 700              # AdamW: linear warm-up, then cosine decay to min_lr_ratio * lr
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1     # decoupled, on matrices only
    eval_every: int = 50          # curve points on eval_batches validation batches
    eval_batches: int = 8
    seed: int = 0
    keep_norms_fp32: bool = False
    vocab: int = 256


@dataclass
class RunResult:
    """Outcome of one demo run (:func:`train_run`).

    Args:
        name: the run's key in :data:`RUNS` (e.g. ``"bf16-kahan"``).
        val_loss: final mean next-byte cross-entropy on the whole validation text, in nats.
        bytes_per_param: bytes of weights, gradients and optimizer states per parameter.
        seconds: wall-clock training time (the curve's evaluations included, the final one not).
        curve: ``(step, validation loss)`` points, every ``eval_every`` steps and at the last
            (default: empty).
        stalled_fraction: fraction of the first parameter group's elements whose stored weight
            did not change in the last evaluated step (default 0.0).
    """

    name: str
    val_loss: float
    bytes_per_param: float
    seconds: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    stalled_fraction: float = 0.0


def lr_at(step: int, cfg: DemoConfig) -> float:
    """The learning rate of step ``step`` (from 0): linear warm-up over ``cfg.warmup`` steps to
    ``cfg.lr``, then ``lr * (r + (1 - r) * (1 + cos(pi * p)) / 2)`` with ``r = cfg.min_lr_ratio``
    and ``p`` the fraction of the remaining steps done (Loshchilov & Hutter, "SGDR", 2017)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: CharLM, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-byte cross-entropy (nats) over ``batches``."""
    total, count = 0.0, 0
    for x, y in batches:
        total += float(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum"))
        count += y.numel()
    return total / count


def bytes_per_param(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Bytes of weights + gradients + optimizer-state tensors per parameter."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    weights = sum(p.numel() * p.element_size() for p in params)  # a gradient has its weight's dtype: as much again
    states = sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor))
    return (2 * weights + states) / n


def build_model(cfg: DemoConfig, dtype: torch.dtype) -> CharLM:
    """The demo model of ``cfg``, initialised from ``cfg.seed`` in fp32 and then cast to ``dtype``
    (LayerNorm weights stay fp32 with ``cfg.keep_norms_fp32``)."""
    torch.manual_seed(cfg.seed)
    model = CharLM(vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq_len=cfg.seq_len)
    if dtype != torch.float32:
        cast_model(model, dtype, keep_types=KEEP_FP32_TYPES if cfg.keep_norms_fp32 else (), keep_names=())
    return model


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Two parameter groups: the matrices (decayed) and the rest (biases, norms and positions),
    whose ``weight_decay`` is 0."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "pos"]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "pos")]
    return [{"params": decay}, {"params": other, "weight_decay": 0.0}]


def train_loop(model: CharLM, opt: torch.optim.Optimizer, data: TextData, cfg: DemoConfig, progress=None,
               on_eval: Callable[[int], None] | None = None) -> tuple[list[tuple[int, float]], float]:
    """Train ``model`` with ``opt`` (any torch optimizer) for ``cfg.steps`` steps on batches of
    ``data`` drawn from ``cfg.seed + 1``, the learning rate following :func:`lr_at`; every
    ``cfg.eval_every`` steps and at the last, the loss on the first ``cfg.eval_batches``
    validation batches joins the curve and ``on_eval(step)`` is called. Returns the curve and
    the seconds taken; ``progress`` (a tqdm bar or ``None``) is advanced once per step."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    val = data.val_batches(64, cfg.seq_len)
    curve, start = [], time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = data.batch(cfg.batch_size, cfg.seq_len, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            curve.append((step + 1, evaluate(model, val[: cfg.eval_batches])))
            if on_eval is not None:
                on_eval(step + 1)
        if progress is not None:
            progress.update(1)
    return curve, time.perf_counter() - start


def train_run(name: str, data: TextData, cfg: DemoConfig, progress=None) -> RunResult:
    """Train one run; ``progress`` (a tqdm bar or ``None``) is advanced once per step."""
    dtype, mode = RUNS[name]
    model = build_model(cfg, dtype)
    opt = AdamW(param_groups(model), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay, mode=mode,
                seed=cfg.seed, state_dtype=RUN_STATES.get(name))
    stalled: list[float] = []
    curve, seconds = train_loop(model, opt, data, cfg, progress,
                                lambda step: stalled.append(opt.diagnostics()[0]["stalled_fraction"]))
    return RunResult(name, evaluate(model, data.val_batches(64, cfg.seq_len)), bytes_per_param(model, opt),
                     seconds, curve, stalled[-1])
