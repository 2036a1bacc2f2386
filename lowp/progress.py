"""Progress lines on stderr for commands that work for a while (``lowp memory``, ``lowp doctor --model``).

A :class:`Progress` prints a line when a stage starts (``lowp memory: building the model...``), counts
steps (``lowp memory: measuring lowp AdamW bf16 kahan, bf16 states (3/46)``) at most one line every
``every`` seconds, and, while one stage or step lasts longer than that (importing ``transformers``,
initializing a large model), a heartbeat thread repeats the current line with the seconds it has
taken (``lowp doctor: building LlamaForCausalLM... [6 s]``), so the command never goes silent for
more than ``every`` seconds. Plain lines, not a bar redrawn with carriage returns, so that logs and
captured output read as well as a terminal.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress of a long command, as lines on a stream (stderr by default).

    Use it as a context manager: the heartbeat thread runs inside the ``with`` block only.

    Args:
        prefix: put before every line, e.g. ``"lowp memory"``.
        enabled: ``False`` prints nothing (``--quiet``).
        stream: where the lines go; ``None`` (default) is ``sys.stderr`` at the time of writing.
        every: seconds, > 0: at most one step line per interval, and a heartbeat line after this
            long without any line (default 3). A non-positive value raises ``ValueError``.

    Example::

        with Progress("lowp memory") as progress:
            progress.stage("building the model")
            for i, item in enumerate(items, start=1):
                progress.step(i, len(items), f"measuring {item}")
    """

    def __init__(self, prefix: str, *, enabled: bool = True, stream: TextIO | None = None,
                 every: float = 3.0) -> None:
        if not every > 0:
            raise ValueError(f"every: expected a positive number of seconds, got {every!r}")
        self.prefix = prefix
        self.enabled = enabled
        self.stream = stream
        self.every = every
        self._status = ""
        self._since = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Progress":
        if self.enabled and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._heartbeat, name="lowp-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def stage(self, text: str) -> None:
        """Start a stage: print ``<prefix>: <text>...`` now."""
        with self._lock:
            self._status = f"{text}..."
            self._since = time.monotonic()
            self._write(self._status)

    def step(self, done: int, total: int, text: str) -> None:
        """Start step ``done`` of ``total`` (counted from 1): ``<prefix>: <text> (<done>/<total>)``,
        printed when it is the first or the last step or ``every`` seconds passed since the last line."""
        with self._lock:
            self._status = f"{text} ({done}/{total})"
            now = self._since = time.monotonic()
            if done <= 1 or done >= total or now - self._last >= self.every:
                self._write(self._status)

    def _write(self, line: str) -> None:
        """Print one line (the caller holds the lock)."""
        self._last = time.monotonic()
        if not self.enabled or not line:
            return
        stream = self.stream if self.stream is not None else sys.stderr
        try:
            print(f"{self.prefix}: {line}", file=stream, flush=True)
        except (OSError, ValueError):   # a closed or broken stream: progress is not worth failing for
            pass

    def _heartbeat(self) -> None:
        """After ``every`` seconds without a line, print the current one: with the seconds it has lasted
        when it started that long ago, as is when it is a step that started since."""
        while not self._stop.wait(self.every / 4):
            with self._lock:
                now = time.monotonic()
                if self._status and now - self._last >= self.every:
                    taken = now - self._since
                    self._write(self._status if taken < self.every else f"{self._status} [{taken:.0f} s]")
