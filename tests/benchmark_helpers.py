"""Helpers the benchmark tests share: a script of ``benchmarks/`` imported as a module."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as the module ``name`` (``benchmarks/`` is not a package)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
