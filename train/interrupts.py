"""Ctrl-C while training: raised where the loop can act on it, never lost.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs next, and when
that is a garbage-collection callback (JAX registers one) the interrupt is
reported as "exception ignored" and swallowed: the run trains on as if nothing
was pressed. During the training loop the first Ctrl-C is only noted, and the
loop raises it between device calls (then the newest state is checkpointed); a
second Ctrl-C raises at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

__all__ = ["interrupts_between_calls"]


@contextlib.contextmanager
def interrupts_between_calls() -> Iterator[Callable[[], None]]:
    """Within: Ctrl-C is noted; the function yielded raises ``KeyboardInterrupt`` once
    one was. A second Ctrl-C raises at once. Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    pressed = [0]
    previous = signal.getsignal(signal.SIGINT)

    def note(signum, frame):
        pressed[0] += 1
        if pressed[0] > 1:  # a second press: the user means now
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt

    def check() -> None:
        if pressed[0]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
