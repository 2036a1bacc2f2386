"""The linter and the type checker pass on the code base (configured in pyproject.toml).

CI runs only ``python -m pytest``, so this is where ``ruff`` (pycodestyle, pyflakes, bugbear and
pydocstyle rules) and ``mypy`` (``check_untyped_defs`` on ``lowp``) are enforced. mypy keeps its
incremental cache in ``.mypy_cache`` at the repository root, so later runs take a few seconds; a
session that runs the type check starts it as soon as the tests are collected, alongside them.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_ruff_finds_nothing():
    result = _run("ruff", "check", "--no-fix", "lowp", "tests", "benchmarks", "examples")
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}\n{result.stderr}"


def test_mypy_finds_nothing(mypy_run):
    """mypy, started in the background when the tests were collected (``tests/conftest.py``)."""
    result = mypy_run
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}\n{result.stderr}"
    assert "Success: no issues found" in result.stdout


def _documented_arguments(doc: str) -> set[str]:
    """Names listed in the ``Args:`` section of a Google-style docstring."""
    names, inside = set(), False
    for line in doc.splitlines():
        if line.strip() == "Args:":
            inside = True
        elif inside and line and not line.startswith(" "):
            break   # the next section or paragraph
        elif inside and line.startswith("    ") and not line.startswith("     "):
            names.add(line.strip().split(":")[0].split(" (")[0])
    return names


def test_public_classes_document_their_constructor_arguments():
    import importlib
    import inspect
    import pkgutil

    import lowp

    missing, seen = {}, set()
    for info in pkgutil.walk_packages(lowp.__path__, "lowp."):
        if info.name == "lowp.__main__":
            continue
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            cls = getattr(module, name)
            if not inspect.isclass(cls) or cls in seen:
                continue
            seen.add(cls)
            wanted = {p.name for p in inspect.signature(cls).parameters.values()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
            undocumented = wanted - _documented_arguments(inspect.getdoc(cls) or "")
            if undocumented:
                missing[f"{cls.__module__}.{cls.__qualname__}"] = sorted(undocumented)
    assert len(seen) > 20   # the walk found the public classes
    assert not missing, f"constructor arguments without an entry in the class docstring's Args section: {missing}"
