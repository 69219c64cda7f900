"""Ctrl-C: raised where it can be acted on, never lost.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs next, and when that
is inside a garbage-collection callback (JAX registers one), a weakref callback or
a finalizer, the interrupt is reported as "exception ignored" and swallowed:
tracing, compiling or training goes on as if nothing was pressed (1 press in 7
during training, on a loaded machine). So:

- :func:`reliable_interrupts` (the CLI, around everything): a press swallowed that
  way (Python hands it to ``sys.unraisablehook``) is delivered again a moment later,
  and the press is remembered: an error that follows it (JAX and the model checks
  may turn an interrupt raised inside a trace into an error of their own) is the
  press, not a fault of the config;
- :func:`interrupts_between_calls` (the training loop): the first press is only
  noted and the loop raises it between device calls, where the newest state can
  be checkpointed; a second press raises at once.

A process started with SIGINT ignored (a background job of a script, a supervisor
that asked for it) keeps it ignored: a Ctrl-C meant for the terminal's foreground
command does not stop it.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from typing import Callable, Iterator

__all__ = ["interrupts_between_calls", "reliable_interrupts"]


def _redeliver_soon() -> None:
    threading.Timer(0.05, _thread.interrupt_main).start()


@contextlib.contextmanager
def _sigint_handled_by(handler: Callable) -> Iterator[bool]:
    """Within: SIGINT runs ``handler``, unless the process has it ignored (then it stays so);
    yields whether ``handler`` was installed. After: the handler before, whatever it was."""
    previous = signal.getsignal(signal.SIGINT)
    installed = previous is not signal.SIG_IGN
    if installed:
        signal.signal(signal.SIGINT, handler)
    try:
        yield installed
    finally:
        if installed:  # None: a handler installed outside Python, which signal.signal cannot put back
            signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def _swallowed_interrupts_redelivered() -> Iterator[None]:
    """Within: a ``KeyboardInterrupt`` Python could not raise (it reports it to
    ``sys.unraisablehook``) is raised again a moment later, where it can be."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _redeliver_soon()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:  # not one set since, for good: the run's log until exit (library_log)
            sys.unraisablehook = previous


@contextlib.contextmanager
def reliable_interrupts() -> Iterator[Callable[[], bool]]:
    """Within: Ctrl-C raises ``KeyboardInterrupt`` as usual, and one that lands where
    Python swallows exceptions (a gc or weakref callback) is raised again just after.
    Yields a function that says whether Ctrl-C was pressed within. Outside the main
    thread: nothing changes (and nothing is seen pressed)."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    pressed = [False]

    def press(signum, frame):
        pressed[0] = True
        raise KeyboardInterrupt

    with _sigint_handled_by(press), _swallowed_interrupts_redelivered():
        yield lambda: pressed[0]


@contextlib.contextmanager
def interrupts_between_calls() -> Iterator[Callable[[], None]]:
    """Within: Ctrl-C is noted; the function yielded raises ``KeyboardInterrupt`` once
    one was. A second Ctrl-C raises at once. Outside the main thread: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    pressed = [0]

    def note(signum, frame):
        pressed[0] += 1
        if pressed[0] > 1:  # a second press: the user means now
            raise KeyboardInterrupt

    def check() -> None:
        if pressed[0]:
            raise KeyboardInterrupt

    with _sigint_handled_by(note), _swallowed_interrupts_redelivered():
        yield check
