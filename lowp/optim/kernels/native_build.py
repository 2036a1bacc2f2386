"""Building and loading the hand-written CPU kernels (``native/*.cpp``) for ``backend="native"``:
``step.cpp`` (the fused optimizer step) and ``finite.cpp`` (the non-finite gradient check).

Nothing is compiled when lowp is installed: the first step of a variant (optimizer rule,
structural switches, write-back mode, dtypes, state rounding, diagnostics) compiles one shared
object with the system C++ compiler (about 1 s), stores it in a cache folder keyed by a hash of
the source, the compiler and the flags, and loads it with :mod:`ctypes`; later processes load it
from the cache. The kernel needs an x86-64 CPU with AVX2, FMA and F16C (every x86 server CPU
since 2013-2015) and ``g++``/``c++``/``clang++`` on PATH; :func:`native_available` says whether
both hold, and the backends fall back to ``torch.compile`` or the reference pipeline otherwise.

The cache folder is ``$LOWP_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/lowp`` or ``~/.cache/lowp``.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["native_available", "step_function", "finite_function", "cache_dir", "DTYPE_CODES", "FLAGS"]

SOURCES = Path(__file__).with_name("native")
#: Compiler flags. ``-ffp-contract=off``: only the explicit fmas of the source are fused (the
#: reference rounds every other product); ``-fno-math-errno``: ``sqrt`` is the hardware instruction.
#: ``-fopenmp``: the kernels run on torch's OpenMP pool (libgomp.so.1, which torch has loaded by then).
FLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
#: dtype codes of the source's ``enum Dtype``.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int16: 3}
_NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    if os.environ.get("LOWP_CACHE_DIR"):
        return Path(os.environ["LOWP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowp"


@functools.lru_cache(maxsize=None)
def _compiler() -> str | None:
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


@functools.lru_cache(maxsize=None)
def _cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return all(flag in flags for flag in _NEEDED_CPU_FLAGS)


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """True when the native kernel can be built and run here: x86-64 with AVX2/FMA/F16C (read
    from ``/proc/cpuinfo``, so Linux), a C++ compiler on PATH, and a test variant compiles."""
    if not (_cpu_supported() and _compiler()):
        return False
    try:
        step_function({})
        finite_function()
    except (OSError, RuntimeError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout


def _build(source: Path, macros: dict[str, int], target: Path) -> None:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("backend='native': no C++ compiler (g++, c++ or clang++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    defines = [f"-DLOWP_{k}={int(v)}" for k, v in sorted(macros.items())]
    result = subprocess.run([compiler, *FLAGS, *defines, str(source), "-o", tmp], capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"backend='native': compiling {source.name} failed:\n{result.stderr[-2000:]}")
    os.replace(tmp, target)  # atomic: concurrent processes never load a half-written file


_LOADED: dict[tuple, ctypes.CDLL] = {}


def _library(name: str, macros: dict[str, int]) -> ctypes.CDLL:
    """``native/<name>.cpp`` built with ``-DLOWP_<KEY>=<value>`` for ``macros``: compiled on first
    use, then cached on disk and in the process."""
    key = (name, *sorted(macros.items()))
    if key not in _LOADED:
        source = SOURCES / f"{name}.cpp"
        compiler = _compiler() or ""
        digest = hashlib.sha256(repr((source.read_bytes(), FLAGS, key, _compiler_version(compiler))).encode())
        path = cache_dir() / "kernels" / f"{name}-{digest.hexdigest()[:24]}.so"
        if not path.exists():
            _build(source, macros, path)
        _LOADED[key] = ctypes.CDLL(str(path))
    return _LOADED[key]


def step_function(macros: dict[str, int]) -> "ctypes._CFuncPtr":
    """``lowp_step(tensors, pointer table, numel, offsets, h, keys, threads) -> stalled count`` of
    the variant ``macros`` (see :func:`lowp.optim.kernels.native_backend.variant_macros`)."""
    fn = _library("step", macros).lowp_step
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int]
    return fn


def finite_function() -> "ctypes._CFuncPtr":
    """``lowp_finite(tensors, pointers, numel, dtype codes, flags out, threads)``."""
    fn = _library("finite", {}).lowp_finite
    fn.restype = None
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return fn
