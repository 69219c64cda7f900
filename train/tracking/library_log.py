"""What libraries say while a run trains (orbax's and absl's logs, warnings,
tracebacks of background threads and of callbacks) goes to a file in the
workdir, not to the user's terminal: there the run's own lines are the whole
story, one line for an error. The file keeps every detail for whoever needs it.

That includes what their objects say when they are finalized: garbage in
reference cycles (an orbax read that failed on a corrupt checkpoint leaves its
unfinished read coroutines so, each printing a 60-line traceback with a
TensorStore spec as it is closed) is collected before the file is let go, not
whenever the garbage collector next runs, which for a run stopping on an error
is at interpreter exit, on the terminal after the run's error line."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
from typing import Any, Iterator

__all__ = ["to_file", "to_file_until_exit"]


class _QuietFileHandler(logging.FileHandler):
    """A log file that says nothing when it cannot be written (a full disk): the run's own error line does."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    with contextlib.suppress(Exception):
        logging.getLogger("train").error("uncaught exception in thread %s", getattr(args.thread, "name", "?"),
                                         exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def _log_unraisable(args: Any) -> None:  # raised where nothing can catch it: a C library's callback, a finalizer
    with contextlib.suppress(Exception):
        logging.getLogger("train").error("%s: %r", args.err_msg or "exception ignored", args.object,
                                         exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def _install(path: str) -> tuple | None:
    """Routes logs, warnings and stray exceptions to ``path``; what to restore (None if it cannot be opened)."""
    try:
        handler = _QuietFileHandler(path, encoding="utf-8")
    except OSError:
        return None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    terminal = [h for h in root.handlers if not isinstance(h, logging.FileHandler)]
    for h in terminal:
        root.removeHandler(h)
    root.addHandler(handler)
    saved = (handler, terminal, threading.excepthook, sys.unraisablehook)
    threading.excepthook, sys.unraisablehook = _log_thread_exception, _log_unraisable
    logging.captureWarnings(True)
    return saved


@contextlib.contextmanager
def to_file(path: str) -> Iterator[None]:
    """While inside, log records, ``warnings`` and uncaught exceptions of other
    threads and callbacks go to ``path`` (appended) instead of the terminal."""
    saved = _install(path)
    try:
        yield
    finally:
        if saved is not None:
            gc.collect()  # the run's garbage finalized while its output still goes to the file
            handler, terminal, threading.excepthook, sys.unraisablehook = saved
            logging.captureWarnings(False)
            root = logging.getLogger()
            root.removeHandler(handler)
            with contextlib.suppress(OSError):
                handler.close()
            for h in terminal:
                root.addHandler(h)


def to_file_until_exit(workdir: str) -> None:
    """For the command line after a run stopped on an error: what libraries still
    say while the process ends (unfinished writes cleaned up by the garbage
    collector) goes to ``WORKDIR/train.log`` too."""
    if os.path.isdir(workdir) and _install(os.path.join(workdir, "train.log")) is not None:
        gc.collect()  # now, into the file: not at interpreter exit, when the file is no longer ours
