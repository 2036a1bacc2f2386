"""Every lowp optimizer, found from its class (as torch's ``optim_db`` lists torch.optim's).

An optimizer joins by being imported in ``lowp/optim/__init__.py`` (one line): :func:`optimizers`
lists every :class:`~lowp.optim.base.LowpOptimizer` subclass that a module of ``lowp.optim`` defines
and exports, and the package exports every name of those modules' ``__all__``. The generic tests
(``tests/test_registry.py``) run every optimizer from this list through every write-back mode,
backend and dtype, with the keyword sets of its class attribute ``examples``.
"""
from __future__ import annotations

import sys

from lowp.optim.base import LowpOptimizer

__all__ = ["optimizers", "exported_names"]


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
