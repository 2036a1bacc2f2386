"""The build cache: a folder of compiled shared libraries, loaded only when no other user could
have put them there and only after their bytes match the SHA-256 recorded when they were built.
Its client is the native kernel (:mod:`lowp.optim.kernels.native.build` says what is compiled,
how a library is named and with which compiler); this module holds the folder, its checks, the
verified load and the locked, atomic build of a library from a compiler command.

The cache folder is ``$LOWP_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/lowp`` or ``~/.cache/lowp``;
its libraries are in ``<cache>/kernels``. Loading a library runs its code, so the cache is guarded
against other users of the machine:

- Path: before each load from the cache, every folder from ``/`` down to ``<cache>/kernels`` is
  checked, symbolic links resolved one component at a time (at most 40 links; a link must belong
  to root or this user, and the folder holding it is checked like the others): each must be a
  directory owned by root or by this user that group and others cannot write unless it has the
  sticky bit (like ``/tmp``). Missing folders are created, with mode 0700. The cache folder and
  ``kernels`` must moreover belong to this user and be closed to group and others. No other user
  can then rename, replace or add anything along that path, so what was checked stays so.
- Library: it is opened once (``O_NOFOLLOW``); through that descriptor it must be a regular file
  of this user that group and others cannot write, of at most 64 MiB; its bytes are read from the
  same descriptor and their SHA-256 must equal the one in the sidecar file ``<library>.sha256``
  (a file under the same rules, written atomically after the build); then it is loaded through
  that very descriptor (``dlopen("/proc/self/fd/N")``), so the code that runs is the code that was
  hashed, whatever happens to the path meanwhile. Anything else (a foreign file under the expected
  name, a truncated or corrupted library, a missing sidecar) is rebuilt, never loaded.
- Builds go through uniquely named temporary files and an atomic rename, one process per library
  at a time (an advisory ``fcntl`` lock; the others wait and load the result), and each build
  deletes the temporary files of builds whose process is gone.
- Fallback: when the cache cannot be used (a folder on its path fails the check, or it is
  read-only, foreign or open to others) the process builds into a private temporary folder
  (``tempfile.mkdtemp`` in ``tempfile.gettempdir()``, removed at exit) and warns once, naming the
  folder at fault. The temporary folder's path is checked the same way; when it fails too,
  :class:`OSError` is raised (the native kernel's ``native_available()`` is then False).

Not protected against: root and this same user (either may change the files or folders lowp
trusts, or this process), the compiler found on ``PATH``, the installed lowp sources, and the
system's dynamic loader and libraries. Linux only (``/proc/self/fd``), like the kernel itself.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import os
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["cache_dir", "kernels_dir", "load_library", "compile_into", "read_trusted", "verified_bytes", "sidecar",
           "temp_name", "write_atomically", "remove_stale", "locked"]

#: the largest library accepted from the cache (a native kernel variant is about 20 KB)
_MAX_LIBRARY = 64 << 20
#: a temporary file of a build older than this (seconds) is stale whatever its process
_STALE_AFTER_S = 24 * 3600
#: the most symbolic links followed while checking the path of a folder (Linux's own limit)
_MAX_LINKS = 40


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    if os.environ.get("LOWP_CACHE_DIR"):
        return Path(os.environ["LOWP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lowp"


def kernels_dir() -> Path:
    """The folder of the cache that holds the libraries: ``<cache>/kernels``."""
    return cache_dir() / "kernels"


def _trusted(st: os.stat_result, kind: int) -> bool:
    """Owned by this user, of file type ``kind``, and not writable by group or others."""
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _private_dir(path: Path) -> str | None:
    """``None`` when ``path`` is a directory this user owns that nobody else may write, else why
    not (its ancestors are :func:`_untrusted_path`'s business)."""
    try:
        st = path.stat()
    except OSError as e:
        return f"{path} cannot be read ({e.strerror or e})"
    if not _trusted(st, stat.S_IFDIR):
        return f"{path} is not a directory owned by this user and closed to group and others"
    return None


def _untrusted_folder(name: str, st: os.stat_result) -> str | None:
    """Why the folder ``name`` (``st``: its ``lstat``) cannot be on the path of the cache: not a
    directory, owned by neither root nor this user, or writable by group or others without the
    sticky bit; ``None`` when it can."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{name} is not a directory"
    if st.st_uid not in (0, os.geteuid()):
        return f"{name} belongs to uid {st.st_uid}, neither root nor this user"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"{name} is writable by group or others without the sticky bit "
                f"(mode {stat.S_IMODE(st.st_mode):04o})")
    return None


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part not in ("", ".")]


def _untrusted_path(path: Path, create: bool = True) -> str | None:
    """Why another user could change what ``path`` names, or ``None`` when no one but root and
    this user can: walked from ``/``, one component at a time, every folder must pass
    :func:`_untrusted_folder`; a symbolic link (at most :data:`_MAX_LINKS` in all) must belong to
    root or this user, and its target is walked the same way from the folder holding it (already
    checked) or from ``/``. ``..`` goes back to the parent of the folder reached so far.

    Args:
        path: the folder; relative to the working directory unless absolute.
        create: create a missing component (mode 0700; then checked like any other) instead of
            answering that it does not exist.
    """
    reason = _untrusted_folder("/", os.lstat("/"))
    if reason is not None:
        return reason
    text = os.fspath(path)
    if not text.startswith("/"):
        try:
            text = os.path.join(os.getcwd(), text)
        except OSError as e:
            return f"the working directory of the relative path {path} is gone ({e.strerror or e})"
    current = "/"
    pending = _components(text)[::-1]
    links = 0
    while pending:
        name = pending.pop()
        if name == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, name)
        try:
            try:
                st = os.lstat(candidate)
            except FileNotFoundError:
                if not create:
                    return f"{candidate} does not exist"
                with contextlib.suppress(FileExistsError):  # someone else's would fail the check below
                    os.mkdir(candidate, 0o700)
                st = os.lstat(candidate)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    return f"{path} goes through more than {_MAX_LINKS} symbolic links"
                if st.st_uid not in (0, os.geteuid()):
                    return f"{candidate} is a symbolic link of uid {st.st_uid}, neither root nor this user"
                target = os.readlink(candidate)
                if target.startswith("/"):
                    current = "/"
                pending.extend(_components(target)[::-1])
                continue
        except OSError as e:
            return f"{candidate} cannot be created or read ({e.strerror or e})"
        reason = _untrusted_folder(candidate, st)
        if reason is not None:
            return reason
        current = candidate
    return None


def _cache_problem(kernels: Path) -> str | None:
    """Why the cache folder ``kernels`` (``<cache>/kernels``) cannot be used, or ``None``: its path
    is trusted (:func:`_untrusted_path`, creating what is missing) and it and its parent are
    private to this user (:func:`_private_dir`)."""
    return _untrusted_path(kernels) or _private_dir(kernels.parent) or _private_dir(kernels)


_FALLBACK: list[Path] = []


def _fallback_dir(reason: str) -> Path:
    """This process's private build folder (``tempfile.mkdtemp`` in ``tempfile.gettempdir()``:
    mode 0700, removed at exit), announced by one warning per process that gives ``reason``.

    Raises:
        OSError: the temporary folder's path fails :func:`_untrusted_path` (or the folder cannot
            be made): no folder is left to build in.
    """
    if not _FALLBACK:
        base = tempfile.gettempdir()
        problem = _untrusted_path(Path(base), create=False)
        if problem is not None:
            raise OSError(f"lowp: the native kernel cache is not usable ({reason}) and neither is the temporary "
                          f"folder {base} ({problem}); set LOWP_CACHE_DIR or TMPDIR to a private folder")
        folder = Path(tempfile.mkdtemp(prefix="lowp-kernels-", dir=base))
        atexit.register(shutil.rmtree, str(folder), True)
        problem = _private_dir(folder)
        if problem is not None:
            raise OSError(f"lowp: the private temporary folder is not usable: {problem}")
        _FALLBACK.append(folder)
        warnings.warn(f"lowp: the native kernel cache is not usable: {reason}; this process builds its kernels "
                      f"in {folder} (set LOWP_CACHE_DIR to a private folder to keep them)",
                      RuntimeWarning, stacklevel=5)
    return _FALLBACK[0]


def _read_fd(fd: int, limit: int) -> bytes | None:
    """The bytes of the open file ``fd`` (from its start) when it is a regular file this user owns
    that nobody else may write, of at most ``limit`` bytes, else ``None``."""
    st = os.fstat(fd)
    if not _trusted(st, stat.S_IFREG) or st.st_size > limit:
        return None
    chunks, offset = [], 0
    while offset <= limit:
        chunk = os.pread(fd, min(1 << 20, limit + 1 - offset), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks) if offset <= limit else None


def read_trusted(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` when it is a regular file this user owns that nobody else may write
    (at most ``limit`` bytes; symbolic links are not followed), else ``None``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _read_fd(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def sidecar(path: Path) -> Path:
    """The file that holds the SHA-256 of ``path``: ``<path>.sha256``."""
    return path.with_name(path.name + ".sha256")


def _matches_sidecar(path: Path, data: bytes) -> bool:
    """The sidecar of ``path`` is a trusted file (:func:`read_trusted`) holding the SHA-256 of ``data``."""
    recorded = read_trusted(sidecar(path), 256)
    return recorded is not None and recorded.decode("ascii", "replace").strip() == hashlib.sha256(data).hexdigest()


def verified_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` when it and its SHA-256 sidecar are trusted files
    (:func:`read_trusted`, at most ``limit`` bytes) and the digest matches, else ``None``."""
    data = read_trusted(path, limit)
    return data if data is not None and _matches_sidecar(path, data) else None


#: the descriptor numbers this process has loaded a library through (``/proc/self/fd/<number>``)
_LOAD_NUMBERS: set[int] = set()


def _dlopen_fd(fd: int) -> ctypes.CDLL:
    """Load the library open as ``fd`` through ``/proc/self/fd/<number>``, under a number no
    earlier library of this process was loaded under: glibc answers a ``dlopen`` of a name it has
    loaded before with that earlier library, and a closed descriptor's number is soon reused.

    Raises:
        OSError: the library does not load, or no fresh descriptor number is left.
    """
    import fcntl  # POSIX only, like the kernel itself (lowp imports this module everywhere)

    number, duplicate = fd, None
    if fd in _LOAD_NUMBERS:
        number = duplicate = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, max(_LOAD_NUMBERS) + 1)
    _LOAD_NUMBERS.add(number)
    try:
        return ctypes.CDLL(f"/proc/self/fd/{number}")
    finally:
        if duplicate is not None:
            os.close(duplicate)


def _load_verified(path: Path) -> ctypes.CDLL | None:
    """Load the library at ``path`` when it is verified, through one descriptor: opened without
    following a link, checked (:func:`_read_fd`), its bytes read from it and compared with the
    sidecar's digest, and then loaded through it (:func:`_dlopen_fd`), so what runs is what was
    hashed even if the file at ``path`` is replaced meanwhile; the descriptor stays open until
    ``dlopen`` returns. ``None`` otherwise (missing, foreign, truncated or corrupted: the caller
    rebuilds it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = _read_fd(fd, _MAX_LIBRARY)
        if data is None or not _matches_sidecar(path, data):
            return None
        return _dlopen_fd(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def temp_name(target: Path) -> Path:
    """A fresh name next to ``target`` that says which build made it: ``.<target>~<host>~<pid>~<random>.tmp``."""
    return target.with_name(f".{target.name}~{socket.gethostname()}~{os.getpid()}~{secrets.token_hex(4)}.tmp")


def _stale(entry: os.DirEntry) -> bool:
    """A temporary file of a build that is over: its process (on this host) is gone, or it is a day old."""
    parts = entry.name[1:-len(".tmp")].split("~")
    if not (entry.name.startswith(".") and entry.name.endswith(".tmp") and len(parts) == 4):
        return False
    try:
        if time.time() - entry.stat(follow_symlinks=False).st_mtime > _STALE_AFTER_S:
            return True
        if parts[1] != socket.gethostname():
            return False
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False
    return False


def remove_stale(folder: Path) -> None:
    """Delete the temporary files that interrupted builds left in ``folder``."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if _stale(entry):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def write_atomically(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` through a unique temporary file (mode 0600) and a rename:
    a reader sees the old file or the new one, never a partial file."""
    tmp = temp_name(target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def compile_into(target: Path, command: list[str], what: str) -> None:
    """Run ``command`` (a compiler and its arguments) with ``-o`` a unique temporary file, then
    rename that to ``target`` and write its SHA-256 sidecar (atomically): a reader sees the old
    pair, the new pair or a mismatch, which makes it rebuild, never a partial file.

    Raises:
        RuntimeError: the command fails (``what`` failed, with the end of its error output).
    """
    tmp = temp_name(target)
    # created here first: an OSError (read-only cache) before the compiler runs
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    try:
        result = subprocess.run([*command, "-o", str(tmp)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{result.stderr[-2000:]}")
        os.chmod(tmp, 0o700)  # the linker creates it with the umask's permissions
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    write_atomically(sidecar(target), f"{digest}\n".encode())


@contextlib.contextmanager
def locked(folder: Path, filename: str) -> Iterator[None]:
    """Hold the advisory lock of ``folder/filename`` (a lock file beside it): one build of a file
    per folder at a time; the others wait."""
    import fcntl  # POSIX only, like the kernel itself (lowp imports this module everywhere)

    fd = os.open(folder / f"{filename}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build_in(folder: Path, filename: str, build: Callable[[Path], None]) -> ctypes.CDLL:
    """The library ``folder/filename``: built by ``build(path)`` unless a valid one appeared
    meanwhile. One build per library and folder at a time (:func:`locked`); concurrent processes
    wait and load the finished library."""
    target = folder / filename
    with locked(folder, filename):
        library = _load_verified(target)
        if library is None:
            remove_stale(folder)
            build(target)
            library = _load_verified(target)
        if library is None:
            raise OSError(f"the library just built at {target} does not load")
        return library


def load_library(path: Path, build: Callable[[Path], None]) -> ctypes.CDLL:
    """The library at ``path`` (in :func:`kernels_dir`): loaded from the cache when its path and
    folders pass the checks (:func:`_cache_problem`) and a verified copy is there
    (:func:`_load_verified`), else built into it by ``build(target)`` (which writes the library
    and its sidecar at ``target``: :func:`compile_into`), or into this process's private folder
    when the cache is not usable.

    Raises:
        OSError: neither the cache nor the temporary folder is usable (:func:`_fallback_dir`), or
            the library just built does not load.
    """
    folder, filename = path.parent, path.name
    problem = _cache_problem(folder)
    library = None if problem else _load_verified(folder / filename)
    if library is None and problem is None:
        try:
            library = _build_in(folder, filename, build)
        except OSError as e:  # e.g. a read-only cache
            problem = f"building in {folder} failed ({e.strerror or e})"
    if library is None:
        library = _build_in(_fallback_dir(problem or ""), filename, build)
    return library
