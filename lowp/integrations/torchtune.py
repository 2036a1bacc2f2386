"""lowp optimizers in torchtune recipes, chosen in the recipe's YAML configuration.

torchtune builds the optimizer of its recipes with ``config.instantiate(cfg.optimizer,
params)``: it imports the dotted path under ``_component_`` and calls it with the parameters and
the section's other keys as keyword arguments (torchtune's configuration docs, "All about
configs"). lowp's constructors take ``torch.dtype`` objects, which YAML cannot spell, so the
component is :func:`build_optimizer`, which reads dtype names (:mod:`lowp.integrations.config`)::

    optimizer:
      _component_: lowp.integrations.torchtune.build_optimizer
      optimizer: AdamW          # any lowp optimizer's class name
      lr: 2e-5
      mode: exact8
      state_dtype: {exp_avg: int8, exp_avg_sq: uint8}    # or "int8/uint8"

torchtune's own AdamW configs carry ``fused: True``; for lowp that asks for a fused kernel
(``RuntimeError`` where none can be built), so leave it out and let lowp choose.

Checkpoints: the full-finetune distributed recipe (torchtune 0.6) saves
``get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True, cpu_offload=True))`` on rank 0 with ``torch.save`` and loads it on
every rank with ``torch.load(..., weights_only=True)``; its ``load_from_full_optimizer_state_dict``
creates the fresh optimizer's states with one zero-gradient ``lr=0`` step, copies every saved group
key, and ``distribute_tensor``-s each saved state like the fresh one before
``opt.load_state_dict`` (or, where its distributed-state-dict switch is on,
``set_optimizer_state_dict`` with ``full_state_dict=True, broadcast_from_rank0=True``). lowp's
checkpoints hold no dtypes (so ``weights_only`` loading takes them) and carry the seed and skip
counters in every group, so either way a resumed run continues bit for bit
(``tests/test_integration_torchtune.py``). The recipe's ``optimizer_in_bwd`` builds one optimizer
per parameter; lowp's :func:`lowp.optim.release_gradients` is the lowp way to step during the
backward pass.
"""
from __future__ import annotations

from typing import Any, Iterable

from lowp.integrations.config import build_optimizer as _build_optimizer
from lowp.optim.base import LowpOptimizer

__all__ = ["build_optimizer"]


def build_optimizer(params: Iterable[Any], optimizer: str = "AdamW", **kwargs: Any) -> LowpOptimizer:
    """The ``_component_`` of a torchtune optimizer section: the lowp optimizer ``optimizer``
    over ``params``, its keywords read from YAML values (dtype names such as ``int8``, a dict of
    them per state, ``"int8/uint8"`` for Adam's two moments, lists for ``betas``).

    Args:
        params: the parameters torchtune passes (``model.parameters()``, or one parameter in a list
            for ``optimizer_in_bwd``), or parameter groups.
        optimizer: a lowp optimizer's class name (``"AdamW"``, ``"Lion"``...; any case, optionally
            prefixed with ``lowp.``).
        **kwargs: the section's other keys.

    Returns:
        The optimizer.
    """
    return _build_optimizer(params, optimizer, **kwargs)
