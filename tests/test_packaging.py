"""The installed package carries every file lowp needs at run time: non-Python files under lowp/
(the native kernels' C++ sources, compiled on first use) must be listed as package data, or a
``pip install`` copies the Python modules without them and the native backend silently falls
back (the tests, which import lowp from the source tree, would not notice)."""
from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")


def test_every_non_python_file_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"].get("package-data", {})
    data = [p for p in (ROOT / "lowp").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data, "expected the native kernel sources under lowp/"
    for path in data:
        rel = path.relative_to(ROOT)
        covered = any(
            rel.as_posix().startswith(package.replace(".", "/") + "/")
            and fnmatch.fnmatch(rel.relative_to(package.replace(".", "/")).as_posix(), pattern)
            for package, globs in patterns.items() for pattern in globs)
        assert covered, f"{rel} is not listed in [tool.setuptools.package-data]; pip install would drop it"
