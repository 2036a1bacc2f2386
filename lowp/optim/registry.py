"""Every lowp optimizer, found from its class, with its test entry (as torch's ``optim_db``
lists torch.optim's in ``torch/testing/_internal/common_optimizers.py``).

An optimizer joins by being imported in ``lowp/optim/__init__.py`` (one line): :func:`optimizers`
lists every :class:`~lowp.optim.base.LowpOptimizer` subclass that a module of ``lowp.optim`` defines
and exports, and the package exports every name of those modules' ``__all__``.

What the generic tests run comes from the class itself, read by :func:`entry`:

- ``examples``: keyword sets that together exercise every switch of the optimizer, each an
  :class:`Example` (a dict of keywords with a description; plain dicts are described by their
  keywords);
- ``error_inputs``: keyword sets the optimizer must refuse, each an :class:`ErrorInput` with the
  error type and message; those every optimizer shares (``lr``, the options of
  :class:`~lowp.optim.base.LowpOptimizer`, and ``betas``, ``eps``, ``weight_decay`` and bool
  switches where its constructor takes them) are made once, by :func:`common_error_inputs`;
- ``skips``: generic tests the optimizer is known to fail, each a :class:`Skip` with the reason
  and the error it fails with (the test then must fail so: a skip that starts passing fails too).

``tests/test_optim_db.py`` (errors, steps in every write-back mode, block-scaled states, resuming,
copies), ``tests/test_registry.py`` (the fused backends), ``tests/safety_cases.py`` and
``tests/test_optim_compile.py`` run every optimizer of :func:`entries`.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from lowp.optim.base import LowpOptimizer

__all__ = ["optimizers", "exported_names", "Example", "ErrorInput", "Skip", "Entry", "entry", "entries",
           "common_error_inputs"]


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    subclasses: list[type] = cls.__subclasses__()
    for subclass in subclasses:
        out += [subclass, *_subclasses(subclass)]
    return out


def optimizers() -> tuple[type[LowpOptimizer], ...]:
    """lowp's optimizer classes, by name (the classes defined and exported by ``lowp.optim.*``
    modules; user subclasses and the shared bases are not listed)."""
    found = {}
    for cls in _subclasses(LowpOptimizer):
        module = sys.modules.get(cls.__module__)
        if cls.__module__.startswith("lowp.optim.") and cls.__module__ != "lowp.optim.base" \
                and cls.__name__ in getattr(module, "__all__", ()):
            found[cls.__name__] = cls
    return tuple(found[name] for name in sorted(found))


def exported_names() -> list[str]:
    """The public names of every optimizer module (its class and functional form...)."""
    names: list[str] = []
    for cls in optimizers():
        names += [n for n in sys.modules[cls.__module__].__all__ if n not in names]
    return names


class Example(dict[str, Any]):
    """One keyword set of an optimizer's ``examples``, with a description.

    A dict of the keywords (``cls(params, **example)``; ``dict(example, lr=...)``), so that code
    reading ``cls.examples`` as keyword dicts keeps working; the description names what the set
    exercises (the ids of the generic tests).

    Args:
        desc: what this keyword set exercises (a switch, a branch of the rule...).
        **kwargs: the constructor keywords.
    """

    def __init__(self, desc: str, /, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.desc = desc

    def __repr__(self) -> str:
        return f"Example({self.desc!r}, {super().__repr__()})"


@dataclasses.dataclass(frozen=True)
class ErrorInput:
    """Constructor keywords an optimizer refuses, and how (torch's ``ErrorOptimizerInput``).

    Args:
        kwargs: the keywords (with the parameters :attr:`dtype` gives).
        error_type: the exception class raised.
        match: a regular expression the message must match (``re.search``).
        desc: what is wrong, in words (the id of the generic test).
        dtype: the dtype of the parameters the optimizer is given (default bf16).
    """

    kwargs: Mapping[str, Any]
    error_type: type[Exception]
    match: str
    desc: str
    dtype: torch.dtype = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Skip:
    """A generic test an optimizer is known to fail (torch's ``skips``), kept honest: the test is
    expected to fail with ``raises`` and fails when it passes, so that a fixed skip is removed.

    Args:
        test: the generic test's function name (``test_...`` in ``tests/test_optim_db.py``).
        reason: why the optimizer fails it.
        raises: the exception it fails with.
    """

    test: str
    reason: str
    raises: type[BaseException]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One optimizer as the generic tests read it (torch's ``OptimizerInfo``).

    Args:
        cls: the optimizer class.
        examples: its keyword sets, each with a description.
        error_inputs: what it refuses: :func:`common_error_inputs`, then its class's own.
        skips: the generic tests it is known to fail.
    """

    cls: type[LowpOptimizer]
    examples: tuple[Example, ...]
    error_inputs: tuple[ErrorInput, ...]
    skips: tuple[Skip, ...] = ()

    @property
    def name(self) -> str:
        """The optimizer's class name."""
        return self.cls.__name__

    def skip(self, test: str) -> Skip | None:
        """The known failure of generic test ``test``, ``None`` when the optimizer passes it."""
        return next((s for s in self.skips if s.test == test), None)


def _described(example: Mapping[str, Any]) -> Example:
    """``example`` as an :class:`Example` (a plain dict is described by its keywords)."""
    if isinstance(example, Example):
        return example
    return Example(",".join(f"{k}={v}" for k, v in example.items()) or "defaults", **example)


def _defaults(cls: type[LowpOptimizer]) -> dict[str, Any]:
    """The constructor's hyper-parameters with their defaults (``params`` and ``**options`` left out)."""
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _unsigned_code_error(cls: type[LowpOptimizer], defaults: dict[str, Any]) -> list[ErrorInput]:
    """uint8 codes (square roots) for every state: refused naming the first state its spec does
    not declare nonnegative, for the states of the default hyper-parameters."""
    spec = cls.spec
    if spec is None:
        return []
    signed = [name for name in spec.states(defaults) if name not in spec.nonnegative]
    if not signed:
        return []
    return [ErrorInput(dict(state_dtype=torch.uint8), ValueError,
                       rf"^state_dtype: uint8 codes hold nonnegative states only .*'{signed[0]}' may be negative",
                       "unsigned codes for a signed state")]


def common_error_inputs(cls: type[LowpOptimizer]) -> tuple[ErrorInput, ...]:
    """What every lowp optimizer refuses, as ``cls`` spells it: a bad ``lr``, each option of
    :class:`~lowp.optim.base.LowpOptimizer` out of range, an unknown keyword and another
    library's; and, where ``cls``'s constructor takes them, a ``betas`` of the wrong length or
    with a value out of [0, 1) or a bool, an ``eps`` or ``weight_decay`` that is negative, nan
    or a bool, a non-bool switch (a hyper-parameter whose default is a bool), uint8 codes for a
    state that may be negative."""
    def bad(desc: str, match: str, **kwargs: Any) -> ErrorInput:
        return ErrorInput(kwargs, ValueError, "^" + match, desc)

    number, flag = "expected a finite number >= 0, got ", "expected True or False, got "
    seed = r"seed: expected an int in \[0, 2\*\*64\), got "
    out = [
        bad("negative lr", r"lr: " + number + r"-1\.0", lr=-1.0),
        bad("nan lr", r"lr: " + number + "nan", lr=math.nan),
        bad("bool lr", r"lr: " + number + "True", lr=True),
        bad("bool tensor lr", r"lr: " + number + r"tensor\(True\)", lr=torch.tensor(True)),
        bad("two-element lr", r"lr: " + number + "tensor", lr=torch.ones(2)),
        bad("unknown mode", r"mode: unknown update mode 'bogus'; expected 'auto' or one of", mode="bogus"),
        ErrorInput(dict(mode="exact"), TypeError, r"^mode: 'exact' does not support torch\.float16 parameters",
                   "exact mode on fp16 weights", dtype=torch.float16),
        bad("str kahan_sum", r"kahan_sum: expected True, False or None, got 'yes'", kahan_sum="yes"),
        bad("kahan_sum against mode", r"kahan_sum: kahan_sum=True means mode='kahan', which conflicts with "
            r"mode='stochastic'", kahan_sum=True, mode="stochastic"),
        bad("no kahan_sum against mode", r"kahan_sum: kahan_sum=False means mode='nearest', which conflicts with "
            r"mode='kahan'", kahan_sum=False, mode="kahan"),
        bad("unknown state rounding", r"state_rounding: expected one of nearest, stochastic, got 'up'",
            state_rounding="up"),
        bad("fp64 states", r"state_dtype: expected None, torch\.float32, .* got torch\.float64",
            state_dtype=torch.float64),
        bad("fp64 state by name", r"state_dtype: expected None, .* got \{'exp_avg': torch\.float64\}",
            state_dtype={"exp_avg": torch.float64}),
        bad("unknown state name", rf"state_dtype: 'bogus' is not a state of {cls.__name__} \(its states: ",
            state_dtype={"bogus": torch.int8}),
        bad("block of 48", r"state_block: expected one of 32, 64, 128, 256, got 48", state_block=48),
        bad("negative coded_min_numel", r"coded_min_numel: expected an int >= 0 \(a number of elements\), got -1",
            coded_min_numel=-1),
        bad("float coded_min_numel", r"coded_min_numel: expected an int >= 0 .* got 4096\.0", coded_min_numel=4096.0),
        bad("bool coded_min_numel", r"coded_min_numel: expected an int >= 0 .* got True", coded_min_numel=True),
        bad("int8 block scales", r"state_scale_dtype: expected one of torch\.bfloat16", state_scale_dtype=torch.int8),
        bad("int maximize", r"maximize: " + flag + "1", maximize=1),
        bad("str maximize", r"maximize: " + flag + "'no'", maximize="no"),
        bad("unknown nonfinite policy", r"nonfinite: expected one of skip_param, skip_step, off, got 'ignore'",
            nonfinite="ignore"),
        bad("str foreach", r"foreach: expected True, False or None, got 'yes'", foreach="yes"),
        bad("str fused", r"fused: expected None, True or False, got 'yes'", fused="yes"),
        bad("unknown backend", r"backend: unknown backend 'bogus'; expected one of", backend="bogus"),
        bad("fused with a backend", r"fused: fused=True conflicts with backend='foreach'", fused=True,
            backend="foreach"),
        bad("chunk of 0", r"chunk_size: expected a positive int or None, got 0", chunk_size=0),
        bad("negative seed", seed + "-1", seed=-1),
        bad("seed above 2**64", seed + str(2 ** 70), seed=2 ** 70),
        bad("float seed", seed + r"1\.5", seed=1.5),
        bad("bool seed", seed + "True", seed=True),
        bad("int diagnostics", r"diagnostics: " + flag + "1", diagnostics=1),
        bad("str diagnostics", r"diagnostics: " + flag + "'off'", diagnostics="off"),
        bad("capturable", r"capturable: capturable=True .* is not supported", capturable=True),
        bad("differentiable", r"differentiable: differentiable=True .* is not supported", differentiable=True),
        ErrorInput(dict(lrr=1e-3), TypeError, rf"^lrr: {cls.__name__} got an unexpected keyword argument; did you "
                   r"mean 'lr'\?", "misspelt keyword"),
        ErrorInput(dict(optim_bits=8), TypeError, rf"^optim_bits: {cls.__name__} takes no such keyword; "
                   r"bitsandbytes' optim_bits=8 is state_dtype=", "bitsandbytes keyword"),
    ]
    defaults = _defaults(cls)
    betas = defaults.get("betas")
    if isinstance(betas, tuple) and all(isinstance(b, float) for b in betas):
        n, beta = len(betas), r"expected a number in \[0, 1\), got "
        out += [bad("first beta 1.5", r"betas\[0\]: " + beta + r"1\.5", betas=(1.5, *betas[1:])),
                bad("last beta 1", rf"betas\[{n - 1}\]: " + beta + r"1\.0", betas=(*betas[:-1], 1.0)),
                bad("bool first beta", r"betas\[0\]: " + beta + "True", betas=(True, *betas[1:])),
                bad("bool last beta", rf"betas\[{n - 1}\]: " + beta + "False", betas=(*betas[:-1], False)),
                bad(f"{n - 1} betas", rf"betas: expected a tuple of {n} numbers in \[0, 1\)", betas=betas[:-1])]
    for name in ("eps", "weight_decay"):
        if isinstance(defaults.get(name), (int, float)) and not isinstance(defaults[name], bool):
            out += [bad(f"negative {name}", rf"{name}: {number}-1\.0", **{name: -1.0}),
                    bad(f"nan {name}", rf"{name}: {number}nan", **{name: math.nan}),
                    bad(f"bool {name}", rf"{name}: {number}False", **{name: False})]
    out += [bad(f"int {name}", rf"{name}: {flag}1", **{name: 1})
            for name, default in defaults.items() if isinstance(default, bool)]
    return tuple(out + _unsigned_code_error(cls, defaults))


def entry(cls: type[LowpOptimizer]) -> Entry:
    """``cls``'s entry: its ``examples`` described, :func:`common_error_inputs` then its class's
    ``error_inputs``, its ``skips`` (any subclass of :class:`~lowp.optim.base.LowpOptimizer`,
    listed by :func:`optimizers` or not)."""
    own: tuple[ErrorInput, ...] = getattr(cls, "error_inputs", ())
    skips: tuple[Skip, ...] = getattr(cls, "skips", ())
    return Entry(cls, tuple(_described(e) for e in cls.examples), (*common_error_inputs(cls), *own), tuple(skips))


def entries() -> tuple[Entry, ...]:
    """The entry of every optimizer of :func:`optimizers`, in its order."""
    return tuple(entry(cls) for cls in optimizers())
