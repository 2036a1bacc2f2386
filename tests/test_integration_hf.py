"""lowp optimizers inside Hugging Face ``transformers.Trainer``: a tiny bf16 Llama (built from a
config, no download) trained on CPU with a lowp AdamW handed over through ``optimizers=`` or
``optimizer_cls_and_kwargs=``. Trainer's checkpoints hold the whole lowp state (compensation or
remainder buffers, every state in its own dtype) and ``resume_from_checkpoint`` continues bit for
bit like the uninterrupted run; so does the 5-byte configuration (one-byte remainders, int8 / uint8
block-scaled moments). Each training runs once per module (``trained``); the tests check what it
left behind."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import accelerate  # noqa: E402,F401  transformers.Trainer needs it
from torch.utils.data import Dataset  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments, get_linear_schedule_with_warmup)

from lowp.optim import AdamW  # noqa: E402
from lowp.optim import backends as lo_backends  # noqa: E402
from lowp.optim.convert import cast_model  # noqa: E402
from lowp.threads import single_thread  # noqa: E402
from nested_equal import assert_nested_equal  # noqa: E402

STEPS, SAVE_AT, BATCH, MAX_GRAD_NORM = 16, 6, 4, 0.5
#: Resumed bit-identically; "stochastic" included because its random bits come from the
#: checkpointed generator state (and seed), which Trainer's optimizer.pt carries.
MODES = ("kahan", "exact", "stochastic", "exact8-codes")
#: "exact8-codes": AdamW at about 5 bytes per parameter (lowp memory's recommendation)
CODED = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


def _options(mode: str) -> dict:
    """The optimizer's keyword arguments of a ``MODES`` entry (one seed for all: the runs are
    compared bit for bit while alive together, when seedless optimizers would draw distinct seeds)."""
    if mode == "exact8-codes":
        return {"mode": "exact8", "state_dtype": CODED, "coded_min_numel": 0, "seed": 0}
    return {"mode": mode, "seed": 0}


class Sequences(Dataset):
    """32 arithmetic progressions mod 64 (learnable next-token patterns)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(16) * (1 + i % 3) + i) % 64
        return {"input_ids": ids, "labels": ids}


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return cast_model(LlamaForCausalLM(config), torch.bfloat16)


class GradNorms(TrainerCallback):
    """The fp64 2-norm of all gradients when Trainer hands them to the optimizer (after clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        self.norms.append(math.sqrt(sum(float(g.square().sum()) for g in grads)))


@dataclass
class Run:
    model: LlamaForCausalLM
    optimizer: torch.optim.Optimizer
    trainer: Trainer
    out: Path
    clipped: list[float] = field(default_factory=list)
    autocast: set[bool] = field(default_factory=set)

    def losses(self) -> dict[int, float]:
        return {h["step"]: h["loss"] for h in self.trainer.state.log_history if "loss" in h}

    def grad_norms(self) -> list[float]:
        return [h["grad_norm"] for h in self.trainer.state.log_history if "grad_norm" in h]


def _train(out: Path, mode: str, resume: Path | None = None, bf16: bool = False, through_cls: bool = False,
           steps: int = STEPS) -> Run:
    model = _llama()
    autocast: set[bool] = set()   # on the inner model: accelerate enters autocast inside the outer forward
    model.model.register_forward_pre_hook(lambda *_: autocast.add(torch.is_autocast_enabled("cpu")))
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=BATCH,
                             save_steps=SAVE_AT, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                             max_grad_norm=MAX_GRAD_NORM, bf16=bf16, disable_tqdm=True, learning_rate=3e-3,
                             lr_scheduler_type="constant", weight_decay=0.01)
    callback = GradNorms()
    if through_cls:
        trainer = Trainer(model=model, args=args, train_dataset=Sequences(), callbacks=[callback],
                          optimizer_cls_and_kwargs=(AdamW, {"lr": 3e-3, **_options(mode)}))
    else:
        optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, **_options(mode))
        scheduler = get_linear_schedule_with_warmup(optimizer, 2, STEPS)
        trainer = Trainer(model=model, args=args, train_dataset=Sequences(), callbacks=[callback],
                          optimizers=(optimizer, scheduler))
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    lowp_optimizer = trainer.optimizer.optimizer   # Trainer wraps it in accelerate's AcceleratedOptimizer
    return Run(model, lowp_optimizer, trainer, out, callback.norms, autocast)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per mode: the uninterrupted run and the run resumed from its step-``SAVE_AT`` checkpoint;
    plus ``optimizer_cls_and_kwargs`` and ``bf16=True`` runs (kahan)."""
    runs: dict[str, Run] = {}
    with single_thread():
        for mode in MODES:
            out = tmp_path_factory.mktemp(f"hf-{mode}")
            runs[mode] = _train(out, mode)
            runs[f"{mode}-resumed"] = _train(out, mode, resume=out / f"checkpoint-{SAVE_AT}")
        runs["cls"] = _train(tmp_path_factory.mktemp("hf-cls"), "kahan", through_cls=True, steps=SAVE_AT)
        runs["autocast"] = _train(tmp_path_factory.mktemp("hf-bf16"), "kahan", bf16=True, steps=SAVE_AT)
    return runs


@pytest.mark.parametrize("mode", MODES)
def test_loss_goes_down(trained, mode):
    losses = list(trained[mode].losses().values())
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < 0.9 * sum(losses[:4]) / 4


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_holds_the_lowp_state(trained, mode):
    run = trained[mode]
    saved = torch.load(run.out / f"checkpoint-{SAVE_AT}" / "optimizer.pt", weights_only=True)
    params = list(run.model.parameters())
    assert len(saved["state"]) == len(params)
    buffer = {"kahan": ("compensation", torch.bfloat16), "exact": ("remainder", torch.int16),
              "stochastic": None, "exact8-codes": ("remainder8", torch.int8)}[mode]
    for i, p in enumerate(params):
        entry = saved["state"][i]
        assert int(entry["step"]) == SAVE_AT
        if mode == "exact8-codes":   # codes in their own dtypes, their bf16 block scales beside them
            assert (entry["exp_avg"].dtype, entry["exp_avg_sq"].dtype) == (torch.int8, torch.uint8)
            assert entry["exp_avg_scale"].dtype == entry["exp_avg_sq_scale"].dtype == torch.bfloat16
            assert entry["exp_avg"].count_nonzero() > 0 and entry["exp_avg_sq"].count_nonzero() > 0
        else:
            assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == p.dtype
        low = p.dtype == torch.bfloat16
        if low and buffer is not None:
            name, dtype = buffer
            assert entry[name].dtype == dtype and entry[name].shape == p.shape
            assert entry[name].count_nonzero() > 0       # the buffer holds what bf16 could not
        else:
            assert not {"compensation", "remainder"} & entry.keys()
    assert {p.dtype for p in params} == {torch.bfloat16, torch.float32}   # fp32 RMSNorm weights kept
    extras = saved["param_groups"][0]["lowp"]
    assert extras["seed"] == run.optimizer.seed and "generators" not in extras   # seed + steps define the streams


@pytest.mark.parametrize("mode", MODES)
def test_resume_is_bit_identical(trained, mode):
    full, resumed = trained[mode], trained[f"{mode}-resumed"]
    assert resumed.trainer.state.global_step == STEPS
    assert len(resumed.clipped) == STEPS - SAVE_AT            # it trained from the checkpoint on
    assert resumed.losses() == full.losses()                   # its history up to SAVE_AT comes from it
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert_nested_equal(full.optimizer.state_dict(), resumed.optimizer.state_dict())
    assert_nested_equal(full.trainer.lr_scheduler.state_dict(), resumed.trainer.lr_scheduler.state_dict())


def test_max_grad_norm_clips_bf16_gradients(trained):
    run = trained["kahan"]
    before, after = run.grad_norms(), run.clipped
    assert len(before) == len(after) == STEPS
    assert sum(n > MAX_GRAD_NORM for n in before) >= STEPS // 2    # clipping was active
    for pre, post in zip(before, after):
        expected = min(pre, MAX_GRAD_NORM)
        assert abs(post - expected) <= 2 ** -6 * expected   # bf16 gradients scaled by a bf16 coefficient


def test_optimizer_cls_and_kwargs(trained):
    run = trained["cls"]
    assert isinstance(run.optimizer, AdamW)
    # Trainer's two groups: weight decay for matrices, none for biases and norm weights
    assert [g["weight_decay"] for g in run.optimizer.param_groups] == [0.01, 0.0]
    assert all(g["mode"] == "kahan" for g in run.optimizer.param_groups)
    saved = torch.load(run.out / f"checkpoint-{SAVE_AT}" / "optimizer.pt", weights_only=True)
    bf16 = [i for i, p in enumerate(p for g in run.optimizer.param_groups for p in g["params"])
            if p.dtype == torch.bfloat16]
    assert bf16 and all(saved["state"][i]["compensation"].dtype == torch.bfloat16 for i in bf16)
    losses = list(run.losses().values())
    assert losses[-1] < losses[0]


def test_bf16_autocast_flag_with_bf16_weights(trained):
    """``bf16=True`` means CPU autocast: with a model already cast to bf16 it changes nothing,
    bit for bit (matmuls already run in bf16, the fp32 norms are not autocast ops)."""
    plain, autocast = trained["kahan"], trained["autocast"]
    assert plain.autocast == {False} and autocast.autocast == {True}
    assert {p.dtype for p in autocast.model.parameters()} == {torch.bfloat16, torch.float32}
    assert autocast.losses() == {s: x for s, x in plain.losses().items() if s <= SAVE_AT}



@pytest.mark.skipif(not lo_backends.native_available(), reason="the cached step plan runs the native kernel")
def test_native_steps_take_the_cached_plan_inside_trainer(tmp_path, monkeypatch):
    """In Trainer's loop (gradient clipping, a scheduler, bf16 and fp32 parameters interleaved in
    one group) every step after the first takes the cached plan of the native kernel."""
    monkeypatch.setattr(sys.modules[__name__], "_options", lambda mode, options=_options: {**options(mode),
                                                                                            "backend": "native"})
    run = _train(tmp_path, "kahan", steps=6)
    assert run.optimizer.backend.name == "native"
    assert run.optimizer._plans.cached_steps == 5
