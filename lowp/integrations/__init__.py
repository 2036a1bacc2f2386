"""Choosing lowp optimizers by configuration in other training frameworks.

Each framework has its own module, imported on demand (none of them is imported by ``import lowp``,
and each needs only its own framework):

- :mod:`lowp.integrations.config`: the shared part: lowp optimizers by name (``"AdamW"``,
  ``"lowp.AdamW"``, ``"lowp_adamw"``), keyword values given as text or plain containers (dtype
  names such as ``"int8"``, ``"int8/uint8"`` for the two Adam moments), and
  :func:`~lowp.integrations.config.build_optimizer` for configuration systems that call a dotted
  path with the parameters (torchtune's ``_component_``, Hydra's ``_target_``).
- :mod:`lowp.integrations.torchtitan`: ``LowpOptimizersContainer``, torchtitan's optimizer
  container that also knows ``optimizer_name="lowp.AdamW"`` (and every other lowp optimizer),
  and ``lowp_adamw()``, the counterpart of torchtitan's ``default_adamw()``.
- :mod:`lowp.integrations.torchtune`: the ``_component_`` for torchtune's optimizer section.
- :mod:`lowp.integrations.transformers`: ``optim="lowp_adamw"`` and ``optim_args`` for Hugging
  Face ``Trainer``: ``lowp_optimizer_cls_and_kwargs``, ``LowpTrainingArguments`` and
  ``LowpTrainer``.
"""
from __future__ import annotations

__all__: list[str] = []
