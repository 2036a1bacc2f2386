"""Child processes of test_kernel_cache.py that load libraries straight through the build cache
(:mod:`lowp.build_cache`, with the native kernel's :mod:`lowp.optim.kernels.native.build`): no
optimizer step, and nothing loaded before the mode runs (importing lowp builds nothing).

``python cache_loader.py MODE ARGS...`` prints one line ``RESULT <json>``:

- ``load``: load the non-finite check (``$LOWP_CACHE_DIR``) and say what was loaded and which
  kernel-cache warnings were given.
- ``swap TARGET FOREIGN``: the same, but right after the library at ``TARGET`` is verified and
  before it is loaded, the file at ``TARGET`` is replaced by a copy of ``FOREIGN`` (with a sidecar
  of its digest).
- ``pair A B``: load two verified libraries one after the other and call their ``which()``.
- ``available``: ``native_available()``.
- ``attack FOLDER``: drop privileges to uid/gid 65534, then swap ``FOLDER/cache`` with
  ``FOLDER/decoy`` (renames) until SIGTERM; print the number of swaps.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from lowp import build_cache
from lowp.optim.kernels.native import build as native_build

NOBODY = 65534


def describe(library: ctypes.CDLL) -> dict[str, Any]:
    """Which symbols ``library`` exports: the genuine check has ``lowp_finite`` only, the test's
    foreign library also ``lowp_foreign``."""
    return {"finite": hasattr(library, "lowp_finite"), "foreign": hasattr(library, "lowp_foreign")}


def load_finite() -> dict[str, Any]:
    """Load the non-finite check; what was loaded and the kernel-cache warnings given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library = native_build._library("finite")
    return {**describe(library), "warnings": [str(w.message) for w in caught if "kernel cache" in str(w.message)]}


def swap(target: Path, foreign: Path) -> dict[str, Any]:
    """:func:`load_finite` with the file at ``target`` replaced between verification and ``dlopen``."""
    original = build_cache._dlopen_fd
    swapped: list[str] = []

    def replace_then_load(fd: int) -> ctypes.CDLL:
        data = foreign.read_bytes()
        digest = f"{hashlib.sha256(data).hexdigest()}\n".encode()
        for path, content in ((target, data), (Path(f"{target}.sha256"), digest)):
            spare = path.with_name(path.name + ".swap")
            spare.write_bytes(content)
            os.chmod(spare, 0o700)
            os.replace(spare, path)
        swapped.append(str(target))
        return original(fd)

    build_cache._dlopen_fd = replace_then_load
    return {**load_finite(), "swapped": swapped}


def pair(first: Path, second: Path) -> dict[str, Any]:
    """Load two verified libraries in turn (the second through the descriptor number the first
    one's closed descriptor freed); what each one's ``which()`` answers."""
    answers = []
    for path in (first, second):
        library = build_cache._load_verified(path)
        answers.append(None if library is None else library.which())
    return {"which": answers}


def attack(folder: Path) -> dict[str, Any]:
    """As uid/gid 65534, swap ``folder/cache`` (the real cache) with ``folder/decoy`` (a foreign
    one) by renames, as fast as possible, until SIGTERM (or two minutes)."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda number, frame: stop.append(number))
    cache, decoy, parked = folder / "cache", folder / "decoy", folder / "parked"
    print("READY", os.getuid(), os.getgid(), flush=True)
    swaps, deadline = 0, time.monotonic() + 120
    while not stop and time.monotonic() < deadline:
        try:
            os.rename(cache, parked)
            os.rename(decoy, cache)  # the foreign library is at the expected path now
            os.rename(cache, decoy)
            os.rename(parked, cache)
            swaps += 1
        except OSError:
            pass
    return {"swaps": swaps, "uid": os.getuid()}


def main(argv: list[str]) -> dict[str, Any]:
    mode = argv[1]
    if mode == "load":
        return load_finite()
    if mode == "swap":
        return swap(Path(argv[2]), Path(argv[3]))
    if mode == "pair":
        return pair(Path(argv[2]), Path(argv[3]))
    if mode == "available":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = native_build.native_available()
        return {"available": available, "warnings": [str(w.message) for w in caught]}
    if mode == "attack":
        return attack(Path(argv[2]))
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    print("RESULT", json.dumps(main(sys.argv)), flush=True)
