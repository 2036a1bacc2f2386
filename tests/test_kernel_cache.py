"""The native kernel cache (lowp/build_cache.py, filled by lowp/optim/kernels/native/build.py)
loads only what lowp built for this user: a private folder, trusted files, a SHA-256 sidecar
checked before every load, rebuilds instead of crashes, a private temporary folder when the cache
is not usable, one build per variant when processes race, no temporary files left by interrupted
builds, and a precompiled prelude of system headers that is verified before use and never
changes a library.

The path of the cache is checked too: every folder from ``/`` down (symbolic links followed one
by one) must belong to root or this user and be closed to group and others unless sticky, or the
cache is not used; and a library is loaded through the very descriptor its bytes were hashed
from, so replacing the file after the check changes nothing (a foreign library swapped in at that
moment, and an attacker of another uid swapping folders against fresh loaders, never run).

Compiling a variant costs about a second of CPU and a fresh interpreter several, so most cases
build the small non-finite check (``finite.cpp``) in this process, copying a build made once for
the file where they need a valid cache entry; the cases that crashed a process before (a
truncated library: SIGBUS) or need other processes (an unprivileged user, a race) run in
subprocesses whose exit status is checked; those that only load the check, or a library, use
cache_loader.py."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lowp import build_cache
from lowp.optim.kernels.native import build as native_build
from lowp.optim.kernels.native.build import library_path
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
    monkeypatch.setattr(build_cache, "_FALLBACK", [])
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


# ---- the path of the cache, and loading through the verified descriptor ---------------------------
LOADER = ROOT / "tests" / "cache_loader.py"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a folder or process of another user needs root "
                                                         "(os.chown, or dropping privileges to uid 65534)")


def loader(mode: str, *arguments: object, **env: str) -> dict:
    """``cache_loader.py mode arguments`` in a fresh interpreter (``env`` added to this one's):
    its ``RESULT``."""
    result = subprocess.run([sys.executable, str(LOADER), mode, *map(str, arguments)], env=dict(os.environ, **env),
                            capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def folder(path: Path, mode: int) -> Path:
    path.mkdir(mode=0o700)
    os.chmod(path, mode)
    return path


def test_a_folder_open_to_all_on_the_path_is_refused_and_nothing_is_created_below_it(tmp_path):
    open_to_all = folder(tmp_path / "open", 0o777)
    reason = build_cache._untrusted_path(open_to_all / "cache" / "kernels")
    assert reason == f"{open_to_all} is writable by group or others without the sticky bit (mode 0777)"
    assert not (open_to_all / "cache").exists()
    assert build_cache._cache_problem(open_to_all / "cache" / "kernels") == reason
    group_writable = folder(tmp_path / "group", 0o770)
    assert str(group_writable) in build_cache._untrusted_path(group_writable / "cache")


def test_a_sticky_folder_open_to_all_is_accepted_and_missing_folders_are_made_private(tmp_path):
    sticky = folder(tmp_path / "sticky", 0o1777)
    kernels = sticky / "a" / "cache" / "kernels"
    assert build_cache._untrusted_path(kernels) is None
    assert build_cache._cache_problem(kernels) is None
    for made in (sticky / "a", sticky / "a" / "cache", kernels):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700 and made.stat().st_uid == os.geteuid()
    assert build_cache._untrusted_path(tmp_path / "missing", create=False) == f"{tmp_path / 'missing'} does not exist"
    assert not (tmp_path / "missing").exists()


@ROOT_ONLY
def test_a_folder_of_another_user_on_the_path_is_refused(tmp_path):
    theirs = folder(tmp_path / "theirs", 0o755)
    os.chown(theirs, 65534, 65534)
    reason = build_cache._untrusted_path(theirs / "cache")
    assert reason == f"{theirs} belongs to uid 65534, neither root nor this user"
    assert not (theirs / "cache").exists()


def test_a_symbolic_link_into_an_untrusted_folder_is_refused(tmp_path):
    """The link's target is walked from the folder holding the link, like the path itself: a link
    into a folder open to all is refused, naming that folder (also through ``..`` after the link,
    which the kernel resolves from the target); a link into a private folder is accepted, and so
    is a relative one; a loop of links ends with a reason."""
    open_to_all = folder(tmp_path / "open", 0o777)
    (open_to_all / "mine").mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(open_to_all / "mine")
    reason = f"{open_to_all} is writable by group or others without the sticky bit (mode 0777)"
    assert build_cache._untrusted_path(link / "cache") == reason
    assert build_cache._untrusted_path(link) == reason
    private = folder(tmp_path / "private", 0o700)
    (private / "sub").mkdir()
    (private / "sub" / "up").symlink_to("..")
    assert build_cache._untrusted_path(private / "sub" / "up" / "cache") is None and (private / "cache").is_dir()
    (private / "out").symlink_to("../link")
    assert build_cache._untrusted_path(private / "out" / "cache") == reason
    (private / "nested").symlink_to(private / "sub" / "up" / "sub")  # a link through a link, into private
    assert build_cache._untrusted_path(private / "nested" / "x") is None and (private / "sub" / "x").is_dir()
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    assert "more than 40 symbolic links" in build_cache._untrusted_path(tmp_path / "loop1" / "cache")


@ROOT_ONLY
def test_a_symbolic_link_of_another_user_in_a_sticky_folder_is_refused(tmp_path):
    """In a sticky folder its owner may replace the link at any time, whatever it points to."""
    sticky = folder(tmp_path / "sticky", 0o1777)
    (tmp_path / "private").mkdir(mode=0o700)
    link = sticky / "link"
    link.symlink_to(tmp_path / "private")
    os.lchown(link, 65534, 65534)
    assert build_cache._untrusted_path(link / "cache") == (f"{link} is a symbolic link of uid 65534, "
                                                            f"neither root nor this user")


def test_a_cache_below_a_folder_open_to_all_is_not_used_and_the_warning_names_the_folder(built, tmp_path,
                                                                                          monkeypatch):
    """The verified cache below it is neither read nor written: the check is built in the private
    temporary folder, with one warning naming the folder at fault."""
    open_to_all = folder(tmp_path / "open", 0o777)
    cache = copy_cache(built, open_to_all / "cache")
    before = {p: p.read_bytes() for p in entries(cache)}
    in_process(monkeypatch, cache)
    with pytest.warns(RuntimeWarning, match="kernel cache") as caught:
        finite_check()
    [message] = [str(w.message) for w in caught if "kernel cache" in str(w.message)]
    assert f"{open_to_all} is writable by group or others without the sticky bit" in message
    [private] = build_cache._FALLBACK
    assert any(private.glob("finite-*.so")) and {p: p.read_bytes() for p in entries(cache)} == before


def test_an_untrusted_temporary_folder_too_raises_and_native_is_not_available(tmp_path, monkeypatch):
    """With neither the cache nor the temporary folder usable there is nowhere to build:
    :func:`_fallback_dir` raises OSError naming both, and ``native_available()`` is False in a
    new process (no crash, no warning, nothing loaded)."""
    open_cache = folder(tmp_path / "open", 0o777)
    open_temporary = folder(tmp_path / "tmp", 0o777)
    monkeypatch.setattr(build_cache, "_FALLBACK", [])
    monkeypatch.setattr(tempfile, "tempdir", str(open_temporary))
    with pytest.raises(OSError, match=f"and neither is the temporary folder {open_temporary} "
                                      f"\\({open_temporary} is writable by group or others"):
        build_cache._fallback_dir(f"{open_cache} is open")
    assert not build_cache._FALLBACK and not list(open_temporary.iterdir())
    result = loader("available", LOWP_CACHE_DIR=str(open_cache / "cache"), TMPDIR=str(open_temporary))
    assert result == {"available": False, "warnings": []}
    assert not list(open_temporary.iterdir()) and not list(open_cache.iterdir())


FOREIGN_MARKED = FOREIGN + 'extern "C" int lowp_foreign(void) { return 1; }\n'


def foreign_library(tmp_path: Path) -> Path:
    """The test's foreign library: its constructor writes ``$LOWP_TEST_MARKER``; it exports
    ``lowp_finite`` (a no-op) and ``lowp_foreign``."""
    source = tmp_path / "foreign.cpp"
    source.write_text(FOREIGN_MARKED)
    subprocess.run(["g++", "-shared", "-fPIC", str(source), "-o", str(tmp_path / "foreign.so")], check=True)
    return tmp_path / "foreign.so"


def test_the_bytes_loaded_are_the_bytes_hashed(built, tmp_path):
    """Between the verification of the cached check and its ``dlopen``, a new process replaces
    the file at its path (and the sidecar) by a foreign library whose constructor writes a marker:
    the verified library is loaded (``lowp_finite`` without ``lowp_foreign``) and the marker never
    appears. Control: loading the path as it now is runs the foreign constructor."""
    cache = copy_cache(built, tmp_path / "cache")
    target = in_cache(cache, "finite")
    foreign = foreign_library(tmp_path)
    marker = tmp_path / "marker"
    result = loader("swap", target, foreign, LOWP_CACHE_DIR=str(cache), LOWP_TEST_MARKER=str(marker))
    assert result == {"finite": True, "foreign": False, "warnings": [], "swapped": [str(target)]}
    assert not marker.exists()
    assert target.read_bytes() == foreign.read_bytes() and verified(target)  # the swap took place
    control = subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(target)],
                             env=dict(os.environ, LOWP_TEST_MARKER=str(marker)), capture_output=True, text=True)
    assert control.returncode == 0 and marker.read_text() == "executed"


def test_libraries_loaded_through_a_reused_descriptor_number_are_each_itself(tmp_path):
    """glibc answers a ``dlopen`` of a name it loaded before with the earlier library, and the
    second load's descriptor gets the number the first one's freed: each library is still loaded
    under a name of its own (``which()`` answers 1, then 2)."""
    libraries = []
    for number in (1, 2):
        source = tmp_path / f"which{number}.cpp"
        source.write_text(f'extern "C" int which(void) {{ return {number}; }}\n')
        library = tmp_path / f"which{number}.so"
        subprocess.run(["g++", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
        os.chmod(library, 0o700)
        sidecar(library).write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")
        libraries.append(library)
    assert loader("pair", *libraries) == {"which": [1, 2]}


def race(built: Path, tmp_path: Path, loaders: int, waves: int) -> None:
    """An attacker (uid 65534) swaps, by renames inside a folder ``W`` open to all (mode 0777, not
    sticky), ``W/cache`` between a copy of the verified cache and a decoy holding the foreign
    library under the check's name (a private root-owned file with a sidecar of its digest: it
    passes every check of a file), while ``waves`` times ``loaders`` fresh processes load the
    check with ``LOWP_CACHE_DIR=W/cache``. The marker of the foreign constructor never appears;
    every loader refuses ``W`` (one warning naming it) and loads the genuine check."""
    marker = tmp_path / "marker"
    foreign = foreign_library(tmp_path)
    base = Path(tempfile.gettempdir())  # the attacker must be able to reach W: tmp_path is private to root
    if build_cache._untrusted_path(base, create=False) is not None or not base.stat().st_mode & 0o001:
        pytest.skip(f"the attacker (uid 65534) needs a trusted temporary folder it can enter; {base} is not")
    shared = Path(tempfile.mkdtemp(prefix="lowp-race-", dir=base))
    attacker = None
    try:
        os.chmod(shared, 0o777)
        genuine = in_cache(shared / "cache", "finite")  # the verified check and its sidecar, nothing else
        genuine.parent.mkdir(parents=True, mode=0o700)
        for source in (in_cache(built, "finite"), sidecar(in_cache(built, "finite"))):
            shutil.copy2(source, genuine.parent / source.name)
        decoy = shared / "decoy" / "kernels" / genuine.name
        decoy.parent.mkdir(parents=True, mode=0o700)
        shutil.copyfile(foreign, decoy)
        os.chmod(decoy, 0o700)
        sidecar(decoy).write_text(hashlib.sha256(decoy.read_bytes()).hexdigest() + "\n")
        attacker = subprocess.Popen([sys.executable, str(LOADER), "attack", str(shared)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
        assert attacker.stdout is not None
        assert attacker.stdout.readline().split() == ["READY", "65534", "65534"]
        env = dict(os.environ, LOWP_CACHE_DIR=str(shared / "cache"), LOWP_TEST_MARKER=str(marker))
        results = []
        for _ in range(waves):
            procs = [subprocess.Popen([sys.executable, str(LOADER), "load"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=str(ROOT)) for _ in range(loaders)]
            for proc in procs:
                out, err = proc.communicate(timeout=300)
                assert proc.returncode == 0, err[-3000:]
                [line] = [line for line in out.splitlines() if line.startswith("RESULT ")]
                results.append(json.loads(line[len("RESULT "):]))
        attacker.terminate()
        out, err = attacker.communicate(timeout=60)
        assert attacker.returncode == 0, err[-3000:]
        [line] = [line for line in out.splitlines() if line.startswith("RESULT ")]
        attack = json.loads(line[len("RESULT "):])
        assert attack["uid"] == 65534 and attack["swaps"] > 0, attack
        assert not marker.exists()
        refused = f"{shared} is writable by group or others without the sticky bit (mode 0777)"
        for result in results:
            assert result["finite"] and not result["foreign"], result
            [message] = result["warnings"]
            assert refused in message, message
        assert len(results) == loaders * waves
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        shutil.rmtree(shared, ignore_errors=True)


@ROOT_ONLY
def test_an_attacker_swapping_folders_never_gets_its_code_run(built, tmp_path):
    race(built, tmp_path, loaders=2, waves=1)


@ROOT_ONLY
@pytest.mark.slow
def test_an_attacker_swapping_folders_never_gets_its_code_run_long(built, tmp_path):
    race(built, tmp_path, loaders=4, waves=8)
