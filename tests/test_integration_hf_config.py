"""lowp chosen by configuration in Hugging Face ``transformers.Trainer``
(:mod:`lowp.integrations.transformers`): ``optim="lowp_adamw"`` with ``optim_args`` in
``LowpTrainingArguments`` (from ``HfArgumentParser``, as a command line or a JSON/YAML file gives
them) trains a tiny bf16 Llama (built from a config, no download; tests/test_integration_hf.py's
helpers) under ``LowpTrainer``; the checkpoint resumes a run configured with another lowp seed bit
for bit, with the default options and with exact8 + int8/uint8 states. The helper for plain
``Trainer(optimizer_cls_and_kwargs=...)`` reads the same names and options."""
from __future__ import annotations

import math

import pytest
import torch

import accelerate  # noqa: F401  transformers.Trainer needs it
from transformers import HfArgumentParser, Trainer, TrainingArguments

from lowp.integrations.transformers import (LowpTrainer, LowpTrainingArguments, lowp_optim_names,
                                            lowp_optimizer_cls_and_kwargs)
from lowp.optim import SGD, AdamW, Lion
from lowp.threads import single_thread
from nested_equal import assert_nested_equal
from test_integration_hf import BATCH, Sequences, _llama

STEPS, SAVE_AT = 8, 4
#: optim_args per configuration (the seed is appended per run)
CONFIGS = {"default": "", "exact8": "mode=exact8,state_dtype=int8/uint8,coded_min_numel=0"}


def _arguments(out, config: str, seed: int) -> LowpTrainingArguments:
    """The arguments as a configuration file gives them, parsed by transformers' own parser."""
    optim_args = ",".join(filter(None, [CONFIGS[config], f"seed={seed}"]))
    (args,) = HfArgumentParser(LowpTrainingArguments).parse_dict({
        "output_dir": str(out), "optim": "lowp_adamw", "optim_args": optim_args, "learning_rate": 3e-3,
        "adam_beta2": 0.95, "weight_decay": 0.01, "max_steps": STEPS, "save_steps": SAVE_AT,
        "per_device_train_batch_size": BATCH, "logging_steps": 1, "report_to": [], "use_cpu": True, "seed": 0,
        "max_grad_norm": 0.5, "lr_scheduler_type": "linear", "warmup_steps": 2, "disable_tqdm": True})
    return args


def _train(out, config: str, seed: int, resume=None) -> LowpTrainer:
    trainer = LowpTrainer(model=_llama(), args=_arguments(out, config, seed), train_dataset=Sequences())
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs = {}
    with single_thread():
        for config in CONFIGS:
            out = tmp_path_factory.mktemp(f"hf-config-{config}")
            runs[config] = _train(out, config, seed=1)
            runs[f"{config}-resumed"] = _train(out, config, seed=2, resume=out / f"checkpoint-{SAVE_AT}")
    return runs


def test_names_and_command_line():
    assert {"lowp_adamw", "lowp_adam", "lowp_lion", "lowp_sgd"} <= set(lowp_optim_names())
    (args,) = HfArgumentParser(LowpTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "unused", "--optim", "lowp_lion", "--optim_args", "betas=0.95/0.98, state_dtype=bfloat16"])
    assert args.optim == "lowp_lion"
    cls, kwargs = LowpTrainer.get_optimizer_cls_and_kwargs(args)
    assert cls is Lion and kwargs == {"lr": 5e-5, "betas": (0.95, 0.98), "state_dtype": torch.bfloat16}
    assert LowpTrainingArguments(output_dir="unused").optim == "lowp_adamw"   # the default here
    other = LowpTrainingArguments(output_dir="unused", optim="adamw_torch")   # transformers' names still work
    assert LowpTrainer.get_optimizer_cls_and_kwargs(other)[0] is torch.optim.AdamW
    args = LowpTrainingArguments(output_dir="unused").set_optimizer("lowp_sgd", 0.1, args="momentum=0.9")
    assert LowpTrainer.get_optimizer_cls_and_kwargs(args) == (SGD, {"lr": 0.1, "momentum": 0.9})


def test_bad_names_and_options_fail_early():
    with pytest.raises(ValueError, match="names no lowp optimizer"):
        LowpTrainingArguments(output_dir="unused", optim="lowp_adamw9")
    with pytest.raises(ValueError, match="key=value"):
        LowpTrainingArguments(output_dir="unused", optim_args="mode")
    with pytest.raises(ValueError, match="not a lowp optimizer"):
        lowp_optimizer_cls_and_kwargs(TrainingArguments(output_dir="unused"))   # adamw_torch_fused


def test_cls_and_kwargs_for_plain_trainer():
    """A configuration section (a dict) or plain ``TrainingArguments`` plus the name; transformers'
    defaults for what the section leaves out, as its AdamW handler reads them."""
    cls, kwargs = lowp_optimizer_cls_and_kwargs(
        {"optim": "lowp_adamw", "optim_args": "mode=exact8,state_dtype=int8/uint8,state_block=32"})
    assert cls is AdamW
    assert kwargs == {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "mode": "exact8", "state_block": 32,
                      "state_dtype": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}}
    args = TrainingArguments(output_dir="unused", learning_rate=1e-3, adam_epsilon=1e-6, optim_args="amsgrad=true,"
                             "state_dtype=exp_avg:int8/exp_avg_sq:uint8/max_exp_avg_sq:bfloat16")
    cls, kwargs = lowp_optimizer_cls_and_kwargs(args, optim="lowp_adamw")
    assert kwargs["lr"] == 1e-3 and kwargs["eps"] == 1e-6 and kwargs["amsgrad"] is True
    assert kwargs["state_dtype"]["max_exp_avg_sq"] == torch.bfloat16
    trainer = Trainer(model=_llama(), args=args, optimizer_cls_and_kwargs=(cls, kwargs))
    opt = trainer.create_optimizer()
    assert type(opt) is AdamW and [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]
    assert all(g["amsgrad"] for g in opt.param_groups)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_trains_with_the_configured_optimizer(trained, config):
    trainer = trained[config]
    opt = trainer.optimizer.optimizer   # inside accelerate's AcceleratedOptimizer
    assert type(opt) is AdamW and opt.seed == 1
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    weight = trainer.model.model.layers[0].mlp.up_proj.weight
    state = opt.state[weight]
    if config == "exact8":
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (torch.int8, torch.uint8)
        assert state["remainder8"].dtype == torch.int8
    else:
        assert state["exp_avg"].dtype == torch.bfloat16 and state["compensation"].dtype == torch.bfloat16
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_resume_is_bit_identical(trained, config):
    full, resumed = trained[config], trained[f"{config}-resumed"]
    assert resumed.state.global_step == STEPS
    opt, again = full.optimizer.optimizer, resumed.optimizer.optimizer
    assert again.seed == 1   # configured with seed=2: the checkpoint's seed won
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert_nested_equal(opt.state_dict(), again.state_dict())
    assert_nested_equal(full.lr_scheduler.state_dict(), resumed.lr_scheduler.state_dict())
    losses = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    assert losses == {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
