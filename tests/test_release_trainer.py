"""Gradient release (``lowp.optim.release_gradients``) inside Hugging Face ``transformers.Trainer``,
on the tiny bf16 Llama of ``tests/test_integration_hf.py`` (built from a config, trained on CPU).

- ``gradient_accumulation_steps=2`` with release's default ``accumulation_steps=1`` raises
  ``ValueError`` naming ``accumulation_steps`` at Trainer's first ``optimizer.step()``, after the
  first cycle was stepped once per micro-batch; with ``accumulation_steps=2`` every parameter
  steps once per Trainer step, bit for bit as the same run without release.
- Trainer's ``max_grad_norm`` clips nothing under release (``clip_grad_norm_`` finds the gradients
  freed and Trainer logs ``grad_norm`` 0.0). The recipe: ``max_grad_norm=0`` and
  ``release_gradients(opt, max_norm=...)``, logging ``handle.grad_norm``; it equals the run without
  release that clips each step with torch's ``clip_grads_with_norm_`` and the previous step's norm.
- ``accumulate="states"`` (optimi's ``optimizer_accumulation``): Trainer's micro-batches each fold
  into the moments and free their gradients, so none is held between micro-batches.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import accelerate  # noqa: F401  transformers.Trainer needs it
from transformers import Trainer, TrainerCallback, TrainingArguments, get_linear_schedule_with_warmup

from lowp.optim import AdamW, GradientRelease, release_gradients
from lowp.threads import single_thread
from nested_equal import assert_nested_equal
from test_integration_hf import BATCH, Sequences, _llama

#: 32 sequences in micro-batches of 4: 8 micro-batches an epoch, 4 Trainer steps, no short cycle
GA, STEPS, MAX_NORM = 2, 8, 1.0


class ReleaseTrainer(Trainer):
    """Trainer that logs the release handle's norm as ``grad_norm`` (Trainer's own, from
    ``clip_grad_norm_`` after backward, is 0.0 under release: the gradients are freed)."""

    release: GradientRelease | None = None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.release is not None and self.release.grad_norm is not None and "grad_norm" in logs:
            logs["grad_norm"] = self.release.grad_norm
        super().log(logs, start_time)


class LaggedClip(TrainerCallback):
    """The reference without release: before each optimizer step, the fp64 norm of all gradients
    (torch's ``get_total_norm``), then torch's ``clip_grads_with_norm_`` with the previous step's."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = [p for p in model.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm([p.grad.double() for p in params])))
        if len(self.norms) > 1:
            torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, torch.tensor(self.norms[-2], dtype=torch.float64))


def _run(out: Path, release: dict[str, Any] | None, max_grad_norm: float = 0.0,
         callbacks: list[TrainerCallback] | None = None) -> tuple[ReleaseTrainer, AdamW]:
    """``STEPS`` Trainer steps of ``GA`` micro-batches, AdamW with stochastic rounding (its random
    bits depend on each parameter's step count); ``release``: the keywords of release_gradients,
    registered before the optimizer is handed to Trainer, or ``None``: no release."""
    model = _llama()
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, mode="stochastic", seed=5)
    handle = None if release is None else release_gradients(optimizer, **release)
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=GA, max_grad_norm=max_grad_norm, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                             learning_rate=3e-3, lr_scheduler_type="constant")
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, STEPS)
    trainer = ReleaseTrainer(model=model, args=args, train_dataset=Sequences(), callbacks=callbacks or [],
                             optimizers=(optimizer, scheduler))
    trainer.release = handle
    try:
        with single_thread():
            trainer.train()
    finally:
        if handle is not None:
            handle.remove()
    return trainer, optimizer


def _logged(trainer: Trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _steps(optimizer: AdamW) -> set[int]:
    return {int(optimizer.state[p]["step"]) for g in optimizer.param_groups for p in g["params"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[ReleaseTrainer, AdamW]]:
    """Without release; with release (accumulation_steps=GA) and Trainer's default clipping, which
    then does nothing; the lagged-clip reference without release; release with max_norm."""
    def out(name: str) -> Path:
        return tmp_path_factory.mktemp(name)
    return {"plain": _run(out("plain"), None),
            "released": _run(out("released"), {"accumulation_steps": GA}, max_grad_norm=MAX_NORM),
            "clip-reference": _run(out("clip-reference"), None, callbacks=[LaggedClip()]),
            "clip-released": _run(out("clip-released"), {"accumulation_steps": GA, "max_norm": MAX_NORM}),
            "states": _run(out("states"), {"accumulation_steps": GA, "accumulate": "states"},
                           callbacks=[HeldGradients()])}


class HeldGradients(TrainerCallback):
    """Counts the parameters holding a gradient after each micro-batch that does not end a step."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        self.held.append(sum(p.grad is not None for p in model.parameters()))


def test_states_accumulation_holds_no_gradient_between_micro_batches(runs):
    """Each micro-batch is a step of the moments (2 per Trainer step) and leaves no gradient
    behind; the weights move once per Trainer step, differently from exact accumulation."""
    (states, states_opt), plain = runs["states"], runs["plain"][0]
    held = next(c for c in states.callback_handler.callbacks if isinstance(c, HeldGradients)).held
    assert held == [0] * STEPS   # GA - 1 = 1 non-final micro-batch per Trainer step
    assert states.state.global_step == STEPS and _steps(states_opt) == {STEPS * GA}
    losses, exact = _logged(states, "loss"), _logged(plain, "loss")
    assert losses[0] == exact[0] and all(math.isfinite(x) for x in losses)
    assert not all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), states.model.parameters()))


def test_default_accumulation_steps_raises_at_the_first_optimizer_step(tmp_path):
    """Trainer accumulates 2 micro-batches; release's default steps after each of them. The first
    ``optimizer.step()`` is the earliest the mismatch shows: it raises naming the fix, after the
    first cycle was stepped twice."""
    with pytest.raises(ValueError, match=r"^accumulation_steps: optimizer.step\(\) came after 2 backward passes") as e:
        _run(tmp_path, {})
    assert "release_gradients(opt, accumulation_steps=2)" in str(e.value)
    assert "gradient_accumulation_steps=2" in str(e.value)


def test_default_accumulation_steps_state_when_it_raises(tmp_path):
    model = _llama()
    optimizer = AdamW(model.parameters(), lr=3e-3, mode="stochastic", seed=5)
    handle = release_gradients(optimizer)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=GA, save_strategy="no", report_to=[], use_cpu=True,
                             seed=0, disable_tqdm=True, learning_rate=3e-3)
    trainer = Trainer(model=model, args=args, train_dataset=Sequences(), optimizers=(optimizer, None))
    with single_thread(), pytest.raises(ValueError, match="^accumulation_steps: "):
        trainer.train()
    handle.remove()
    assert trainer.state.global_step == 0 and _steps(optimizer) == {GA}   # stepped per micro-batch


def test_matching_accumulation_steps_equals_the_run_without_release(runs):
    """One parameter step per Trainer step; weights, optimizer state and losses bit for bit as
    without release (whose Trainer clips nothing here: ``max_grad_norm=0``)."""
    (plain, plain_opt), (released, released_opt) = runs["plain"], runs["released"]
    assert released.state.global_step == plain.state.global_step == STEPS
    assert _steps(released_opt) == {STEPS}
    for (name, a), b in zip(plain.model.named_parameters(), released.model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert_nested_equal(plain_opt.state_dict(), released_opt.state_dict())
    assert _logged(released, "loss") == _logged(plain, "loss")


def test_trainer_max_grad_norm_does_nothing_under_release(runs):
    """The issue's symptom: with ``max_grad_norm=1.0`` Trainer's ``clip_grad_norm_`` finds no
    gradient under release, logs 0.0 and clips nothing: the run equals the unclipped one (above),
    although the true norms exceed 1.0."""
    released, clip_reference = runs["released"][0], runs["clip-reference"][0]
    assert _logged(released, "grad_norm") == [0.0] * STEPS
    assert sum(n > MAX_NORM for n in _logged(clip_reference, "grad_norm")) >= STEPS // 2


def test_max_norm_clips_with_the_previous_steps_norm(runs):
    """The recipe (``max_grad_norm=0``, ``release_gradients(opt, max_norm=1.0)``) equals bit for
    bit the run without release that clips each step's gradients with torch's
    ``clip_grads_with_norm_`` and the norm of the step before (the first step unclipped); the
    norms it logs are the true ones, and clipping changed the run."""
    (reference, reference_opt), (clipped, clipped_opt) = runs["clip-reference"], runs["clip-released"]
    norms = next(c for c in reference.callback_handler.callbacks if isinstance(c, LaggedClip)).norms
    assert len(norms) == STEPS and sum(n > MAX_NORM for n in norms[:-1]) >= STEPS // 2   # the clip was active
    for (name, a), b in zip(reference.model.named_parameters(), clipped.model.parameters()):
        assert torch.equal(a, b), name
    assert_nested_equal(reference_opt.state_dict(), clipped_opt.state_dict())
    assert _steps(clipped_opt) == {STEPS}
    assert _logged(clipped, "grad_norm") == pytest.approx(norms, rel=1e-12)
    # Trainer's own clip_grad_norm_ total in the reference run: per-tensor norms in bf16
    for trainer_norm, exact in zip(_logged(reference, "grad_norm"), norms):
        assert math.isclose(trainer_norm, exact, rel_tol=2 ** -7)
    plain = runs["plain"][0]
    assert not all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), clipped.model.parameters()))
