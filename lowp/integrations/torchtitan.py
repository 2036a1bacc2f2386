"""lowp optimizers in torchtitan, chosen in its job configuration.

torchtitan (0.3) builds its optimizers from ``Trainer.Config.optimizer``, an
``OptimizersContainer.Config`` whose ``build(model_parts=...)`` constructs the container class the
config belongs to. The container groups each model part's parameters by
``ParamGroupConfig(pattern=..., optimizer_name=..., optimizer_kwargs=...)`` and resolves each
``optimizer_name`` through its static method ``_resolve_optimizer_factory``, which knows
``"Adam"``, ``"AdamW"`` and ``"DistMuon"``; the class docstring invites subclassing to customize
it (torchtitan's ``torchtitan/components/optimizer/optimizer.py``). This module's
:class:`LowpOptimizersContainer` is that subclass: it also resolves ``"lowp.AdamW"``,
``"lowp.Adam"`` and every other lowp optimizer (``"lowp." + class name``), and its nested
``Config`` builds it. In a torchtitan config function::

    from lowp.integrations.torchtitan import lowp_adamw

    config = llama3_debugmodel()
    config.optimizer = lowp_adamw(lr=8e-4, mode="exact8", state_dtype="int8/uint8")

What torchtitan hands every group and lowp reads differently:

- ``implementation`` (``"fused"`` by default) puts ``fused``/``foreach`` flags into every
  group; lowp's backend is one per optimizer, so the factory takes them out of the groups and
  translates: ``"fused"`` (and ``"fused_opt_states_bf16"``, whose bf16-state hook only touches
  ``torch.optim.Adam``/``AdamW``) leaves lowp's automatic choice (a fused kernel where one is
  available and worth it), ``"foreach"`` is ``foreach=True, fused=False``, ``"for-loop"`` is
  ``foreach=False, fused=False`` (lowp's one-tensor-at-a-time eager backend). Optimizer-wide
  options (``seed``, ``backend``, ``nonfinite``, ``chunk_size``, or ``fused=True`` to require a
  fused kernel) go into ``optimizer_factory_kwargs_by_name["lowp.AdamW"]``; they override the
  translation.
- Dtypes: configs are plain data (torchtitan serializes them with ``to_dict`` and overrides them
  from the command line), so ``state_dtype`` and ``state_scale_dtype`` may be names
  (:mod:`lowp.integrations.config`: ``"int8/uint8"`` is int8 ``exp_avg`` and uint8
  ``exp_avg_sq``).

Checkpoints: torchtitan's ``CheckpointManager`` saves ``OptimizersContainer.state_dict()``, a flat
FQN-keyed dict (``state.<fqn>.<name>``, ``param_groups.<fqn>.<key>``) built from each optimizer's
own ``state_dict()``, with ``torch.distributed.checkpoint``; before a save or a load on a fresh
optimizer it runs one step with zero gradients and ``lr=0`` to create the states. lowp's states
(DTensor shards under FSDP2, block-scaled codes with their scales, write-back buffers) and its
extras (seed, skip counters, kind: the ``"lowp"`` key of every group) travel through that dict
unchanged, so a resumed run continues bit for bit (``tests/test_integration_torchtitan.py``).

The module imports without torchtitan (which needs Python >= 3.11); ``LowpOptimizersContainer`` and
``lowp_adamw`` then raise ``ImportError`` when used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from lowp.integrations.config import configured_kwargs, optimizer_class, optimizer_names
from lowp.optim.base import LowpOptimizer

try:
    from torchtitan.components.optimizer import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
        OptimizersContainer, ParamGroupConfig)
except ImportError as error:   # the functions below that need no torchtitan still work
    _MISSING: ImportError | None = error
else:
    _MISSING = None

__all__ = ["PREFIX", "lowp_factory", "lowp_optimizer_names", "implementation_options",
           *(["LowpOptimizersContainer", "lowp_adamw"] if _MISSING is None else [])]

#: torchtitan optimizer names of lowp optimizers start with this (``"lowp.AdamW"``).
PREFIX = "lowp."


def lowp_optimizer_names() -> list[str]:
    """The ``optimizer_name`` of every lowp optimizer in a torchtitan ``ParamGroupConfig``
    (``"lowp.AdamW"``, ...)."""
    return [PREFIX + cls.__name__ for cls in optimizer_names().values()]


def implementation_options(groups: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """lowp's constructor options for the ``fused``/``foreach`` flags torchtitan's ``implementation``
    put into the groups (see the module docstring).

    Args:
        groups: the parameter groups torchtitan built for one optimizer.
        name: the optimizer's name, for the error.

    Returns:
        ``{}`` (lowp's automatic choice), or ``fused``/``foreach`` options.

    Raises:
        ValueError: the groups of one optimizer ask for different implementations.
    """
    found = {(g.get("fused"), g.get("foreach")) for g in groups}
    if len(found) > 1:
        raise ValueError(f"{name}: its parameter groups ask for different implementations ({sorted(found, key=str)}); "
                         f"lowp runs one backend per optimizer")
    fused, foreach = found.pop() if found else (None, None)
    if fused:
        return {}
    if foreach:
        return {"fused": False, "foreach": True}
    if fused is False and foreach is False:
        return {"fused": False, "foreach": False}
    return {}


def lowp_factory(name: str) -> Callable[..., LowpOptimizer]:
    """The optimizer factory torchtitan's container calls as ``factory(param_groups, **factory_kwargs)``
    for ``optimizer_name=name``.

    Args:
        name: ``"lowp."`` followed by a lowp optimizer's class name (``"lowp.AdamW"``).

    Returns:
        A function that builds the lowp optimizer: the groups' ``fused``/``foreach`` flags
        translated into constructor options (:func:`implementation_options`), dtype names read
        (:func:`lowp.integrations.config.configured_kwargs`) in the groups and the factory
        keywords, the factory keywords (optimizer-wide options) passed to the constructor.

    Raises:
        ValueError: ``name`` names no lowp optimizer.
    """
    cls = optimizer_class(name)

    def build(param_groups: Sequence[Mapping[str, Any]], **factory_kwargs: Any) -> LowpOptimizer:
        wide = implementation_options(param_groups, name)
        if "backend" in factory_kwargs or "fused" in factory_kwargs or "foreach" in factory_kwargs:
            wide = {}
        groups = [{**configured_kwargs(cls, {k: v for k, v in g.items() if k not in ("params", "fused", "foreach")}),
                   "params": g["params"]} for g in param_groups]
        return cls(groups, **{**wide, **configured_kwargs(cls, factory_kwargs)})

    build.__name__ = build.__qualname__ = f"build_{cls.__name__}"
    return build


if _MISSING is None:
    class LowpOptimizersContainer(OptimizersContainer):  # type: ignore[misc]
        """torchtitan's ``OptimizersContainer`` that also builds lowp optimizers: a
        ``ParamGroupConfig`` whose ``optimizer_name`` is ``"lowp."`` plus a lowp class name
        (``"lowp.AdamW"``) gets that lowp optimizer (:func:`lowp_factory`); other names resolve as
        torchtitan resolves them, so one container may mix lowp and torch optimizers.

        Args:
            config: its :class:`LowpOptimizersContainer.Config`.
            model_parts: the model parts to optimize (torchtitan passes them to ``Config.build``).
        """

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):  # type: ignore[misc]
            """torchtitan's ``OptimizersContainer.Config`` (same fields) whose ``build`` makes a
            :class:`LowpOptimizersContainer`."""

        @staticmethod
        def _resolve_optimizer_factory(name: str) -> Callable[..., Any]:
            if isinstance(name, str) and name.startswith(PREFIX):
                return lowp_factory(name)
            return OptimizersContainer._resolve_optimizer_factory(name)


    def lowp_adamw(lr: float = 8e-4, *, factory_kwargs: Mapping[str, Any] | None = None,
                   **kwargs: Any) -> LowpOptimizersContainer.Config:
        """A :class:`LowpOptimizersContainer.Config` with one catch-all lowp AdamW group, the
        counterpart of torchtitan's ``default_adamw`` (same defaults: betas (0.9, 0.95), eps 1e-8,
        weight decay 0.1).

        Args:
            lr: the learning rate.
            factory_kwargs: optimizer-wide lowp options (``seed``, ``backend``, ``nonfinite``...),
                passed once to the constructor.
            **kwargs: the group's options, overriding the defaults: AdamW's hyper-parameters and lowp's
                group options (``mode``, ``state_dtype`` as a dtype or a name such as ``"int8/uint8"``,
                ``state_block``...).

        Returns:
            The config; ``config.build(model_parts=[model])`` builds the container.
        """
        name = PREFIX + "AdamW"
        return LowpOptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name=name,
                                           optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8,
                                                             "weight_decay": 0.1, **kwargs})],
            optimizer_factory_kwargs_by_name={name: dict(factory_kwargs)} if factory_kwargs else {})


def __getattr__(name: str) -> Any:
    if name in ("LowpOptimizersContainer", "lowp_adamw") and _MISSING is not None:
        raise ImportError(f"lowp.integrations.torchtitan.{name} needs torchtitan (pip install torchtitan; it needs "
                          f"Python >= 3.11): {_MISSING}") from _MISSING
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
