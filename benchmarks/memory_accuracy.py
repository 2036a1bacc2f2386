"""Accuracy and memory of low-memory AdamW configurations, measured in one run.

Accuracy: each configuration trains two models from the same initialisation on the same batches
(``lowp.demo.train.train_loop``: linear warm-up, cosine decay to 0.1 lr) and its final validation
loss (mean over fixed validation batches) is compared with ``torch.optim.AdamW`` on fp32 weights,
the reference; the same fp32 run from two other seeds shows how large run-to-run noise is.

* ``demo``: the demo model (``lowp.demo``: a byte-level transformer on Python's stdlib sources).
* ``markov``: the demo's transformer, 3 layers of width 64 over 32 tokens, on a synthetic language whose next
  token depends on the three before it (additive random logits of each plus a random table of
  the last two, ``_markov_data``); training and validation text are independent samples of the
  same source, whose own cross-entropy on the validation text (the floor no model can beat) is
  printed beside it.

Two regimes: lr 1e-3 / weight decay 0.01 and lr 3e-4 / weight decay 0.1, betas (0.9, 0.999);
decay applies to matrices only. The encoding ablations train the demo model in the first regime.

Memory: bytes per parameter of weights + optimizer states (gradients excluded) come from the
optimizer's real tensors (``lowp.footprint.measure``) on the memory model, a demo transformer of
~28M parameters (width 768, 4 layers) computing in its weights' dtype; its peak training memory
is the peak of torch.profiler's CPU memory events (``lowp.optim.speed.profiled_peak_bytes``)
over building the model and the optimizer and two training steps (forward, backward, ``step``),
with and without gradient release (``lowp.optim.release_gradients``, lowp's optimizers only).

torchao's ``AdamW8bit`` (on fp32 weights) is a baseline when ``torchao`` is importable; its step
runs eagerly (``torch.compile`` replaced by the identity, as in ``lowp memory``): compiling it
takes minutes on a CPU and does not change its algorithm.

Every run is single-threaded and runs one after another. Results are in docs/memory.md.

    python benchmarks/memory_accuracy.py [--quick] [--models demo markov] [--configs NAME ...] [--no-memory]
        [--no-ablation] [--markdown] [--json PATH] [--cache PATH]
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.nn import functional as F

import lowp.optim as lo
from lowp.demo.data import TextData, load_data
from lowp.demo.model import CharLM
from lowp.demo.train import DemoConfig, build_model, evaluate, param_groups, train_loop
from lowp.footprint.measure import Footprint, measure
from lowp.optim.speed import profiled_peak_bytes
from lowp.report import markdown_table, text_table

Groups = list[dict[str, Any]]
Maker = Callable[[Groups, float, float, int], torch.optim.Optimizer]

BETAS = (0.9, 0.999)
#: regime name -> (peak learning rate, weight decay)
REGIMES = {"lr1e-3/wd0.01": (1e-3, 0.01), "lr3e-4/wd0.1": (3e-4, 0.1)}
REFERENCE = "fp32 AdamW"
EIGHT_BIT = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


class Unavailable(Exception):
    """A configuration that cannot run here (its library is missing); the message says why."""


@dataclass(frozen=True)
class Setup:
    """One configuration: a name, the weights' dtype and how to build its optimizer.

    Args:
        name: the row's name.
        weights: the dtype the model's weights are stored in.
        make: ``make(param_groups, lr, weight_decay, seed)`` -> optimizer; raises
            :class:`Unavailable` when it cannot run here.
        seed_offset: added to the run's seed (initialisation, batches, rounding).
        note: what the configuration is, for the tables' footnotes.
        releasable: whether gradient release applies (lowp's optimizers).
    """

    name: str
    weights: torch.dtype
    make: Maker
    seed_offset: int = 0
    note: str = ""
    releasable: bool = False


def _torch(groups: Groups, lr: float, wd: float, seed: int) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, weight_decay=wd)


def _lowp(groups: Groups, lr: float, wd: float, seed: int, **options: Any) -> torch.optim.Optimizer:
    return lo.AdamW(groups, lr=lr, betas=BETAS, weight_decay=wd, seed=seed, **options)


@contextmanager
def _eager_compile() -> Iterator[None]:
    """``torch.compile`` as the identity inside the block (torchao compiles its step per call)."""
    with mock.patch("torch.compile", lambda fn=None, **kwargs: fn if fn is not None else (lambda f: f)):
        yield


class _Eager(torch.optim.Optimizer):
    """Wraps torchao's optimizer, whose ``step`` calls ``torch.compile``, so that it runs eagerly;
    a number set as a group's ``lr`` (by the schedule) becomes the tensor torchao expects."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:  # noqa: D107 (the class says it)
        self.inner = inner
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        for group in self.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]))
        with _eager_compile(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.inner.step(closure)


def _torchao(groups: Groups, lr: float, wd: float, seed: int) -> torch.optim.Optimizer:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.optim import AdamW8bit
    except ImportError as e:
        raise Unavailable(f"torchao is not importable ({e}); pip install torchao adds this row") from e
    return _Eager(AdamW8bit(groups, lr=lr, betas=BETAS, weight_decay=wd))


def _lowp_setup(name: str, note: str, **options: Any) -> Setup:
    return Setup(name, torch.bfloat16, functools.partial(_lowp, **options), note=note, releasable=True)


MAIN = (
    Setup(REFERENCE, torch.float32, _torch, note="torch.optim.AdamW, fp32 weights and moments (the reference)"),
    *(Setup(f"{REFERENCE}, seed {k}", torch.float32, _torch, seed_offset=k,
            note="the reference from another seed: run-to-run noise") for k in (1, 2)),
    _lowp_setup("bf16 kahan", "lowp's default: bf16 weights, bf16 Kahan compensation, bf16 moments",
                mode="kahan"),
    _lowp_setup("recommended", "bf16 weights + int8 remainder (exact8), m int8, v uint8 (sqrt), blocks of 64, "
                "bf16 scales", mode="exact8", state_dtype=EIGHT_BIT),
    _lowp_setup("aggressive", "bf16 weights, stochastic rounding, m int8, v uint4 (sqrt), blocks of 64",
                mode="stochastic", state_dtype={"exp_avg": torch.int8, "exp_avg_sq": torch.uint4}),
    _lowp_setup("4-bit moments", "aggressive with m as int4 too: both moments in 4 bits, blocks of 64",
                mode="stochastic", state_dtype={"exp_avg": torch.int4, "exp_avg_sq": torch.uint4}),
    Setup("torchao AdamW8bit", torch.float32, _torchao,
          note="torchao.optim.AdamW8bit on fp32 weights: 8-bit moments, blocks of 256, fp32 scales"),
)

ABLATION = (
    _lowp_setup("m float8_e4m3fn", "recommended, m as float8_e4m3fn", mode="exact8",
                state_dtype={**EIGHT_BIT, "exp_avg": torch.float8_e4m3fn}),
    _lowp_setup("v float8_e4m3fn", "recommended, v as float8_e4m3fn (linear)", mode="exact8",
                state_dtype={**EIGHT_BIT, "exp_avg_sq": torch.float8_e4m3fn}),
    _lowp_setup("v float8_e5m2", "recommended, v as float8_e5m2 (linear)", mode="exact8",
                state_dtype={**EIGHT_BIT, "exp_avg_sq": torch.float8_e5m2}),
    _lowp_setup("nearest states", "recommended, states rounded to nearest", mode="exact8", state_dtype=EIGHT_BIT,
                state_rounding="nearest"),
    *(_lowp_setup(f"block {b}", f"recommended, blocks of {b}", mode="exact8", state_dtype=EIGHT_BIT,
                  state_block=b) for b in (32, 128, 256)),
    _lowp_setup("fp16 scales", "recommended, block scales in fp16", mode="exact8", state_dtype=EIGHT_BIT,
                state_scale_dtype=torch.float16),
    _lowp_setup("kahan, 8-bit states", "recommended with mode kahan (bf16 compensation)", mode="kahan",
                state_dtype=EIGHT_BIT),
    _lowp_setup("exact, 8-bit states", "recommended with mode exact (int16 remainder)", mode="exact",
                state_dtype=EIGHT_BIT),
    _lowp_setup("stochastic, 8-bit states", "aggressive with v as uint8 (4.06 B/param)", mode="stochastic",
                state_dtype=EIGHT_BIT),
    _lowp_setup("stochastic, bf16 states", "aggressive's mode with lowp's default bf16 moments", mode="stochastic"),
    _lowp_setup("exact, bf16 states", "mode exact with lowp's default bf16 moments", mode="exact"),
)

ALL = {s.name: s for s in MAIN + ABLATION}


# ----------------------------------------------------------------------------------------------- models


def _markov_data(vocab: int, train_tokens: int, val_tokens: int, seed: int) -> tuple[TextData, float]:
    """Text from a random order-3 source over ``vocab`` tokens, and the source's own mean
    cross-entropy on the validation text (nats/token, over every token after the first three of
    each sequence: the lowest loss a model can expect).

    The logits of token ``t`` are ``2 (A[x_{t-1}] + B[x_{t-2}] + C[x_{t-3}]) / sqrt(3) + 2 D[x_{t-2}, x_{t-1}]``
    with ``A, B, C, D`` standard normal tables fixed by ``seed``: an additive part any attention
    layer can learn and a pairwise table to be learnt entry by entry. Sequences of 256 tokens
    start from uniform tokens and are concatenated.
    """
    gen = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(vocab, vocab, generator=gen, dtype=torch.float64) for _ in range(3))
    d = torch.randn(vocab, vocab, vocab, generator=gen, dtype=torch.float64)

    def logits(x: torch.Tensor, t: int) -> torch.Tensor:
        return 2 * (a[x[:, t - 1]] + b[x[:, t - 2]] + c[x[:, t - 3]]) / math.sqrt(3) + 2 * d[x[:, t - 2], x[:, t - 1]]

    def sample(tokens: int, stream: int) -> tuple[torch.Tensor, float]:
        g = torch.Generator().manual_seed(seed * 1000 + stream)
        length = 256
        x = torch.randint(0, vocab, (tokens // length, length), generator=g)
        nll, count = 0.0, 0
        for t in range(3, length):
            logp = torch.log_softmax(logits(x, t), dim=-1)
            x[:, t] = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
            nll -= float(logp.gather(1, x[:, t:t + 1]).sum())
            count += x.shape[0]
        return x.flatten(), nll / count

    train, _ = sample(train_tokens, 1)
    val, floor = sample(val_tokens, 2)
    return TextData(train, val, []), floor


@dataclass
class Task:
    """A model to train for accuracy: its configuration, data and validation batches.

    Args:
        name: the model's name in the tables.
        cfg: the demo configuration (model shape, batches, steps, schedule) of its runs.
        data: training and validation tokens.
        val_batches: number of validation batches (64 sequences each) the final loss averages.
        floor: the lowest expected validation loss (the source's entropy), when known.
    """

    name: str
    cfg: DemoConfig
    data: TextData
    val_batches: int
    floor: float | None = None


def tasks(names: list[str], quick: bool) -> list[Task]:
    """The accuracy models named in ``names`` (``demo``, ``markov``), tiny ones with ``quick``."""
    out = []
    for name in names:
        if name == "demo":
            cfg = DemoConfig(steps=1000, warmup=100)
            if quick:
                cfg = replace(cfg, steps=3, warmup=1, dim=32, layers=1)
            out.append(Task("demo", cfg, load_data(50_000 if quick else 600_000), 1 if quick else 8))
        else:
            cfg = DemoConfig(vocab=32, dim=64, layers=3, heads=4, seq_len=32, batch_size=32, steps=2000, warmup=100)
            tokens = (200_000, 32 * 256)
            if quick:
                cfg, tokens = replace(cfg, steps=3, warmup=1, dim=32, layers=1), (4096, 2048)
            data, floor = _markov_data(cfg.vocab, *tokens, seed=0)
            out.append(Task("markov", cfg, data, 1 if quick else 4, floor))
    return out


@dataclass
class AccuracyRun:
    """One training run: final validation loss, bytes per parameter and seconds."""

    loss: float
    bytes_per_param: float
    seconds: float


def train_once(task: Task, setup: Setup, regime: str) -> AccuracyRun:
    """Train ``task``'s model with ``setup`` in ``regime`` and evaluate it."""
    lr, wd = REGIMES[regime]
    cfg = replace(task.cfg, lr=lr, weight_decay=wd, seed=task.cfg.seed + setup.seed_offset,
                  eval_every=task.cfg.steps)
    model = build_model(cfg, setup.weights)
    opt = setup.make(param_groups(model), lr, wd, cfg.seed)
    _, seconds = train_loop(model, opt, task.data, cfg)
    loss = evaluate(model, task.data.val_batches(64, cfg.seq_len)[: task.val_batches])
    return AccuracyRun(loss, measure(model.parameters(), opt).total(with_grads=False), seconds)


# ----------------------------------------------------------------------------------------------- memory


@dataclass
class MemoryRun:
    """Peak training memory of one configuration on the memory model, in bytes.

    Args:
        bytes_per_param: weights + states + extra precision per parameter (no gradients).
        grad_bytes_per_param: the gradients' bytes per parameter.
        resident: weights + states + extra, the memory held between steps.
        peak: the peak of training, without gradient release.
        peak_release: the same with gradient release (``None``: not applicable).
    """

    bytes_per_param: float
    grad_bytes_per_param: float
    resident: int
    peak: int
    peak_release: int | None = None


def _memory_model(weights: torch.dtype, quick: bool) -> CharLM:
    torch.manual_seed(0)
    dim, layers = (256, 1) if quick else (768, 4)
    return CharLM(dim=dim, layers=layers, heads=4, seq_len=32, compute_dtype=weights).to(weights)


def memory_once(setup: Setup, release: bool, quick: bool) -> tuple[Footprint, int, int]:
    """(bytes per parameter, parameters, peak bytes) of training the memory model
    for two steps from nothing: the peak of torch.profiler's CPU memory events over building the
    model and the optimizer and two training steps (the first creates the states), so that every
    allocation counts, the optimizer's scratch buffers included."""
    measured: dict[str, Any] = {}
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))

    def train() -> None:
        model = _memory_model(setup.weights, quick)
        opt = setup.make(param_groups(model), 1e-4, 0.01, 0)
        if release:
            lo.release_gradients(opt)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
            opt.step()
        measured["footprint"] = measure(model.parameters(), opt)
        measured["count"] = sum(p.numel() for p in model.parameters())

    peak = profiled_peak_bytes(train)
    return measured["footprint"], measured["count"], peak


# ----------------------------------------------------------------------------------------------- report


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.2f}%" if math.isfinite(x) else "diverged"


def _loss(x: float, ref: float | None) -> str:
    """A loss, and its difference to ``ref`` when given; ``diverged`` when it is not finite."""
    if not math.isfinite(x):
        return "diverged"
    return f"{x:.4f}" if ref is None else f"{x:.4f} ({_pct(x, ref)})"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark described in the module docstring and print its tables."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few steps on tiny models (a smoke run)")
    ap.add_argument("--models", nargs="+", choices=("demo", "markov"), default=["demo", "markov"])
    ap.add_argument("--configs", nargs="+", choices=sorted(ALL), default=None,
                    help="only these configurations (default: all; the reference always runs)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--no-ablation", action="store_true", help="skip the encoding ablation")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (as in docs/memory.md)")
    ap.add_argument("--json", default=None, help="also write every number to this JSON file")
    ap.add_argument("--cache", default=None,
                    help="JSON file of finished training runs: runs found there are not repeated, new ones are "
                         "added as they finish (delete it after changing the code)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    wanted = set(args.configs or ALL) | {REFERENCE}
    main_setups = [s for s in MAIN if s.name in wanted]
    ablation = [] if args.no_ablation else [s for s in ABLATION if s.name in wanted]
    skipped: dict[str, str] = {}
    results: dict[str, Any] = {"accuracy": {}, "ablation": {}, "memory": {}, "floors": {}, "skipped": skipped}
    started = time.perf_counter()
    cache_path = Path(args.cache) if args.cache else None
    cache = json.loads(cache_path.read_text()) if cache_path and cache_path.exists() else {}

    def run(task: Task, setup: Setup, regime: str) -> AccuracyRun | None:
        if setup.name in skipped:
            return None
        key = f"{'quick|' if args.quick else ''}{task.name}|{regime}|{setup.name}"
        if key in cache:
            return AccuracyRun(**cache[key])
        try:
            r = train_once(task, setup, regime)
        except Unavailable as e:
            skipped[setup.name] = str(e)
            return None
        if cache_path is not None:
            cache[key] = r.__dict__
            cache_path.write_text(json.dumps(cache, indent=1))
        print(f"  {task.name:7s} {regime:14s} {setup.name:24s} loss {r.loss:.4f}  {r.seconds:5.1f} s",
              file=sys.stderr, flush=True)
        return r

    all_tasks = tasks(args.models, args.quick)
    for task in all_tasks:
        results["floors"][task.name] = task.floor
        for regime in REGIMES:
            for setup in main_setups:
                r = run(task, setup, regime)
                if r is not None:
                    results["accuracy"][f"{task.name}|{regime}|{setup.name}"] = r.__dict__
    ablation_task = all_tasks[0]
    regime0 = next(iter(REGIMES))
    for setup in ablation:
        r = run(ablation_task, setup, regime0)
        if r is not None:
            results["ablation"][setup.name] = r.__dict__
    if not args.no_memory:
        for setup in main_setups:
            if setup.seed_offset or setup.name in skipped:
                continue
            footprint, count, peak = memory_once(setup, False, args.quick)
            per_param = footprint.total(with_grads=False)
            peak_release = memory_once(setup, True, args.quick)[2] if setup.releasable else None
            results["memory"][setup.name] = MemoryRun(per_param, footprint.grads, round(per_param * count), peak,
                                                      peak_release).__dict__
            results["memory_params"] = count
            print(f"  memory {setup.name:24s} peak {_mib(peak)} MiB, with release {_mib(peak_release)} MiB",
                  file=sys.stderr, flush=True)
    print(report(results, all_tasks, main_setups, ablation, ablation_task.name, regime0,
                 markdown_table if args.markdown else text_table))
    print(f"\n{time.perf_counter() - started:.0f} s in all, torch {torch.__version__}, 1 thread")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def report(results: dict[str, Any], all_tasks: list[Task], main_setups: list[Setup], ablation: list[Setup],
           ablation_model: str, ablation_regime: str, table: Callable[..., str] = text_table) -> str:
    """The accuracy, ablation and memory tables of ``results`` as text, each made by ``table``."""
    acc, memory, skipped = results["accuracy"], results["memory"], results["skipped"]
    columns = [(t.name, regime) for t in all_tasks for regime in REGIMES]
    headers = ["configuration", "B/param", "+ grads"] + [f"{m} {r}" for m, r in columns]
    rows = []
    for setup in main_setups:
        if setup.name in skipped:
            continue
        m = memory.get(setup.name)
        row = [setup.name, "-" if m is None else f"{m['bytes_per_param']:.2f}",
               "-" if m is None else f"{m['bytes_per_param'] + m['grad_bytes_per_param']:.2f}"]
        for m, r in columns:
            ref, this = acc[f"{m}|{r}|{REFERENCE}"]["loss"], acc[f"{m}|{r}|{setup.name}"]["loss"]
            row.append(_loss(this, None if setup.name == REFERENCE else ref))
        rows.append(row)
    lines = ["validation loss after training (nats/token) and difference to fp32 AdamW; B/param: weights + "
             "optimizer states, measured on the memory model; + grads: with the gradients",
             table(headers, rows)]
    for t in all_tasks:
        if t.floor is not None:
            lines.append(f"{t.name}: the source's own cross-entropy on the validation text is {t.floor:.4f}")
    if ablation:
        ref = acc[f"{ablation_model}|{ablation_regime}|{REFERENCE}"]["loss"]
        base = acc.get(f"{ablation_model}|{ablation_regime}|recommended")
        rows = []
        for setup in ablation:
            if setup.name in skipped:
                continue
            r = results["ablation"][setup.name]
            rows.append([setup.name, f"{r['bytes_per_param']:.3f}", _loss(r["loss"], None), _pct(r["loss"], ref),
                         "-" if base is None else _pct(r["loss"], base["loss"]), setup.note])
        lines += ["", f"encoding ablation: {ablation_model} model, {ablation_regime} (B/param measured on this model)",
                  table(["configuration", "B/param", "val loss", "vs fp32", "vs recommended", "what"], rows)]
    if memory:
        rows = [[name, f"{m['bytes_per_param']:.2f}", _mib(m["resident"]), _mib(m["peak"]),
                 _mib(m["peak_release"]),
                 "-" if m["peak_release"] is None else f"{m['peak_release'] / m['peak']:.2f}"]
                for name, m in memory.items()]
        lines += ["", f"peak training memory, memory model ({results['memory_params']:,} parameters, batch 2 x 32 "
                      "tokens): weights + states held between steps, and the peak of torch.profiler's memory events "
                      "over building the model and optimizer and two training steps",
                  table(["configuration", "B/param", "resident MiB", "peak MiB", "peak MiB, release",
                              "release / without"], rows)]
    lines.append("")
    lines += [f"{s.name}: {s.note}" for s in main_setups + ablation if s.name not in skipped]
    lines += [f"{name}: skipped, {why}" for name, why in skipped.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
