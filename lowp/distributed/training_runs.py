"""Train a model with DDP on a local gloo group under one gradient reduction; measure loss and bytes.

The pieces of ``benchmarks/compressed_training.py`` (issue 29's training measurement), kept here
so a test can run them for a few steps. One *run* is a model, a world size ``R`` and a reduction:

``fp32``
    :func:`~lowp.distributed.hooks.fp32_reduce_hook` (fp32 all-reduce, fp32 divide): the reference.
``bf16-ring``
    :func:`~lowp.distributed.hooks.sum_then_divide_hook` with ``wire_dtype=torch.bfloat16``: an
    all-reduce *sum* of bf16 tensors by the backend (gloo's, with its per-step bf16 rounding),
    then the division by R in fp32.
``fp8-ef`` / ``fp8``
    :func:`~lowp.distributed.compressed.compressed_hook` with the default wire (fp8 e4m3, one
    e8m0 scale per 32 elements, round to nearest, both halves), with / without error feedback.
``int8-ef``
    the same hook with int8 elements (32 x e8m0 scales, nearest) and error feedback.

Every run of one model starts from the same fp32 initialisation, every rank draws its batches from
its own contiguous shard of the training data with its own generator (``seed + 1 + rank``), so
the runs of one world size see the same data in the same order, and the optimizer is
``torch.optim.AdamW`` on fp32 weights: the reduction is the only difference between them.

Bytes per step and rank: the compressed hook counts what it hands to its collectives
(``state.wire_bytes`` + ``state.control_bytes``, scales included, plus ``state.move_bytes``, the
one-time move of gather residuals after DDP's bucket rebuild); for ``fp32`` and ``bf16-ring`` the
bytes are *computed* as a ring all-reduce's ``2 (R - 1) / R * n * itemsize`` from the bucket sizes
the hook was called with (the hooks do not count; their small agreement all-gather is left out,
which favours the baselines).

(No ``from __future__ import annotations``: DDP compares a hook's annotations with
``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.)
"""
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from lowp.distributed.compressed import CompressedState, compressed_hook
from lowp.distributed.hooks import ReduceState, fp32_reduce_hook, sum_then_divide_hook
from lowp.distributed.launch import run_local_group
from lowp.distributed.wire import WireFormat

__all__ = ["REDUCTIONS", "MODELS", "RunSpec", "RunResult", "RecallTask", "RecallNet", "run", "train_rank",
           "summarize", "table", "COLUMNS", "plot", "summarize_seeds", "seed_table", "SEED_COLUMNS", "plot_seeds"]

#: reduction name -> what it is (for the table's legend)
REDUCTIONS: dict[str, str] = {
    "fp32": "fp32_reduce_hook: fp32 all-reduce, fp32 divide",
    "bf16-ring": "sum_then_divide_hook(wire_dtype=bf16): bf16 all-reduce sum (gloo), fp32 divide",
    "fp8-ef": "compressed_hook: fp8 e4m3 / 32 x e8m0, nearest, error feedback",
    "fp8": "compressed_hook: fp8 e4m3 / 32 x e8m0, nearest, no error feedback",
    "int8-ef": "compressed_hook: int8 / 32 x e8m0, nearest, error feedback",
}
#: model name -> what it is
MODELS: dict[str, str] = {
    "demo": "lowp demo's CharLM (byte-level transformer) on Python's stdlib sources",
    "recall": "RecallNet (nn.TransformerEncoder, causal) on multi-query associative recall",
}
COLUMNS = ("model", "R", "reduction", "final val loss", "gap vs fp32 %", "bytes/step/rank", "vs bf16 ring",
           "once (move) bytes")


@dataclass
class RunSpec:
    """One training run (the defaults: the demo model's settings of the benchmark).

    Args:
        model: ``"demo"`` or ``"recall"`` (:data:`MODELS`).
        reduction: a key of :data:`REDUCTIONS`.
        world_size: gloo ranks.
        steps: optimizer steps.
        batch: sequences per step over all ranks (each rank gets ``batch // world_size``).
        lr: peak AdamW learning rate (linear warm-up over ``warmup`` steps, cosine to ``lr / 10``).
        warmup: warm-up steps.
        weight_decay: AdamW's decoupled weight decay (matrices only).
        eval_every: steps between validation evaluations (and at the last step).
        eval_sequences: validation sequences per evaluation (a fixed set, split over the ranks).
        seed: initialisation, data and sampling seed.
        dim: the model's width.
        layers: transformer blocks.
        heads: attention heads.
        seq_len: tokens per training sequence (the demo model).
        bucket_cap_mb: DDP's bucket size (MB).
        check_drift: also all-reduce every bucket exactly in fp32 (an extra collective) and record
            how far the hook's mean is from it, per step and summed over the steps
            (:attr:`RunResult.drift`); a diagnostic of the hook inside training.
    """

    model: str = "demo"
    reduction: str = "fp32"
    world_size: int = 2
    steps: int = 2000
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_sequences: int = 256
    seed: int = 0
    dim: int = 64
    layers: int = 2
    heads: int = 4
    seq_len: int = 64
    bucket_cap_mb: float = 25.0
    check_drift: bool = False

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {self.model!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {', '.join(REDUCTIONS)}, got {self.reduction!r}")
        if self.world_size < 1 or self.batch % self.world_size:
            raise ValueError(f"batch: {self.batch} sequences must split evenly over world_size={self.world_size}")
        if self.steps < 1 or self.eval_every < 1:
            raise ValueError(f"steps, eval_every: expected >= 1, got {self.steps}, {self.eval_every}")


@dataclass
class RunResult:
    """What one run measured (rank 0's view; every rank holds the same weights).

    Args:
        spec: the run's :class:`RunSpec` as a dict.
        curve: ``(step, validation loss)`` points.
        params: parameters of the model.
        hook_calls: hook calls (buckets x steps) on rank 0.
        elements: gradient elements reduced over all hook calls on rank 0.
        wire_bytes: the compressed hook's data bytes sent on rank 0 (0 for the other hooks).
        control_bytes: its ranks' agreement bytes on rank 0 (0 for the other hooks).
        move_bytes: its one-time moves of gather residuals on rank 0 (0 for the other hooks).
        ring_bytes: computed ring all-reduce bytes of the same buckets in the hook's dtype
            (``2 (R-1)/R * n * itemsize`` per bucket; for the compressed hook: in bf16, for reference).
        bf16_ring_bytes: the same in bf16 (the denominator of the ratio).
        seconds: wall time of the training loop (evaluations included).
        final_evals: evaluations averaged into :attr:`final_loss` (default 3).
        drift: with ``spec.check_drift``: ``step_rel_err`` (rms over steps of
            ``||hook mean - exact mean|| / ||exact mean||``) and ``sum_rel_drift``
            (``||sum_t (hook - exact)|| / ||sum_t exact||`` over the whole run: error feedback keeps
            it at one step's error or below, without feedback it accumulates).
    """

    spec: dict[str, Any]
    curve: list[tuple[int, float]]
    params: int
    hook_calls: int
    elements: int
    wire_bytes: int
    control_bytes: int
    move_bytes: int
    ring_bytes: float
    bf16_ring_bytes: float
    seconds: float
    final_evals: int = 3
    drift: dict[str, float] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        """Mean of the last ``final_evals`` validation losses."""
        tail = [loss for _, loss in self.curve[-self.final_evals:]]
        return sum(tail) / len(tail)

    @property
    def bytes_per_step(self) -> float:
        """Bytes one rank sends per step: counted by the compressed hook (``wire_bytes`` +
        ``control_bytes``: codes, scales and the ranks' agreement), or the computed ring bytes of
        ``fp32`` / ``bf16-ring``. The compressed hook's one-time move of gather residuals after
        DDP's bucket rebuild is :attr:`once_bytes`, not in this."""
        steps = self.spec["steps"]
        if self.spec["reduction"] in ("fp32", "bf16-ring"):
            return self.ring_bytes / steps
        return (self.wire_bytes + self.control_bytes) / steps

    @property
    def once_bytes(self) -> int:
        """Bytes sent once per run, not per step: the compressed hook's ``move_bytes`` (an fp32
        all-reduce of the gather residuals when DDP rebuilds its buckets after the first step)."""
        return self.move_bytes

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunResult":
        """The inverse of ``dataclasses.asdict`` (e.g. after a JSON round trip)."""
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["curve"] = [(int(s), float(v)) for s, v in data["curve"]]
        return cls(**data)


# -- the second model: causal attention on multi-query associative recall --------------------

@dataclass
class RecallTask:
    """Multi-query associative recall (as in Arora et al. 2023, "Zoology"): ``pairs`` key-value
    pairs ``k1 v1 ... kn vn`` (distinct keys of ``keys``, values drawn from ``values``), then
    ``queries`` keys drawn from the pairs, each followed by its value. The loss is the
    cross-entropy of each answer given the sequence up to its query (chance: ``ln(values)``);
    ``noise`` of the answers are replaced by a random value (an irreducible floor, so the loss
    does not fall to 0 and a relative gap stays meaningful).

    Args:
        keys: distinct key tokens.
        values: distinct value tokens.
        pairs: key-value pairs per sequence.
        queries: queries per sequence.
        noise: fraction of the answers replaced by a random value.
    """

    keys: int = 32
    values: int = 32
    pairs: int = 8
    queries: int = 8
    noise: float = 0.1

    @property
    def vocab(self) -> int:
        """Tokens: the keys, then the values."""
        return self.keys + self.values

    @property
    def length(self) -> int:
        """Tokens of one sequence (pairs, then queries with their answers)."""
        return 2 * (self.pairs + self.queries)

    def sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``(n, length - 1)`` and targets of the same shape (-100 where not an answer)."""
        keys = torch.argsort(torch.rand(n, self.keys, generator=gen), dim=1)[:, :self.pairs]
        vals = torch.randint(0, self.values, (n, self.pairs), generator=gen)
        pick = torch.randint(0, self.pairs, (n, self.queries), generator=gen)
        qk, qv = keys.gather(1, pick), vals.gather(1, pick)
        flip = torch.rand(n, self.queries, generator=gen) < self.noise
        qv = torch.where(flip, torch.randint(0, self.values, (n, self.queries), generator=gen), qv)
        seq = torch.stack([torch.cat([keys, qk], 1), self.keys + torch.cat([vals, qv], 1)], 2).reshape(n, -1)
        target = seq[:, 1:].clone()
        answer = torch.zeros_like(target, dtype=torch.bool)
        answer[:, 2 * self.pairs::2] = True            # target position 2p + 2j predicts the answer of query j
        return seq[:, :-1], torch.where(answer, target, -100)


class RecallNet(nn.Module):
    """Token + learned position embeddings, ``layers`` causal pre-norm ``nn.TransformerEncoderLayer``
    (``heads`` heads, feed-forward ``2 * dim``, no dropout), a final LayerNorm and an untied output.

    Args:
        vocab: tokens.
        dim: width.
        layers: transformer blocks.
        heads: attention heads.
        length: the longest sequence (learned positions).
    """

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``(batch, t, vocab)`` for tokens ``idx`` of shape ``(batch, t)``."""
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        x = self.encoder(self.embed(idx) + self.pos[:t], mask=mask, is_causal=True)
        return self.head(self.norm(x))


# -- one rank's training loop ---------------------------------------------------------------

class _Counting:
    """State of :func:`_counting_hook`: the wrapped hook and its state, and what it was called with."""

    def __init__(self, hook: Callable[..., Any], inner: Any) -> None:
        self.hook, self.inner = hook, inner
        self.calls = self.elements = 0
        self.ring = self.bf16_ring = 0.0
        self.check = False
        self.sq_err: list[float] = []
        self.sum_diff: dict[int, torch.Tensor] = {}
        self.sum_exact: dict[int, torch.Tensor] = {}
        self.index: dict[int, int] = {}

    def drift(self) -> dict[str, float]:
        """The drift statistics of :attr:`RunResult.drift` (empty unless ``check``)."""
        if not self.sq_err:
            return {}
        diff = sum(float((d ** 2).sum()) for d in self.sum_diff.values())
        exact = sum(float((e ** 2).sum()) for e in self.sum_exact.values())
        return {"step_rel_err": math.sqrt(sum(self.sq_err) / len(self.sq_err)),
                "sum_rel_drift": math.sqrt(diff / max(exact, 1e-300))}


def _counting_hook(state: _Counting, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Count the bucket (elements, computed ring bytes), then run the wrapped hook."""
    buffer = bucket.buffer()
    R, n = dist.get_world_size(), buffer.numel()
    state.calls += 1
    state.elements += n
    size = 4 if state.hook is fp32_reduce_hook else 2     # the compressed hook's: a bf16 ring, for reference
    state.ring += 2 * (R - 1) / R * n * size
    state.bf16_ring += 2 * (R - 1) / R * n * 2
    if not state.check:
        return state.hook(state.inner, bucket)
    exact = buffer.reshape(-1).to(torch.float32, copy=True)
    dist.all_reduce(exact)
    exact /= R
    fut = state.hook(state.inner, bucket)
    got = fut.wait().reshape(-1).to(torch.float32)        # the hooks here run synchronously
    diff = got - exact
    state.sq_err.append(float((diff ** 2).sum() / (exact ** 2).sum().clamp_min(1e-300)))
    offset = 0
    for p in bucket.parameters():
        pid = state.index.setdefault(id(p), len(state.index))
        k = p.numel()
        state.sum_diff[pid] = state.sum_diff.get(pid, torch.zeros(k)) + diff[offset:offset + k]
        state.sum_exact[pid] = state.sum_exact.get(pid, torch.zeros(k)) + exact[offset:offset + k]
        offset += k
    return fut


def _lr(step: int, spec: RunSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _build(spec: RunSpec, rank: int, world_size: int) -> tuple[
        nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]],
        list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (fp32, seeded), this rank's batch sampler and its part of the validation set."""
    per_rank = spec.batch // world_size
    torch.manual_seed(spec.seed)
    if spec.model == "demo":
        from lowp.demo.data import load_data
        from lowp.demo.model import CharLM

        model: nn.Module = CharLM(dim=spec.dim, layers=spec.layers, heads=spec.heads, seq_len=spec.seq_len)
        data = load_data()
        shard = data.train.numel() // world_size
        train = data.train[rank * shard:(rank + 1) * shard]
        L = spec.seq_len

        def sample(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            starts = torch.randint(0, train.numel() - L - 1, (per_rank,), generator=gen)
            windows = train[starts[:, None] + torch.arange(L + 1)]
            return windows[:, :-1], windows[:, 1:]

        n = min(spec.eval_sequences, (data.val.numel() - 1) // L)
        x = data.val[:n * L].view(n, L)
        y = data.val[1:n * L + 1].view(n, L)
    else:
        task = RecallTask()
        model = RecallNet(task.vocab, spec.dim, spec.layers, spec.heads, task.length - 1)

        def sample(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            return task.sample(per_rank, gen)

        x, y = task.sample(spec.eval_sequences, torch.Generator().manual_seed(10_000 + spec.seed))
    part = -(-x.shape[0] // world_size)
    val = [(x[rank * part:(rank + 1) * part], y[rank * part:(rank + 1) * part])]
    return model, sample, val


@torch.no_grad()
def _evaluate(model: nn.Module, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy over every rank's part of the validation set (one fp64 all-reduce)."""
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in val:
        if x.numel():
            logits = model(x).flatten(0, 1).float()
            total[0] += float(F.cross_entropy(logits, y.flatten(), reduction="sum", ignore_index=-100))
            total[1] += float((y != -100).sum())
    dist.all_reduce(total)
    return float(total[0] / total[1])


def train_rank(rank: int, world_size: int, spec_dict: dict[str, Any]) -> Optional[dict[str, Any]]:
    """One rank of one run (the function :func:`run_local_group` calls); rank 0 returns the
    :class:`RunResult` fields as a dict, the others ``None``."""
    spec = RunSpec(**spec_dict)
    model, sample, val = _build(spec, rank, world_size)
    params = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=spec.bucket_cap_mb)
    compressed: Optional[CompressedState] = None
    if spec.reduction in ("fp32", "bf16-ring"):
        hook: Callable[..., Any] = fp32_reduce_hook if spec.reduction == "fp32" else sum_then_divide_hook
        counting = _Counting(hook, ReduceState(wire_dtype=torch.bfloat16))
    else:
        element = "int8" if spec.reduction == "int8-ef" else "fp8_e4m3"
        compressed = CompressedState(scatter=WireFormat(element, 32, "e8m0"),
                                     error_feedback=spec.reduction.endswith("-ef"), seed=spec.seed)
        compressed.module = ddp.module
        counting = _Counting(compressed_hook, compressed)
    counting.check = spec.check_drift
    ddp.register_comm_hook(counting, _counting_hook)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n not in ("pos",)]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n not in ("pos",))]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": other, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=spec.lr,
                            betas=(0.9, 0.99), weight_decay=spec.weight_decay)
    gen = torch.Generator().manual_seed(spec.seed + 1 + rank)
    curve: list[tuple[int, float]] = []
    start = time.perf_counter()
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, spec)
        x, y = sample(gen)
        logits = ddp(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
            model.eval()
            curve.append((step + 1, _evaluate(model, val)))
            model.train()
    seconds = time.perf_counter() - start
    if rank:
        return None
    c = compressed
    return {"spec": asdict(spec), "curve": curve, "params": params, "hook_calls": counting.calls,
            "elements": counting.elements, "wire_bytes": c.wire_bytes if c else 0,
            "control_bytes": c.control_bytes if c else 0, "move_bytes": c.move_bytes if c else 0,
            "ring_bytes": counting.ring, "bf16_ring_bytes": counting.bf16_ring, "seconds": seconds,
            "drift": counting.drift()}


def run(spec: RunSpec, timeout_s: float = 120.0) -> RunResult:
    """Train ``spec`` on a local gloo group of ``spec.world_size`` processes; rank 0's result."""
    out = run_local_group(train_rank, spec.world_size, asdict(spec), timeout_s=timeout_s,
                          join_timeout_s=timeout_s + 3600)
    return RunResult(**out[0])


# -- results --------------------------------------------------------------------------------

def summarize(results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per run (:data:`COLUMNS`): the gap is against the ``fp32`` run of the same model
    and world size (None without one), the byte ratio against a bf16 ring all-reduce of the same
    buckets (computed); the compressed hook's one-time bytes in their own column."""
    ref = {(r.spec["model"], r.spec["world_size"]): r.final_loss for r in results if r.spec["reduction"] == "fp32"}
    rows = []
    for r in results:
        key = (r.spec["model"], r.spec["world_size"])
        base = ref.get(key)
        bf16 = r.bf16_ring_bytes / r.spec["steps"]
        rows.append({"model": r.spec["model"], "R": r.spec["world_size"], "reduction": r.spec["reduction"],
                     "final val loss": r.final_loss,
                     "gap vs fp32 %": None if base is None else 100 * (r.final_loss - base) / base,
                     "bytes/step/rank": r.bytes_per_step, "vs bf16 ring": r.bytes_per_step / bf16,
                     "once (move) bytes": r.once_bytes})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`summarize`'s rows."""
    def cell(column: str, value: Any) -> str:
        if value is None:
            return "-"
        if column == "final val loss":
            return f"{value:.4f}"
        if column == "gap vs fp32 %":
            return f"{value:+.2f}"
        if column in ("bytes/step/rank", "once (move) bytes"):
            return f"{value:,.0f}"
        if column == "vs bf16 ring":
            return f"{value:.3f}"
        return str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell(c, row[c]) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


#: columns of :func:`summarize_seeds`' rows
SEED_COLUMNS = ("model", "R", "reduction", "seeds", "mean final val loss", "mean gap vs fp32 %", "s.e. %",
                "gaps per seed %")


def summarize_seeds(results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per (model, world size, reduction) over the seeds that have an fp32 run: the mean
    final loss, and the gap against fp32 *paired by seed* (the same initialisation and data), its
    mean and standard error ``sd / sqrt(n)`` (sample standard deviation; 0 for one seed) and the
    per-seed values (:data:`SEED_COLUMNS`)."""
    ref = {(r.spec["model"], r.spec["world_size"], r.spec["seed"]): r.final_loss
           for r in results if r.spec["reduction"] == "fp32"}
    groups: dict[tuple[str, int, str], list[RunResult]] = {}
    for r in results:
        if (r.spec["model"], r.spec["world_size"], r.spec["seed"]) in ref:
            groups.setdefault((r.spec["model"], r.spec["world_size"], r.spec["reduction"]), []).append(r)
    rows = []
    for (model, R, reduction), runs in groups.items():
        runs.sort(key=lambda r: r.spec["seed"])
        gaps = [100 * (r.final_loss - ref[(model, R, r.spec["seed"])]) / ref[(model, R, r.spec["seed"])]
                for r in runs]
        n = len(gaps)
        mean = sum(gaps) / n
        se = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1) / n) if n > 1 else 0.0
        rows.append({"model": model, "R": R, "reduction": reduction, "seeds": n,
                     "mean final val loss": sum(r.final_loss for r in runs) / n, "mean gap vs fp32 %": mean,
                     "s.e. %": se, "gaps per seed %": gaps})
    return rows


def seed_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`summarize_seeds`' rows."""
    def cell(column: str, value: Any) -> str:
        if column == "mean final val loss":
            return f"{value:.4f}"
        if column == "mean gap vs fp32 %":
            return f"{value:+.2f}"
        if column == "s.e. %":
            return f"{value:.2f}"
        if column == "gaps per seed %":
            return ", ".join(f"{g:+.2f}" for g in value)
        return str(value)

    lines = ["| " + " | ".join(SEED_COLUMNS) + " |", "|" + "|".join("---" for _ in SEED_COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell(c, row[c]) for c in SEED_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def plot_seeds(rows: list[dict[str, Any]], path: str) -> None:
    """A PNG of :func:`summarize_seeds`' rows: per (model, world size) and reduction the gap of each
    seed against fp32 (dots) and their mean with +-2 standard errors (bar), the +-0.5 % band shaded."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    cases = sorted({(r["model"], r["R"]) for r in rows})
    reductions = [name for name in REDUCTIONS if any(r["reduction"] == name for r in rows) and name != "fp32"]
    fig, ax = plt.subplots(figsize=(1.2 + 1.6 * len(cases), 3.6))
    colors = {"bf16-ring": "tab:blue", "fp8-ef": "tab:green", "fp8": "tab:red", "int8-ef": "tab:purple"}
    width = 0.8 / max(len(reductions), 1)
    for i, case in enumerate(cases):
        for j, name in enumerate(reductions):
            row = next((r for r in rows if (r["model"], r["R"]) == case and r["reduction"] == name), None)
            if row is None:
                continue
            x = i + (j - (len(reductions) - 1) / 2) * width
            ax.plot([x] * row["seeds"], row["gaps per seed %"], "o", color=colors.get(name, "gray"), markersize=3,
                    alpha=0.6, label=name if i == 0 else None)
            ax.errorbar([x], [row["mean gap vs fp32 %"]], yerr=[2 * row["s.e. %"]], fmt="_", color="k",
                        markersize=12, capsize=3)
    ax.axhspan(-0.5, 0.5, color="tab:green", alpha=0.12, linewidth=0)
    ax.axhline(0.0, color="k", linewidth=0.6)
    ax.set_xticks(range(len(cases)), [f"{m}\nR = {R}" for m, R in cases])
    ax.set_ylabel("final loss - fp32's, % (same seed)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def plot(results: list[RunResult], path: str) -> None:
    """A PNG: per (model, world size) one column, the validation-loss curves on top and below each
    reduction's loss minus fp32's, in % of fp32's (the gap the table reports at the end), clipped
    to +-2.5 %, with the +-0.5 % band shaded."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    panels = sorted({(r.spec["model"], r.spec["world_size"]) for r in results})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.0 * len(panels), 6.0), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})
    styles = {"fp32": ("k", "-"), "bf16-ring": ("tab:blue", "--"), "fp8-ef": ("tab:green", "-"),
              "fp8": ("tab:red", ":"), "int8-ef": ("tab:purple", "-.")}
    for column, (model, R) in enumerate(panels):
        runs = [r for r in results if (r.spec["model"], r.spec["world_size"]) == (model, R)]
        ref = next((dict(r.curve) for r in runs if r.spec["reduction"] == "fp32"), None)
        top, bottom = axes[0][column], axes[1][column]
        for r in runs:
            steps, losses = zip(*r.curve)
            color, line = styles.get(r.spec["reduction"], ("gray", "-"))
            top.plot(steps, losses, color=color, linestyle=line, linewidth=1.2,
                     label=f"{r.spec['reduction']} ({r.final_loss:.4f})")
            if ref is not None:
                gap = [(s, 100 * (loss - ref[s]) / ref[s]) for s, loss in r.curve if s in ref]
                bottom.plot(*zip(*gap), color=color, linestyle=line, linewidth=1.2)
        top.set_title(f"{model}, R = {R} gloo ranks", fontsize=10)
        top.set_ylabel("validation loss (nats)")
        top.grid(alpha=0.3)
        top.legend(fontsize=7)
        bottom.axhspan(-0.5, 0.5, color="tab:green", alpha=0.12, linewidth=0)
        bottom.set_xlabel("step")
        bottom.set_ylim(-2.5, 2.5)                  # the recall task's learning step goes far beyond: clipped
        bottom.set_ylabel("loss - fp32's, % (clipped)")
        bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
