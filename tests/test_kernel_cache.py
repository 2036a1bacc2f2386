"""The native kernel cache (lowp/optim/kernels/native_build.py) loads only what lowp built for
this user: a private folder, trusted files, a SHA-256 sidecar checked before every load, rebuilds
instead of crashes, a private temporary folder when the cache is not usable, one build per
variant when processes race, no temporary files left by interrupted builds, and a precompiled
prelude of system headers that is verified before use and never changes a library.

Compiling a variant costs about a second of CPU and a fresh interpreter several, so most cases
build the small non-finite check (``finite.cpp``) in this process, copying a build made once for
the file where they need a valid cache entry; the cases that crashed a process before (a
truncated library: SIGBUS) or need other processes (an unprivileged user, a race) run in
subprocesses whose exit status is checked."""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lowp.optim.kernels import native_build
from lowp.optim.kernels.native_build import library_path
from cache_child import cache_warnings, finite_check, sgd_step

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not native_build.native_available(),
                                reason="the native kernel needs x86-64 with AVX2 and a C++ compiler")


def child(work: str, cache: Path, read_only: bool = False) -> subprocess.CompletedProcess:
    """The function ``work`` of cache_child.py in a fresh interpreter with
    ``LOWP_CACHE_DIR=cache``; it prints the number of kernel-cache warnings. ``read_only``: as
    root, without the capabilities that let root ignore permission bits."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import cache_child as c; "
            f"print('WARNINGS', c.cache_warnings(c.{work}))")
    command = [sys.executable, "-c", code]
    if read_only and os.geteuid() == 0:
        command = [*NO_OVERRIDE, *command]
    env = dict(os.environ, LOWP_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=str(ROOT))


#: root writes into read-only folders through CAP_DAC_OVERRIDE: run without it (util-linux's setpriv)
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def in_process(monkeypatch, cache: Path) -> None:
    """Point this process at ``cache`` with an empty table of loaded libraries and no private
    temporary folder yet (so a fallback warns again)."""
    monkeypatch.setenv("LOWP_CACHE_DIR", str(cache))
    monkeypatch.setattr(native_build, "_LOADED", {})
    monkeypatch.setattr(native_build, "_FALLBACK", [])
    monkeypatch.setattr(native_build, "_PRELUDES", {})


def in_cache(cache: Path, name: str) -> Path:
    """Where ``cache`` keeps the hand-written library ``name`` (the file name is the same in every cache)."""
    return cache / "kernels" / library_path(name).name


def sidecar(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def entries(cache: Path) -> list[Path]:
    """The libraries and sidecars under ``cache`` (lock files and the prelude aside)."""
    return sorted(p for p in (cache / "kernels").iterdir()
                  if not p.name.endswith(".lock") and not p.name.startswith("prelude-"))


def prelude(cache: Path) -> Path:
    """The precompiled prelude header under ``cache`` (the only one)."""
    [pch] = (cache / "kernels").glob("prelude-*.h.gch")
    return pch


def verified(library: Path) -> bool:
    return sidecar(library).read_text().strip() == hashlib.sha256(library.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache holding what ``sgd_step`` needs in a new process (the non-finite check, which is
    also the availability probe, and the SGD variant), built once for this file."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        in_process(mp, cache)
        sgd_step()
    return cache


def copy_cache(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, copy_function=shutil.copy2)
    return target


def test_cache_is_private_and_every_library_has_its_digest(built):
    assert stat.S_IMODE(built.stat().st_mode) == 0o700
    assert stat.S_IMODE((built / "kernels").stat().st_mode) == 0o700
    libraries = [p for p in entries(built) if p.suffix == ".so"]
    assert len(libraries) == 2 and len(entries(built)) == 4
    for library in libraries:
        assert verified(library)
        assert not library.stat().st_mode & 0o022 and not sidecar(library).stat().st_mode & 0o022
    assert not [p for p in (built / "kernels").iterdir() if p.name.endswith(".tmp")]


def test_cached_libraries_load_without_rebuilding(built, tmp_path, monkeypatch):
    cache = copy_cache(built, tmp_path / "cache")
    in_process(monkeypatch, cache)
    stamps = {p: p.stat().st_mtime_ns for p in entries(cache)}
    assert cache_warnings(sgd_step) == 0
    assert {p: p.stat().st_mtime_ns for p in entries(cache)} == stamps


FOREIGN = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
  FILE *f = fopen(getenv("LOWP_TEST_MARKER"), "w");
  if (f) { fputs("executed", f); fclose(f); }
}
extern "C" void lowp_finite(void) {}
"""


@pytest.mark.parametrize("case", ["no sidecar", "wrong digest", "right digest but group-writable"])
def test_a_foreign_library_under_the_expected_name_is_never_loaded(tmp_path, monkeypatch, case):
    """A library whose constructor writes a marker file sits where the non-finite check is
    expected: lowp rebuilds the check and never loads it (the marker stays absent)."""
    cache = tmp_path / "cache"
    in_process(monkeypatch, cache)
    target = in_cache(cache, "finite")
    target.parent.mkdir(parents=True, mode=0o700)
    source = tmp_path / "foreign.cpp"
    source.write_text(FOREIGN)
    subprocess.run(["g++", "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
    marker = tmp_path / "marker"
    monkeypatch.setenv("LOWP_TEST_MARKER", str(marker))
    if case == "wrong digest":
        sidecar(target).write_text("0" * 64 + "\n")
    if case == "right digest but group-writable":
        sidecar(target).write_text(hashlib.sha256(target.read_bytes()).hexdigest() + "\n")
        os.chmod(target, 0o770)
    foreign = target.read_bytes()
    assert cache_warnings(finite_check) == 0
    assert not marker.exists()
    assert target.read_bytes() != foreign and verified(target)
    assert not target.stat().st_mode & 0o022


def test_a_truncated_library_is_rebuilt_in_a_new_process(built, tmp_path):
    """A truncated shared object killed every later process with SIGBUS when it was loaded;
    now the next process rebuilds it and runs the check (exit status 0)."""
    cache = copy_cache(built, tmp_path / "cache")
    target = in_cache(cache, "finite")
    target.write_bytes(target.read_bytes()[:8192])
    result = child("finite_check", cache)
    assert result.returncode == 0, result.stderr
    assert "WARNINGS 0" in result.stdout and verified(target)


@pytest.mark.parametrize("damage", ["garbage", "one byte changed"])
def test_a_damaged_library_is_rebuilt(built, tmp_path, monkeypatch, damage):
    """A garbage library disabled the native backend for good; a changed byte would have been
    loaded. Both are rebuilt."""
    cache = copy_cache(built, tmp_path / "cache")
    in_process(monkeypatch, cache)
    target = in_cache(cache, "finite")
    data = target.read_bytes()
    target.write_bytes(os.urandom(len(data)) if damage == "garbage" else data[:-1] + bytes([data[-1] ^ 1]))
    assert cache_warnings(finite_check) == 0
    assert verified(target) and target.read_bytes() != data[:-1] + bytes([data[-1] ^ 1])


def test_a_cache_that_cannot_be_created_builds_in_a_temporary_folder(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    in_process(monkeypatch, blocker / "cache")
    assert cache_warnings(finite_check) == 1
    assert cache_warnings(sgd_step) == 0  # one warning per process


def test_a_cache_open_to_others_is_neither_read_nor_written(built, tmp_path, monkeypatch):
    """Its libraries could be anyone's: the check builds in a private temporary folder instead."""
    cache = copy_cache(built, tmp_path / "cache")
    os.unlink(in_cache(cache, "finite"))
    os.chmod(cache, 0o777)
    before = {p: p.read_bytes() for p in entries(cache)}
    in_process(monkeypatch, cache)
    assert cache_warnings(finite_check) == 1
    assert {p: p.read_bytes() for p in entries(cache)} == before


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None,
                    reason="as root, a read-only folder needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
def test_a_read_only_cache_still_steps(built, tmp_path):
    """The cache holds the non-finite check (the availability probe) but not the SGD variant, and
    its folders are read-only: a new process loads the one and builds the other in a private
    temporary folder, with one warning."""
    cache = copy_cache(built, tmp_path / "cache")
    for p in entries(cache):
        if p.name.startswith("step-"):
            p.unlink()
    for folder in (cache / "kernels", cache):
        os.chmod(folder, 0o500)
    try:
        result = child("sgd_step", cache, read_only=True)
        assert result.returncode == 0, result.stderr
        assert "WARNINGS 1" in result.stdout, result.stdout
        assert len(entries(cache)) == 2  # nothing added
    finally:
        for folder in (cache / "kernels", cache):
            os.chmod(folder, 0o700)


def test_concurrent_builds_of_one_variant_and_stale_temporary_files(tmp_path):
    """Two processes build the same variant into an empty cache at once: both run it, one
    library stays, and the temporary file of a build whose process is gone is deleted (one of a
    live process is kept)."""
    cache = tmp_path / "cache"
    kernels = cache / "kernels"
    kernels.mkdir(parents=True, mode=0o700)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    dead = kernels / f".finite-x.so~{host}~{int(gone.stdout)}~0000.tmp"
    alive = kernels / f".finite-x.so~{host}~{os.getpid()}~0000.tmp"
    dead.write_bytes(b"half a library")
    alive.write_bytes(b"a build in progress")
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import cache_child as c; "
            f"c.finite_check(); print('ok')")
    env = dict(os.environ, LOWP_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=str(ROOT)) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["ok", "ok"]
    libraries = [p for p in entries(cache) if p.suffix == ".so"]
    assert len(libraries) == 1 and verified(libraries[0])
    assert sorted(p.name for p in kernels.iterdir() if p.name.endswith(".tmp")) == [alive.name]


GCC = "Free Software Foundation" in subprocess.run([native_build._compiler() or "g++", "--version"],
                                                  capture_output=True, text=True).stdout


def record_compiles(monkeypatch, folder: Path) -> list[list[str]]:
    """Wrap the compiler runs of this process: each one's arguments, whose last is the input; a
    generated input (a temporary file, which the build deletes) is copied into ``folder`` and
    named by the copy."""
    calls: list[list[str]] = []
    original = native_build._compile_into

    def recording(target, name, arguments):
        kept = list(arguments)
        if kept[-1].endswith(".tmp"):
            kept[-1] = str(folder / f"input{len(calls)}.cpp")
            shutil.copy(arguments[-1], kept[-1])
        calls.append(kept)
        return original(target, name, arguments)

    monkeypatch.setattr(native_build, "_compile_into", recording)
    return calls


@pytest.mark.skipif(not GCC, reason="the prelude is precompiled for GCC only (other compilers parse the headers)")
def test_variants_read_the_system_headers_from_the_verified_precompiled_prelude(built, tmp_path, monkeypatch):
    """The cache keeps the prelude and its precompiled form (private, with a matching sidecar);
    a variant's build includes it, GCC takes the precompiled form (``-H`` marks it with ``!``),
    and the library is byte for byte the one built without it (from the same input file: its
    name is in the library)."""
    pch = prelude(built)
    assert verified(pch) and not pch.stat().st_mode & 0o077 and not sidecar(pch).stat().st_mode & 0o077
    cache = copy_cache(built, tmp_path / "cache")
    for p in entries(cache):
        if p.name.startswith("step-"):
            p.unlink()
    in_process(monkeypatch, cache)
    calls = record_compiles(monkeypatch, tmp_path)
    assert cache_warnings(sgd_step) == 0
    [arguments] = calls  # the SGD variant, and nothing else (the prelude was there)
    header = arguments[arguments.index("-include") + 1]
    assert Path(header + ".gch") == prelude(cache)
    compiler = native_build._compiler()
    used = subprocess.run([compiler, "-H", *arguments, "-o", str(tmp_path / "with.so")], capture_output=True,
                          text=True)
    assert used.returncode == 0 and f"! {header}.gch" in used.stderr.splitlines(), used.stderr[:2000]
    plain = [a for k, a in enumerate(arguments) if a != "-include" and (k == 0 or arguments[k - 1] != "-include")]
    subprocess.run([compiler, *plain, "-o", str(tmp_path / "without.so")], check=True)
    assert (tmp_path / "with.so").read_bytes() == (tmp_path / "without.so").read_bytes()


@pytest.mark.skipif(not GCC, reason="the prelude is precompiled for GCC only (other compilers parse the headers)")
@pytest.mark.parametrize("damage", ["one byte changed", "truncated, with a matching digest"])
def test_a_damaged_prelude_is_never_used(built, tmp_path, monkeypatch, damage):
    """A precompiled prelude whose digest does not match is rebuilt before a variant reads it; one
    that matches its digest but does not load (truncated: GCC stops with a fatal error) is
    deleted and the variant built without it. Either way the step is right."""
    cache = copy_cache(built, tmp_path / "cache")
    for p in entries(cache):
        if p.name.startswith("step-"):
            p.unlink()
    pch = prelude(cache)
    data = pch.read_bytes()
    damaged = data[:-1] + bytes([data[-1] ^ 1]) if damage == "one byte changed" else data[:len(data) // 2]
    pch.write_bytes(damaged)
    if damage != "one byte changed":
        sidecar(pch).write_text(hashlib.sha256(damaged).hexdigest() + "\n")
    in_process(monkeypatch, cache)
    calls = record_compiles(monkeypatch, tmp_path)
    assert cache_warnings(sgd_step) == 0
    [library] = [p for p in entries(cache) if p.name.startswith("step-") and p.suffix == ".so"]
    assert verified(library)
    if damage == "one byte changed":  # rebuilt, then used
        assert [c[-1].endswith(".h") for c in calls] == [True, False] and "-include" in calls[1]
        assert verified(pch) and pch.read_bytes() != damaged
    else:  # tried, deleted, built without
        assert ["-include" in c for c in calls] == [True, False]
        assert not pch.exists() and not sidecar(pch).exists()


@pytest.mark.skipif(not GCC, reason="the prelude is precompiled for GCC only (other compilers parse the headers)")
def test_a_variant_that_does_not_compile_keeps_the_prelude(built, tmp_path, monkeypatch):
    """A source that fails with and without the prelude raises the compiler's error, and the
    prelude (not at fault) stays."""
    cache = copy_cache(built, tmp_path / "cache")
    pch = prelude(cache)
    in_process(monkeypatch, cache)
    with pytest.raises(RuntimeError, match="compiling step failed"):
        native_build._library("step", "#error not a kernel\n")
    assert verified(pch)
