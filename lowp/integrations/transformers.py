"""lowp optimizers in Hugging Face ``transformers.Trainer``, chosen by ``optim`` and ``optim_args``.

``TrainingArguments.optim`` is an enum of transformers' own optimizer names (``OptimizerNames``;
``__post_init__`` refuses any other), and ``Trainer.get_optimizer_cls_and_kwargs`` dispatches those
names to its built-in handlers; transformers has no registry for outside optimizers. What it does
offer (transformers 5.x, the ``Trainer`` and ``TrainingArguments`` reference): the
``optimizer_cls_and_kwargs=(cls, kwargs)`` argument of ``Trainer``, ``optim_args`` (a free-form
``"key=value,key=value"`` string) and subclassing ``Trainer``. This module builds on those, without
touching transformers' enum:

- :func:`lowp_optimizer_cls_and_kwargs`: a lowp name (``"lowp_adamw"``, ``"lowp_lion"``... any
  lowp optimizer, ``"lowp_"`` plus its lower-case class name) and ``optim_args`` (such as
  ``"mode=exact8,state_dtype=int8/uint8"``, read by :mod:`lowp.integrations.config`) become what
  ``Trainer(optimizer_cls_and_kwargs=...)`` takes, with the learning rate, betas and epsilon taken
  from the arguments as transformers' own AdamW handler takes them.
- :class:`LowpTrainingArguments`: ``TrainingArguments`` whose ``optim`` also accepts the lowp
  names (default ``"lowp_adamw"``), also from ``HfArgumentParser`` (command line, JSON, YAML).
- :class:`LowpTrainer`: ``Trainer`` whose ``get_optimizer_cls_and_kwargs`` builds the lowp
  optimizer an ``optim`` lowp name asks for; other names go to transformers.

So by configuration::

    args = LowpTrainingArguments(output_dir="out", optim="lowp_adamw", optim_args="mode=exact8,state_dtype=int8/uint8")
    trainer = LowpTrainer(model=model, args=args, train_dataset=data)

or, with transformers' own classes::

    section = {"optim": "lowp_adamw", "optim_args": "mode=exact8,state_dtype=int8/uint8", "learning_rate": 3e-4}
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=lowp_optimizer_cls_and_kwargs(section))

Trainer's checkpoints (``optimizer.pt``, loaded with ``weights_only=True``) hold the whole lowp
state, and ``resume_from_checkpoint`` continues bit for bit (``tests/test_integration_hf.py``,
``tests/test_integration_hf_config.py``).
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

from lowp.integrations.config import (configured_kwargs, is_lowp_name, optimizer_class, optimizer_names,
                                     parse_optim_args)
from lowp.optim.base import LowpOptimizer

__all__ = ["lowp_optimizer_cls_and_kwargs", "lowp_optim_names", "LowpTrainingArguments", "LowpTrainer"]

#: The names of lowp optimizers for ``optim``: ``"lowp_"`` plus the lower-case class name.
PREFIX = "lowp_"
#: The arguments :func:`lowp_optimizer_cls_and_kwargs` reads, with transformers' defaults.
_READ = ("optim", "optim_args", "learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon")


def lowp_optim_names() -> list[str]:
    """Every ``optim`` name of a lowp optimizer (``"lowp_adamw"``, ``"lowp_lion"``...)."""
    return [PREFIX + name for name in optimizer_names()]


def _argument(args: Any, name: str) -> Any:
    if isinstance(args, Mapping):
        if name in args:
            return args[name]
        default = TrainingArguments.__dataclass_fields__[name].default
        return None if default is dataclasses.MISSING else default
    return getattr(args, name)


def lowp_optimizer_cls_and_kwargs(args: Any, optim: str | None = None) -> tuple[type[LowpOptimizer], dict[str, Any]]:
    """The ``(optimizer class, keyword arguments)`` pair ``Trainer(optimizer_cls_and_kwargs=...)``
    takes, for a lowp optimizer chosen by name.

    The keywords are ``lr`` (``learning_rate``), ``betas`` (``(adam_beta1, adam_beta2)``, for
    optimizers with two betas) and ``eps`` (``adam_epsilon``, for optimizers with a numeric
    ``eps``), as transformers' AdamW handler passes them, then ``optim_args`` on top (any
    constructor keyword of the optimizer; ``state_dtype=int8/uint8`` and other dtype names are read
    by :func:`lowp.integrations.config.configured_kwargs`). Weight decay is left to the parameter
    groups Trainer builds (``weight_decay`` for matrices, 0 for biases and norms).

    Args:
        args: a ``TrainingArguments`` (or :class:`LowpTrainingArguments`), or a mapping of some of
            its fields (``optim``, ``optim_args``, ``learning_rate``, ``adam_beta1``,
            ``adam_beta2``, ``adam_epsilon``; transformers' defaults for the others), such as a
            configuration file's section.
        optim: the lowp name, overriding ``args``' ``optim`` (plain ``TrainingArguments`` accept
            only transformers' names there).

    Returns:
        The class and its keyword arguments (a new dict).

    Raises:
        ValueError: the name is not a lowp optimizer's, or ``optim_args`` cannot be read.
    """
    name = optim if optim is not None else _argument(args, "optim")
    name = name.value if isinstance(name, OptimizerNames) else name
    if not is_lowp_name(name):
        raise ValueError(f"optim: {name!r} is not a lowp optimizer; expected one of {', '.join(lowp_optim_names())}")
    cls = optimizer_class(name)
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    kwargs: dict[str, Any] = {"lr": _argument(args, "learning_rate")}
    betas = defaults.get("betas")
    if isinstance(betas, tuple) and len(betas) == 2:
        kwargs["betas"] = (_argument(args, "adam_beta1"), _argument(args, "adam_beta2"))
    if isinstance(defaults.get("eps"), float):
        kwargs["eps"] = _argument(args, "adam_epsilon")
    kwargs.update(parse_optim_args(_argument(args, "optim_args")))
    return cls, configured_kwargs(cls, kwargs)


@dataclass
class LowpTrainingArguments(TrainingArguments):
    """``transformers.TrainingArguments`` whose ``optim`` also takes lowp optimizers' names
    (``"lowp_adamw"``, the default here; :func:`lowp_optim_names`), with their options in
    ``optim_args`` (``"mode=exact8,state_dtype=int8/uint8"``). Every other field is transformers';
    transformers' own ``optim`` names work as before. Train with :class:`LowpTrainer`, or hand
    :func:`lowp_optimizer_cls_and_kwargs` of these arguments to ``Trainer``.

    Args:
        *args: ``TrainingArguments``' fields, in its order (``output_dir`` first).
        optim: a lowp name, or one of transformers' ``OptimizerNames``.
        **kwargs: ``TrainingArguments``' other fields (see transformers' documentation).
    """

    optim: str = field(default="lowp_adamw", metadata={
        "help": "The optimizer: a lowp optimizer ('lowp_adamw', 'lowp_adam', 'lowp_lion', ...; options in "
                "--optim_args, e.g. 'mode=exact8,state_dtype=int8/uint8') or one of transformers' OptimizerNames."})

    # the dataclass keeps this __init__ (transformers' own sets every field, then runs __post_init__)
    def __init__(self, *args: Any, optim: str = "lowp_adamw", **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "optim": optim})

    def __post_init__(self) -> None:
        name = self.optim
        lowp = is_lowp_name(name)
        if lowp:   # transformers' checks see one of its own names; the lowp name is kept
            self.optim = OptimizerNames.ADAMW_TORCH
        elif isinstance(name, str) and name.lower().startswith(PREFIX):
            raise ValueError(f"optim: {name!r} names no lowp optimizer; expected one of "
                             f"{', '.join(lowp_optim_names())}")
        try:
            super().__post_init__()
        finally:
            if lowp:
                self.optim = name.lower()
        if lowp:
            lowp_optimizer_cls_and_kwargs(self)   # an unreadable optim_args fails here, not at train()

    def set_optimizer(self, name: str = "lowp_adamw", learning_rate: float = 5e-5, weight_decay: float = 0,
                      beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
                      args: str | None = None) -> LowpTrainingArguments:
        """``TrainingArguments.set_optimizer`` that also takes lowp names (then ``args`` are
        ``optim_args``).

        Args:
            name: the optimizer's name.
            learning_rate: the learning rate.
            weight_decay: the weight decay of matrices (Trainer gives biases and norms none).
            beta1: ``adam_beta1``.
            beta2: ``adam_beta2``.
            epsilon: ``adam_epsilon``.
            args: ``optim_args``.

        Returns:
            These arguments.
        """
        if not is_lowp_name(name):
            super().set_optimizer(name, learning_rate, weight_decay, beta1, beta2, epsilon, args)
            return self
        self.optim, self.learning_rate, self.weight_decay = name.lower(), learning_rate, weight_decay
        self.adam_beta1, self.adam_beta2, self.adam_epsilon, self.optim_args = beta1, beta2, epsilon, args
        lowp_optimizer_cls_and_kwargs(self)
        return self


class LowpTrainer(Trainer):
    """``transformers.Trainer`` that builds the lowp optimizer ``args.optim`` names
    (:class:`LowpTrainingArguments`); other names, ``optimizers=`` and
    ``optimizer_cls_and_kwargs=`` work as in ``Trainer``.

    Args:
        *args: ``Trainer``'s arguments (``model``, ``args``...).
        **kwargs: ``Trainer``'s keyword arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, Any]:
        """:func:`lowp_optimizer_cls_and_kwargs` for a lowp ``args.optim``, else ``Trainer``'s.

        Args:
            args: the training arguments.
            model: the model (some of transformers' optimizers need it).

        Returns:
            The optimizer class and its keyword arguments.
        """
        if is_lowp_name(getattr(args, "optim", None)):
            return lowp_optimizer_cls_and_kwargs(args)
        return Trainer.get_optimizer_cls_and_kwargs(args, model)
