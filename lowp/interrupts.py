"""Holding Ctrl-C while something must finish whole.

Python runs a signal's handler between two bytecodes of the main thread (the ``signal`` module
documentation, "Execution of Python signal handlers"), so a ``KeyboardInterrupt`` can land
between any two writes of an optimizer step or of a report's files. Inside
:func:`deferred_interrupts` SIGINT is only recorded; when the block ends, whether it finished or
raised, the previous handler is restored and the signal is raised again, so the interrupt
arrives after the block, exactly once.
"""
from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C module: no enum wrapping (~10 us a block)
import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["deferred_interrupts"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT for the duration of the block and deliver it afterwards.

    Only the main thread can set signal handlers; elsewhere (and where the current handler was
    not set from Python, or ignores SIGINT) the block runs unguarded, since no ``KeyboardInterrupt``
    can be raised in it by this process's handler.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    current = _signal.getsignal(signal.SIGINT)
    if current is None or current == _signal.SIG_IGN:
        yield
        return
    caught: list[int] = []
    previous = _signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)
