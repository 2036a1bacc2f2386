"""Building and loading the CPU kernels for ``backend="native"``: the fused optimizer step (a
translation unit generated per variant by :mod:`~lowp.optim.kernels.native.source` around
``simd.h``, ``vector.h`` and ``step.h``, plus ``codes.h`` and ``coded_step.h`` for block-scaled
states), ``finite.cpp`` (the non-finite gradient check), ``codes.cpp`` (the codec of
block-scaled states, :mod:`~lowp.optim.kernels.native.codec`) and ``rebuild.cpp`` (sharded
tensors' sums from their pieces, :mod:`~lowp.optim.kernels.native.rebuild`), all in this module's
folder.

Nothing is compiled when lowp is installed: the first step of a variant (optimizer rule and
switches, write-back mode, dtypes, state rounding, diagnostics) compiles one shared object with
the system C++ compiler (about 0.6 s; 1.8 s without the prelude below), stores it in the build
cache (:mod:`lowp.build_cache`: its folder, the checks before a load, the fallback) under a name
hashing the generated source, the hand-written sources, the compiler and the flags, and loads it
with :mod:`ctypes`; later processes load it from the cache. With GCC the system headers every
variant includes (``prelude.h``, mostly ``<immintrin.h>``) are precompiled once per compiler and
flags into the same folder (about 2 s and 50 MB) and read back by each variant's build; the
library is the same, byte for byte. The kernel needs an x86-64 CPU with AVX2, FMA and F16C (every
x86 server CPU since 2013-2015) and ``g++``/``c++``/``clang++`` on PATH; :func:`native_available`
says whether both hold, and the backends fall back to ``torch.compile`` or the reference pipeline
otherwise.

Compiler inputs: the precompiled prelude (checked against its sidecar once per process), its
header and the generated source are passed to the compiler by path; the build cache's check of
its path is their only guard after that. A build that fails with the prelude deletes it and
compiles without.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

from lowp.build_cache import (compile_into, kernels_dir, load_library, locked, read_trusted, remove_stale, sidecar,
                              temp_name, verified_bytes, write_atomically)
from lowp.optim.encodings.code import HEADERS as CODE_HEADERS
from lowp.optim.writeback.mode import HEADERS as MODE_HEADERS

__all__ = ["native_available", "step_function", "coded_step_function", "sums_function", "piece_sums_function",
           "finite_function", "encode_function", "decode_function", "library_path", "FLAGS", "ISAS", "isa", "flags"]

#: the hand-written C++ sources: this module's folder
SOURCES = Path(__file__).parent
#: The write-back modes' and the encodings' C++ headers (:mod:`lowp.optim.writeback`,
#: :mod:`lowp.optim.encodings`), on the include path too.
HEADER_FOLDERS = (MODE_HEADERS, CODE_HEADERS)
#: Compiler flags. ``-ffp-contract=off``: only the explicit fmas of the source are fused (the
#: reference rounds every other product); ``-fno-math-errno``: ``sqrt`` is the hardware instruction.
#: ``-fopenmp``: the kernels run on torch's OpenMP pool (libgomp.so.1, which torch has loaded by then).
FLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
_NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")
#: The instruction sets a kernel is built for, best first: the compiler flags each adds to
#: :data:`FLAGS` and the CPU features (``/proc/cpuinfo``) it needs. Every build computes the same
#: bits (the tests compare them); AVX-512 gives the compiler 32 vector registers, masked and
#: three-input logic operations and 512-bit vectors (``simd.h``).
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512": (("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq"),
               ("avx512f", "avx512vl", "avx512bw", "avx512dq")),
    "avx2": ((), ()),
}


@functools.lru_cache(maxsize=None)
def _compiler() -> str | None:
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


@functools.lru_cache(maxsize=None)
def _cpu_features() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty off x86-64 or without it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def _cpu_supported() -> bool:
    return all(flag in _cpu_features() for flag in _NEEDED_CPU_FLAGS)


def isa() -> str:
    """The instruction set the kernels are built for: the best of :data:`ISAS` this CPU has, or
    the one the environment variable ``LOWP_NATIVE_ISA`` names (``avx2`` or ``avx512``; read at
    each build, so a test or a user can compare builds); ``ValueError`` for another name or one
    this CPU lacks."""
    forced = os.environ.get("LOWP_NATIVE_ISA")
    if forced:
        if forced not in ISAS:
            raise ValueError(f"LOWP_NATIVE_ISA: expected one of {', '.join(ISAS)}, got {forced!r}")
        if not all(flag in _cpu_features() for flag in ISAS[forced][1]):
            raise ValueError(f"LOWP_NATIVE_ISA: this CPU lacks {forced} (needs {', '.join(ISAS[forced][1])})")
        return forced
    return next(name for name, (_, needed) in ISAS.items() if all(flag in _cpu_features() for flag in needed))


def flags() -> tuple[str, ...]:
    """The compiler flags of a build for :func:`isa`."""
    return (*FLAGS, *ISAS[isa()][0])


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """True when the native kernel can be built and run here: x86-64 with AVX2/FMA/F16C (read
    from ``/proc/cpuinfo``, so Linux), a C++ compiler on PATH, and the gradient check compiles."""
    if not (_cpu_supported() and _compiler()):
        return False
    try:
        finite_function()
    except (OSError, RuntimeError):
        return False
    return True


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout


def _compile_into(target: Path, name: str, arguments: list[str]) -> None:
    """Compile with the C++ compiler and ``arguments`` into ``target`` and its SHA-256 sidecar
    (:func:`lowp.build_cache.compile_into`)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("backend='native': no C++ compiler (g++, c++ or clang++) on PATH")
    compile_into(target, [compiler, *arguments], f"backend='native': compiling {name}")


def _compile(source: str | None, name: str, target: Path) -> None:
    """Compile ``source`` (generated text; ``None``: ``native/<name>.cpp``) into ``target``
    (:func:`_compile_into`). A generated variant built in the cache reads the system headers from
    the precompiled prelude (:func:`_prelude`); should that build fail, the variant is built again
    without it, and the prelude is discarded when that succeeds."""
    text = None
    try:
        if source is None:
            input_file = SOURCES / f"{name}.cpp"
        else:
            text = input_file = temp_name(target.with_suffix(".cpp"))
            write_atomically(input_file, source.encode())
        arguments = [*flags(), f"-I{SOURCES}", *(f"-I{folder}" for folder in HEADER_FOLDERS), "-x", "c++",
                     str(input_file)]
        prelude = _prelude(target.parent) if source is not None and target.parent == kernels_dir() else None
        if prelude is not None:
            try:
                _compile_into(target, name, ["-include", str(prelude), *arguments])
                return
            except RuntimeError:
                pass
        _compile_into(target, name, arguments)
        if prelude is not None:  # the variant builds without the prelude but not with it
            _discard_prelude(prelude)
    finally:
        if text is not None:
            with contextlib.suppress(OSError):
                os.unlink(text)


# ---- the precompiled prelude ----------------------------------------------------------------------
#: the largest precompiled header accepted (GCC's for the prelude is about 50 MB)
_MAX_PRELUDE = 512 << 20
#: per prelude header of this process's cache: whether its precompiled form was verified (or built)
_PRELUDES: dict[Path, bool] = {}


def _prelude_path(folder: Path) -> Path:
    """Where ``folder`` keeps its copy of ``native/prelude.h``, named by a hash of the header, the
    flags and the compiler version (its precompiled form is the same path plus ``.gch``)."""
    text = repr(((SOURCES / "prelude.h").read_bytes(), flags(), _compiler_version(_compiler() or "")))
    return folder / f"prelude-{hashlib.sha256(text.encode()).hexdigest()[:24]}.h"


def _precompiled(header: Path) -> Path:
    return header.with_name(header.name + ".gch")


def _prelude_verified(header: Path) -> bool:
    """``header`` is a trusted file holding ``native/prelude.h``, and its precompiled form is
    verified (:func:`lowp.build_cache.verified_bytes`)."""
    return (read_trusted(header, 1 << 16) == (SOURCES / "prelude.h").read_bytes()
            and verified_bytes(_precompiled(header), _MAX_PRELUDE) is not None)


def _prelude(folder: Path) -> Path | None:
    """The header a variant built in ``folder`` includes first (``-include``): a copy of
    ``native/prelude.h`` beside its precompiled form (a ``.gch`` with a SHA-256 sidecar, verified
    once per process and built when missing or damaged). ``None`` when the compiler is not GCC or
    the header does not precompile: the variant then parses the headers itself. GCC reads a valid
    precompiled header in place of the text and the library is the same, byte for byte; parsing
    ``<immintrin.h>`` is about half of a variant's build (0.65 s of 1.8 s, docs/fused.md).

    The compiler reads the header and its precompiled form by path, after this check: only the
    check of the cache's path (which :func:`lowp.build_cache.load_library` runs before each
    build) keeps other users from replacing them in between."""
    compiler = _compiler()
    if compiler is None or "Free Software Foundation" not in _compiler_version(compiler):
        return None
    header = _prelude_path(folder)
    if header not in _PRELUDES:
        with locked(folder, header.name):
            usable = _prelude_verified(header)
            if not usable:
                remove_stale(folder)
                with contextlib.suppress(RuntimeError, OSError):
                    write_atomically(header, (SOURCES / "prelude.h").read_bytes())
                    _compile_into(_precompiled(header), "the prelude",
                                  [*flags(), "-x", "c++-header", str(header)])
                usable = _prelude_verified(header)
        _PRELUDES[header] = usable
    return header if _PRELUDES[header] else None


def _discard_prelude(header: Path) -> None:
    """Stop using ``header``'s precompiled form in this process and delete it (the next process
    builds it again)."""
    _PRELUDES[header] = False
    for path in (_precompiled(header), sidecar(_precompiled(header))):
        with contextlib.suppress(OSError):
            os.unlink(path)


_LOADED: dict[tuple[str, str | None, str], ctypes.CDLL] = {}


def _library(name: str, source: str | None = None) -> ctypes.CDLL:
    """The library of ``source`` (a generated translation unit; ``None``: ``<name>.cpp`` of this
    folder), loaded from the build cache or compiled into it (:func:`lowp.build_cache.load_library`),
    then kept for the process.

    Raises:
        OSError: neither the cache nor the temporary folder is usable, or the library just built
            does not load.
        RuntimeError: no compiler, or the source does not compile.
    """
    key = (name, source, isa())
    if key not in _LOADED:
        _LOADED[key] = load_library(library_path(name, source), functools.partial(_compile, source, name))
    return _LOADED[key]


@functools.lru_cache(maxsize=None)
def _hand_written() -> bytes:
    """Every hand-written source (a generated unit includes the headers), the modes' too."""
    files = [path for folder in (SOURCES, *HEADER_FOLDERS) for path in sorted(folder.iterdir())]
    return b"".join(p.name.encode() + p.read_bytes() for p in files if p.suffix in (".h", ".cpp"))


def library_path(name: str, source: str | None = None) -> Path:
    """Where the cache keeps the library of ``source`` (see :func:`_library`; its SHA-256 sidecar
    is the same path plus ``.sha256``): named by a hash of the sources, flags and compiler version."""
    compiler = _compiler() or ""
    text = repr((name, source, _hand_written(), flags(), _compiler_version(compiler)))
    return kernels_dir() / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.so"


#: The arguments of ``lowp_step`` (``native/step.h``): tensors, pointer table, numel, offsets, h,
#: tensor numbers, seed, step, parameter ids, check, finite flags out (then ``lowp_coded_step``'s
#: scales and grids), threads.
_STEP_ARGS: list[Any] = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int,
                         ctypes.c_void_p]


def step_function(source: str) -> Callable[..., Any]:
    """``lowp_step(tensors, pointer table, numel, offsets, h, tensor numbers, seed, step, parameter
    ids, check, finite flags out, threads) -> stalled count`` of the generated variant ``source``
    (:func:`~lowp.optim.kernels.native.source.variant_source`)."""
    fn = _library("step", source).lowp_step
    fn.restype = ctypes.c_int64
    fn.argtypes = [*_STEP_ARGS, ctypes.c_int]
    return fn


def coded_step_function(source: str) -> Callable[..., Any]:
    """``lowp_coded_step(...)``: ``lowp_step``'s arguments with the scales and grids before the
    thread count, of a variant with coded states (``native/coded_step.h``)."""
    fn = _library("step", source).lowp_coded_step
    fn.restype = ctypes.c_int64
    fn.argtypes = [*_STEP_ARGS, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return fn


def sums_function(source: str) -> Callable[..., Any]:
    """``lowp_sums(tensors, pointer table, numel, h, sums out, threads)`` of a variant with a
    per-tensor reduction."""
    fn = _library("step", source).lowp_sums
    fn.restype = None
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return fn


def piece_sums_function(source: str) -> Callable[..., Any]:
    """``lowp_piece_sums(runs, pointer table, numel, piece size, h, sums out, threads)`` of a
    variant with a per-tensor reduction: the sums of every piece of every run
    (:mod:`lowp.optim.ordered_sum`)."""
    fn = _library("step", source).lowp_piece_sums
    fn.restype = None
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int]
    return fn


def rebuild_function() -> Callable[..., Any]:
    """``lowp_rebuild(values, counts, index table, totals out) -> 0, k + 1, -1 or -3`` of
    ``native/rebuild.cpp`` (:mod:`lowp.optim.kernels.native.rebuild`)."""
    fn = _library("rebuild").lowp_rebuild
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def finite_function() -> Callable[..., Any]:
    """``lowp_finite(tensors, pointers, numel, dtype codes, flags out, threads)``."""
    fn = _library("finite").lowp_finite
    fn.restype = None
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    return fn


@functools.lru_cache(maxsize=None)
def encode_function(source: str) -> Callable[..., Any]:
    """``lowp_encode(tensors, pointer table, numel, first indices, keys, kind, scale dtype, block,
    grid, mode, threads) -> 0 or -1`` of ``native/codes.cpp`` in the codec's translation unit
    ``source`` (:func:`lowp.optim.kernels.native.source.codec_source`)."""
    fn = _library("codes", source).lowp_encode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return fn


@functools.lru_cache(maxsize=None)
def decode_function(source: str) -> Callable[..., Any]:
    """``lowp_decode(tensors, pointer table, numel, kind, scale dtype, block, threads) -> 0 or -1``
    of ``native/codes.cpp`` in the codec's translation unit ``source``."""
    fn = _library("codes", source).lowp_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                   ctypes.c_int]
    return fn
