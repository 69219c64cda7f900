"""Ctrl-C: raised where it can be acted on, never lost.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs next, and when that
is inside a garbage-collection callback (JAX registers one) the interrupt is
reported as "exception ignored" and swallowed: tracing, compiling or training
goes on as if nothing was pressed (1 press in 7 during training, on a loaded
machine). So:

- :func:`reliable_interrupts` (the CLI, around everything): a press that lands
  inside a gc callback is delivered again a moment later, outside it;
- :func:`interrupts_between_calls` (the training loop): the first press is only
  noted and the loop raises it between device calls, where the newest state can
  be checkpointed; a second press raises at once.
"""

from __future__ import annotations

import _thread
import contextlib
import gc
import signal
import threading
from types import FrameType
from typing import Callable, Iterator

__all__ = ["interrupts_between_calls", "reliable_interrupts"]


def _in_gc_callback(frame: FrameType | None) -> bool:
    codes = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _raise_outside_gc(frame: FrameType | None) -> None:
    """``KeyboardInterrupt`` now, or, inside a gc callback (which would swallow it), again soon."""
    if _in_gc_callback(frame):
        threading.Timer(0.05, _thread.interrupt_main).start()
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def reliable_interrupts() -> Iterator[None]:
    """Within: Ctrl-C raises ``KeyboardInterrupt`` as usual, but never inside a gc callback.
    Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda signum, frame: _raise_outside_gc(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


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
            _raise_outside_gc(frame)

    def check() -> None:
        if pressed[0]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
